"""`python -m benchmarks [--quick] [--only NAME[,NAME]]`: run the benchmarks, write benchmarks/RESULTS.md.

Each benchmark is a module of this package with `main(quick: bool)` that measures and writes its own
section of RESULTS.md (report.write_section) and its CSV. To add one, write the module and add its name
to BENCHMARKS.
"""
import argparse
import importlib
import time

BENCHMARKS = [
    "plan_quality",      # 1. bytes and memory of autoshard's plans vs torch's (gloo ranks)
    "runtime_overhead",  # 2. step time vs hand-written Megatron, DTensor, single device (gloo ranks)
    "planning",          # 3. planning time vs model, depth and mesh size (meta weights)
    "pipeline_bubbles",  # 4. bubble fraction and activation memory per pipeline schedule (gloo ranks)
    "planning_scale",    # 5. (dp, tp, pp) choices for 1.7B...1T GPT shapes on A100 clusters vs Megatron-LM (paper)
    "parallel_modes",    # 6. 2D/2.5D/3D bytes per layer vs the papers, ZeRO memory vs theory (simulator)
    "big_model_memory",  # 7. peak RSS per rank: a 2.2 GiB meta Llama read from safetensors vs the full model (gloo)
    "planning_llama",    # 8. torchtitan's Llama 3.1 8B/70B/405B runs on H100 clusters: choice and tokens/s vs published
    "planning_cli",      # 9. `python -m autoshard plan` at the Llama 3 8B/70B/405B shapes: time and memory vs targets
    "compiled",          # 10. parallelize(compile=True) vs eager: step time per rank and equality (gloo ranks)
    "overlap",           # 11. overlapped gradient sync / ZeRO-3 vs DDP and FSDP2, step time (gloo ranks)
    "context_parallel",  # 12. context parallelism: memory at 32k, bytes vs formula, the planner's choice (gloo + meta)
    "moe",               # 13. MoE: all-to-all bytes vs the formula (simulator); the planner's choice for 8 and 64 experts
    "hand_plans",        # 14. the automatic plan vs every catalogue hand plan (DDP ... FSDP x TP x PP), one cost model
    "memory_accuracy",   # 15. memory per rank: predicted vs measured term by term, peak of live storages (gloo ranks)
    "architectures",     # 16. every transformers family with a head: export, verify dp=2 and (2,2) under a budget, plan (2,2,2)
    "planning_moe",      # 17. a Mixtral-8x22B-sized MoE on 256 H100s: devices= plan vs experts inside dp, planning time
    "prediction_accuracy",  # 18. after calibrate: predicted vs measured step per plan, and the planner's ranking (gloo)
    "rank_waits",        # 19. per rank: each phase, the least any rank paid, the ranks waiting for each other (gloo)
    "planning_budgeted",  # 20. small models under a binding memory budget: planning time, large searches not run vs run
]


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (argparse: `--help` prints it and runs nothing).

    >>> parse_args(["--only", "hand_plans,planning_cli", "--quick"]).only
    ['hand_plans', 'planning_cli']
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description="Run the benchmarks; each writes its "
                                     "section of benchmarks/RESULTS.md and its CSV.")
    parser.add_argument("--quick", action="store_true", help="the smallest cases only (a smoke run)")
    parser.add_argument("--only", type=lambda text: text.split(","), default=list(BENCHMARKS),
                        help=f"comma-separated benchmark names (default: all): {', '.join(BENCHMARKS)}")
    args = parser.parse_args(argv)
    unknown = [n for n in args.only if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {BENCHMARKS}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    for name in args.only:
        began = time.perf_counter()
        importlib.import_module(f"benchmarks.{name}").main(quick=args.quick)
        print(f"[benchmarks] {name}: {time.perf_counter() - began:.0f} s", flush=True)
    print(f"[benchmarks] all: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
