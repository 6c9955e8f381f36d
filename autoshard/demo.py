"""The main demo: GPT-2-style model on a (2,2,2) mesh — plan, one rank's graph, 8 real gloo ranks.

    python -m autoshard.demo

Axes: `dp` and `sp` both shard the batch (nested), `tp` runs Megatron tensor parallelism.
"""
from __future__ import annotations

import sys
import time

from .program import parallelize
from .verify import build_case, verify_factory
from .zoo.hints import plan_hints

FACTORY = "autoshard.zoo:gpt2"
MESH, NAMES = (2, 2, 2), ("dp", "sp", "tp")


def main() -> int:
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
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
