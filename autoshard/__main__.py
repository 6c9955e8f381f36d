"""Command line: `python -m autoshard plan|verify MODULE:FACTORY --mesh 2,2,2 ...` (see DESIGN.md) and
`python -m autoshard calibrate --mesh 2,2 [--output profile.json]`.

Exit codes (distinct, so scripts and CI can tell a wrong program from a run that never finished):

- 0 success (verify: every difference within its tolerance);
- 1 verify ran and found a mismatch (a difference above its tolerance);
- 2 bad input: arguments, factory, model, inputs, loss function, hints, or a model that cannot be
  exported or planned (the message says what to fix);
- 3 could not run: a rank crashed, hung, timed out or planned a different program, or autoshard itself
  failed (an internal error; the traceback is printed).

>>> main(["plan", "autoshard.zoo:mlp", "--mesh", "2", "--axis-names", "dp"])  # doctest: +ELLIPSIS
Plan on Mesh(dp=2): 18 nodes, ...
0
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback

from autoshard.api import parallelize
from autoshard.cost.calibrate import CALIBRATION_SIZES, DTYPES, calibrate_command
from autoshard.cost.profiles import load_profile
from autoshard.frontend.factory import make_case
from autoshard.frontend.hints import Hints
from autoshard.frontend.request import DEFAULT_HEADROOM
from autoshard.ir.errors import AutoshardError, UserInputError
from autoshard.ir.gc_tuning import fewer_collections
from autoshard.ir.mesh import Mesh
from autoshard.runtime.communicator import CollectiveTimeout
from autoshard.runtime.launch import FingerprintMismatch, RanksFailed
from autoshard.verify.verify import verify_factory

OK, MISMATCH, BAD_INPUT, COULD_NOT_RUN = 0, 1, 2, 3


def _mesh(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(p) for p in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mesh {text!r}: give comma-separated sizes, e.g. 2,2,2") from None
    return sizes


def _sizes(text: str) -> list[int]:
    try:
        return [int(p) for p in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated layer counts, e.g. 4,3") from None


def _pipeline(args):
    """The pipeline= argument of parallelize from the command line (None: the mesh decides)."""
    if args.no_pipeline:
        return False
    given = {"schedule": args.schedule, "microbatches": args.microbatches, "virtual_stages": args.virtual_stages,
             "balance": args.balance, "split_points": list(args.split_points) if args.split_points else None}
    given = {k: v for k, v in given.items() if v is not None}
    return given or None


def _names(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(","))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m autoshard", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, helptext in (("plan", "plan a model and print the plan"),
                           ("verify", "train on real gloo ranks and compare with the single device")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("factory", help="MODULE:FACTORY returning (model, example_inputs[, loss_fn])")
        if name == "plan":
            shape = p.add_mutually_exclusive_group(required=True)
            shape.add_argument("--mesh", type=_mesh, help="mesh sizes, e.g. 2,2,2")
            shape.add_argument("--devices", type=int, help="a number of devices: the planner chooses the mesh shape")
        else:
            p.add_argument("--mesh", type=_mesh, required=True, help="mesh sizes, e.g. 2,2,2")
        p.add_argument("--axis-names", type=_names, default=None, help="e.g. dp,sp,tp")
        p.add_argument("--hints", default=None, help="hint file (JSON)")
        p.add_argument("--json", action="store_true", help="print JSON")
        p.add_argument("--profile", default=None, help="hardware profile: gpu (default), cpu, or a JSON file")
        p.add_argument("--memory-budget", type=float, default=None,
                       help="bytes per device (default: the profile's device memory less the headroom)")
        p.add_argument("--ilp-time-limit", type=float, default=None,
                       help="seconds each sharding ILP may search (default: scaled to its size); a search it stops "
                            "gives the best plan found, with its optimality gap in the plan's summary")
        p.add_argument("--memory-headroom", type=float, default=DEFAULT_HEADROOM,
                       help=f"share of device memory plans leave free when no budget is given (default "
                            f"{DEFAULT_HEADROOM})")
        p.add_argument("--schedule", default=None, help="pipeline schedule (the mesh axis named pp): GPipe, 1F1B, "
                       "Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble")
        p.add_argument("--microbatches", type=int, default=None, help="pipeline micro-batches (default: searched)")
        p.add_argument("--virtual-stages", type=int, default=None, help="pipeline stages per rank")
        p.add_argument("--balance", type=_sizes, default=None, help="layers per stage (FairScale), e.g. 4,3")
        p.add_argument("--split-points", type=_names, default=None, help="modules beginning a stage, e.g. layers.4")
        p.add_argument("--no-pipeline", action="store_true", help="never pipeline (unnamed meshes: no axis search)")
        p.add_argument("--no-fold", action="store_true",
                       help="trace every repeated layer (default: a long stack of identical layers is planned from three)")
        p.add_argument("--mixed-precision", choices=("bf16", "fp16"), default=None,
                       help="bf16 (or fp16, with GradScaler's loss scaling) compute from float32 master weights"
                            + (" on both sides (use with --dtype float32)" if name == "verify" else ""))
        if name == "verify":
            p.add_argument("--steps", type=int, default=2, help="SGD steps (default 2)")
            p.add_argument("--lr", type=float, default=0.1)
            p.add_argument("--simulate", action="store_true", help="run the ranks in this process instead")
            p.add_argument("--accumulate", type=int, default=1,
                           help="forward/backward passes per step over that many slices of the batch (default 1)")
            p.add_argument("--clip-grad-norm", type=float, default=None,
                           help="clip gradients by their global norm to this value before each step")
            p.add_argument("--rng", choices=("exact", "placement"), default="exact",
                           help="dropout masks: each rank's block of the single device's (exact, default) or "
                                "drawn per placement as in training (placement: compares only without dropout)")
            p.add_argument("--seed", type=int, default=0, help="seed of the random ops on both sides (default 0)")
            p.add_argument("--dtype", choices=("float64", "float32", "bfloat16"), default="float64",
                           help="compare in this dtype (default float64, tolerance 1e-6); float32/bfloat16 for "
                                "models with ops that have no float64 kernel, tolerance from the model's own noise")
            p.add_argument("--compile", action="store_true",
                           help="torch.compile each rank's program (inductor; needs a C++ compiler on the CPU)")
        else:
            p.add_argument("--rank", type=int, default=None, help="also print this rank's graph")
    cal = sub.add_parser("calibrate", help="measure alpha/beta of each mesh axis on gloo ranks; write a profile")
    cal.add_argument("--mesh", type=_mesh, required=True, help="mesh sizes, e.g. 2,2")
    cal.add_argument("--axis-names", type=_names, default=None)
    cal.add_argument("--output", default=None, help="write the profile JSON here")
    cal.add_argument("--sizes", default=",".join(map(str, CALIBRATION_SIZES)),
                     help="message sizes in bytes (default up to 16 MiB: gradient buckets are that large)")
    cal.add_argument("--dtypes", type=_names, default=DTYPES,
                     help=f"matmul dtypes to time (default {','.join(DTYPES)}; those you train in)")
    return parser


def main(argv=None) -> int:
    """The command line (argv: the arguments after `python -m autoshard`); returns the exit code.

    >>> main(["verify", "autoshard.zoo:mlp", "--mesh", "2", "--hints", "no_such_file.json"])
    2
    """
    args = _parser().parse_args(argv)
    try:
        with fewer_collections():  # a short-lived process: its factory's imports and model too (ir/gc_tuning.py)
            return _run(args)
    except BrokenPipeError:  # the reader stopped early (`... | head`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return OK
    except Exception as exc:  # every failure becomes a message and an exit code, never a bare traceback
        code = exit_code(exc)
        if code == BAD_INPUT:
            print(f"autoshard: error: {exc}", file=sys.stderr)
        elif isinstance(exc, AutoshardError):
            print(f"autoshard: could not run: {exc}", file=sys.stderr)
        else:
            traceback.print_exc()
            print(f"autoshard: could not run: {type(exc).__name__}: {exc}\nThis is an internal error or a crash "
                  "in a rank; the traceback above shows where (report it with the command line)", file=sys.stderr)
        return code


def exit_code(exc: BaseException) -> int:
    """The exit code for an exception: BAD_INPUT (2) for autoshard's own errors about what it was given,
    COULD_NOT_RUN (3) for ranks that failed, hung or disagreed, and for anything unexpected.

    >>> from autoshard.ir.errors import UserInputError
    >>> from autoshard.runtime.launch import RanksFailed
    >>> died = RanksFailed("rank 1 died", {}, {1: -9}, [])
    >>> exit_code(UserInputError("bad mesh")), exit_code(died), exit_code(RuntimeError("simulated rank 0 failed"))
    (2, 3, 3)
    """
    if isinstance(exc, (RanksFailed, CollectiveTimeout, FingerprintMismatch)):
        return COULD_NOT_RUN
    return BAD_INPUT if isinstance(exc, AutoshardError) else COULD_NOT_RUN


def _run(args) -> int:
    if args.command == "calibrate":
        return calibrate_command(args)
    hints = Hints.load(args.hints).to_json() if args.hints else None
    devices = getattr(args, "devices", None)
    if devices is not None and args.axis_names is not None:
        raise UserInputError("--axis-names names the axes of --mesh; with --devices the planner chooses the mesh and "
                             "each axis's role")
    mesh = Mesh.of(args.mesh, args.axis_names) if devices is None else None
    options = {"profile": load_profile(args.profile), "memory_budget": args.memory_budget,
               "memory_headroom": args.memory_headroom, "pipeline": _pipeline(args), "fold_layers": not args.no_fold,
               "ilp_time_limit": args.ilp_time_limit}
    if args.command == "plan":
        model, inputs, loss_fn = make_case(args.factory)  # planned in the model's own dtype
        prog = parallelize(model, mesh, inputs, hints=hints, loss_fn=loss_fn, mixed_precision=args.mixed_precision,
                           devices=devices, **options)
        if args.json:
            extra = {"fingerprint": prog.plan.fingerprint, "ilp": prog.state.ilp_stats,
                     "ilp_stopped": [r.to_json() for r in prog.state.ilp_stopped], "axis_roles": prog.plan.axis_roles(),
                     "step_s": prog.plan.step_s}  # the step (a pipeline's schedule, not one micro-batch)
            print(json.dumps(prog.plan.to_json() | extra, indent=1, sort_keys=True))
        else:
            if devices is not None:
                print(f"{devices} devices: {prog.plan.search['why_mesh']}\n")
            print(prog.plan)
            budget = prog.plan.memory_budget()
            if budget is not None:
                source = "as given" if args.memory_budget else \
                    f"the device memory less {args.memory_headroom:.0%} headroom"
                used = prog.plan.predicted["memory_bytes_per_rank"] / budget
                print(f"\nmemory budget {budget / 2**30:.2f} GiB per device ({source}); the plan uses {used:.0%} of it")
            if args.rank is not None:
                graph = prog.graph(args.rank)
                print(graph.print_readable(print_output=False) if hasattr(graph, "print_readable") else graph)
        return OK
    report, _ = verify_factory(args.factory, mesh, hints=hints, steps=args.steps, lr=args.lr, simulate=args.simulate,
                               dtype=args.dtype, accumulate=args.accumulate, clip_grad_norm=args.clip_grad_norm,
                               rng=args.rng, seed=args.seed, mixed_precision=args.mixed_precision,
                               compile=args.compile, **options)
    print(json.dumps(report.to_json(), indent=1, sort_keys=True) if args.json else report)
    return OK if report.ok else MISMATCH


def exit_now(code: int) -> None:
    """End a `plan` process without the interpreter's teardown: freeing every object a plan made took 1.3 s of an
    8B plan's 9.3 s (mypy ends the same way). Output and logs are flushed first; `plan` starts no process, thread
    pool or file that needs an exit handler (verify and calibrate do, and exit normally).

    >>> callable(exit_now)  # it ends the process: not run here
    True
    """
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    status = main()
    if sys.argv[1:2] == ["plan"]:
        exit_now(status)
    sys.exit(status)
