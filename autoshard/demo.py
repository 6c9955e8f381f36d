"""The main demo: GPT-2-style model on a (2,2,2) mesh — plan, one rank's graph, 8 real gloo ranks;
then the same model pipelined over one axis of the mesh (pp x dp x tp).

    python -m autoshard.demo

Axes: `dp` and `sp` both shard the batch (nested), `tp` runs Megatron tensor parallelism.
"""
from __future__ import annotations

import sys
import time

from autoshard.api import parallelize
from autoshard.verify.verify import build_case, verify_factory
from autoshard.zoo.hints import plan_hints

FACTORY = "autoshard.zoo:gpt2"
MESH, NAMES = (2, 2, 2), ("dp", "sp", "tp")
PIPE_NAMES = ("pp", "dp", "tp")


def main() -> int:
    """Run the demo; 0 when both verifications agree with the single device. It spawns 8 gloo ranks twice
    (a minute or more on a small machine), so the example does not run here:

    >>> main()  # doctest: +SKIP
    planned in 1.23 s
    ...
    0
    """
    hints = plan_hints("gpt2", NAMES, batch_axes=("dp", "sp"), tp_axis="tp")
    model, inputs, loss_fn = build_case(FACTORY)
    start = time.perf_counter()
    prog = parallelize(model, MESH, inputs, hints=hints, loss_fn=loss_fn, axis_names=NAMES)
    print(f"planned in {time.perf_counter() - start:.2f} s\n")
    print(prog.plan.summary())
    print("\nCollectives in the plan:")
    print(prog.plan.table(prog.plan.collectives()))
    print("\nPasses:")
    print(prog.history.summary())
    print("\nRank 3's program (first layer's attention):")
    code = prog.graph(3).code
    lines = [line for line in code.splitlines() if "layers_0" in line or "collectives" in line]
    print("\n".join(lines[:40]))
    print("\nTraining 2 SGD steps on 8 gloo ranks and on one device (float64) ...")
    start = time.perf_counter()
    report, _ = verify_factory(FACTORY, MESH, NAMES, hints=hints, steps=2)
    print(report)
    print(f"({time.perf_counter() - start:.1f} s)")
    print("\nThe same model as a pipeline: pp x dp x tp, 1F1B over 4 micro-batches, cut automatically ...")
    pipeline = {"schedule": "1f1b", "microbatches": 4}
    piped_hints = plan_hints("gpt2", PIPE_NAMES[1:], batch_axes=("dp",), tp_axis="tp")
    piped = parallelize(model, MESH, inputs, hints=piped_hints, loss_fn=loss_fn, axis_names=PIPE_NAMES,
                        pipeline=pipeline)
    print("\n".join(line for line in piped.plan.summary().splitlines() if "pipeline" in line or "stage" in line))
    print(piped.planned_timeline())
    start = time.perf_counter()
    piped_report, _ = verify_factory(FACTORY, MESH, PIPE_NAMES, hints=piped_hints, steps=2, pipeline=pipeline)
    print(piped_report)
    print(f"({time.perf_counter() - start:.1f} s)")
    return 0 if report.ok and piped_report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
