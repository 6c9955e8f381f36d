"""Benchmark 9, planning time at scale through the CLI (issue 17): `python -m autoshard plan` on transformers'
LlamaForCausalLM at the Llama 3 8B, 70B and 405B shapes (meta device, bf16 mixed precision, sequence 8192),
end to end in a fresh process: interpreter start, imports, building the model, tracing, planning and printing.

Targets: 8B on (8,8) <= 8 s named (dp, tp) and <= 12 s unnamed (the planner also searches pipelines);
70B on 512 devices (8,8,8, unnamed) <= 30 s; 405B on (8,8,8) <= 60 s. The 8B named case also runs with
`--no-fold` (every layer traced and planned), side by side, for what depth folding buys. One untimed
process imports torch and transformers first, so the first timed run does not pay for the disk cache.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from .report import table, write_csv, write_section

FACTORIES = "autoshard.zoo.transformers_families"
BF16 = ["--mixed-precision", "bf16"]
CASES = [  # name, factory, CLI arguments, target seconds
    ("Llama-3-8B (8,8) dp,tp", "llama3_8b", ["--mesh", "8,8", "--axis-names", "dp,tp", *BF16], 8.0),
    ("Llama-3-8B (8,8) unnamed", "llama3_8b", ["--mesh", "8,8", *BF16], 12.0),
    ("Llama-3-70B (8,8,8) unnamed", "llama3_70b", ["--mesh", "8,8,8", *BF16], 30.0),
    ("Llama-3-405B (8,8,8) unnamed", "llama3_405b", ["--mesh", "8,8,8", *BF16], 60.0),
    ("Llama-3-8B (8,8) dp,tp --no-fold", "llama3_8b", ["--mesh", "8,8", "--axis-names", "dp,tp", "--no-fold", *BF16],
     None),
    ("Llama-3-8B (8,8) dp,tp float32", "llama3_8b", ["--mesh", "8,8", "--axis-names", "dp,tp"], None),
    # issue 31: the planner chooses the mesh shape too (autoshard/search/mesh_search.py)
    ("Llama-3-8B --devices 64", "llama3_8b", ["--devices", "64", *BF16], 8.0),
    ("Llama-3-70B --devices 512", "llama3_70b", ["--devices", "512", *BF16], 30.0),
    ("Llama-3-405B --devices 512", "llama3_405b", ["--devices", "512", *BF16], 60.0),
]
QUICK = 1
BUDGET = 80e9 * 0.9  # the default gpu profile's 80 GB less the default 10% headroom
PARTS = ("params", "grads", "optimizer", "activations")


def run_cli(factory: str, args: list[str]) -> dict:
    """One cold `python -m autoshard plan ... --json` run: wall and CPU seconds and the plan's figures."""
    command = [sys.executable, "-m", "autoshard", "plan", f"{FACTORIES}:{factory}", *args, "--json"]
    start = time.perf_counter()
    cpu = os.times()
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    wall = time.perf_counter() - start
    after = os.times()
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    plan = json.loads(done.stdout)
    search = plan.get("search", {})
    # the mesh kept (devices=) or given: a pipelined plan's JSON holds its inner mesh
    mesh = search.get("chosen_mesh") or [int(n) for n in args[args.index("--mesh") + 1].split(",")]
    cpu_s = (after.children_user + after.children_system) - (cpu.children_user + cpu.children_system)
    return {"mesh": "x".join(str(n) for n in mesh), "wall_s": wall, "cpu_s": cpu_s,
            "step_s": plan["step_s"], "memory_gib": plan["predicted"]["memory_bytes_per_rank"] / 2**30,
            "pipeline": plan.get("pipeline", {}).get("axis") or "-", "candidates": len(search.get("candidates", [])) or 1,
            "recomputed": len(plan["hints"].get("recompute", [])), "zero": plan["hints"].get("zero") or "-",
            "parts": plan["predicted"]["memory"]}


def main(quick: bool = False) -> None:
    # Imports read torch and transformers from disk: the first process after other work pays for the page cache,
    # which is not planning time. One untimed import run first.
    subprocess.run([sys.executable, "-c", "import autoshard.__main__, transformers.models.llama.modeling_llama"],
                   capture_output=True, timeout=300, check=True)
    rows, results = [], []
    for name, factory, args, target in CASES[:QUICK] if quick else CASES:
        r = run_cli(factory, args)
        results.append((name, r, target))
        met = "-" if target is None else "yes" if r["wall_s"] <= target else "NO"
        rows.append([name, f"{r['wall_s']:.1f}", f"{r['cpu_s']:.1f}", "-" if target is None else f"{target:.0f}", met,
                     r["mesh"], r["candidates"], r["pipeline"], str(r["zero"]), r["recomputed"], f"{r['step_s']:.3g}",
                     f"{r['memory_gib']:.1f}", f"{r['memory_gib'] * 2**30 / BUDGET:.0%}",
                     " / ".join(f"{r['parts'][k] / 2**30:.1f}" for k in PARTS)])
    headers = ["case (bf16 mixed precision unless said, seq 8192)", "wall s (cold, end to end)", "CPU s", "target s", "met",
               "mesh", "plans compared", "pipeline axis", "ZeRO", "layers recomputed", "predicted step s", "memory GiB/rank",
               "of the budget", "params / grads / optimizer / activations GiB"]
    timed = [(n, r, t) for n, r, t in results if t is not None]
    missed = [n for n, r, t in timed if r["wall_s"] > t]
    load = os.getloadavg()[0]
    body = (f"Targets: {', '.join(f'{n} <= {t:.0f} s' for n, _, t in timed)} — "
            + (f"**NOT met: {', '.join(missed)}**" if missed else "**met on every row**")
            + f". Load average (1 min) when the runs ended: {load:.1f} (the CPU column is the planner's own time; "
            "this VM's speed varies from day to day: on 2026-11-26 the 8B (8,8) dp,tp plan took 7.3 s at 3cbfb38 and "
            "9.5 s at 6c4d82d the next day; "
            "on this VM's two hyperthreads another busy process inflates both columns, by about 20% beside one other "
            "planning process, and two quiet runs differ by up to 10%).\n\n" + table(headers, rows))
    body += ("\n\nMemory (issue 17 item 1): every plan fits the default budget, the device's 80 GB less 10% headroom "
             "(67.1 GiB); the planner reaches for ZeRO and recomputation by itself when the placements alone do not fit "
             "(the ZeRO and 'layers recomputed' columns), and the printed plan breaks the memory down (last column; "
             "`python -m autoshard plan` prints it under the summary). The float32 row is the issue's case that "
             "planned at 74.9 GB with no headroom before.")
    fold = {n: r for n, r, _ in results}
    if "Llama-3-8B (8,8) dp,tp --no-fold" in fold:
        a, b = fold["Llama-3-8B (8,8) dp,tp"], fold["Llama-3-8B (8,8) dp,tp --no-fold"]
        body += (f"\n\nDepth folding (autoshard/frontend/fold.py): the named 8B case takes {a['wall_s']:.1f} s folded and "
                 f"{b['wall_s']:.1f} s with every layer traced ({b['wall_s'] / a['wall_s']:.1f}x), for the same plan "
                 f"(predicted step {a['step_s']:.4g} s vs {b['step_s']:.4g} s). The rest of the time is the "
                 "interpreter, torch and transformers imports (about 3 s), building the model on the meta device, "
                 "writing the 32 layers out and printing a 3,500-row plan.")
    body += ("\n\nThe devices= rows plan every candidate mesh shape (`python -m autoshard plan ... --devices N`; the "
             "mesh column is the shape kept; 'plans compared' counts the pipeline candidates on it) and print why "
             "that shape; the ILP, the pipeline search and the memory ladder run on each, the hand plans on the kept "
             "one (and shapes within reach of it). The shapes are planned side by side in worker processes, one per "
             f"core ({os.cpu_count()} here: the CPU column is the work, the wall column what it took; "
             "autoshard/search/planning_workers.py).")
    write_section("planning_cli", "9. Planning time at scale through the CLI: Llama 3 8B, 70B, 405B", body, headers,
                  rows)
    write_csv("planning_cli", headers, rows)
