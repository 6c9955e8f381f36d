"""Benchmark 17, planning a mixture-of-experts model at scale on paper: the plan `parallelize(model, devices=N)`
returns for a Mixtral-8x22B-sized model (autoshard/zoo/moe.py's MoE LLaMA: 56 layers of width 6144, 48 heads on 8 kv
heads, 8 experts of FFN 16384, top-2 routing, 141B parameters) on 256 H100-80GB, next to an expert's layout priced
by the same cost model: the catalogue's expert parallelism inside data parallelism (`ep_dp`: the experts split over
the 8 GPUs of a node, the batch over all 256) on (dp=32, ep=8), with what the memory ladder adds to fit the budget
(ZeRO, recomputation). Issue 31's target: planning within 60 s, and the plan no slower than the expert's.

Both are plans `parallelize` returns, in bf16 on the meta device, sequence 4096, global batch 256; the chosen plan is
then checked on a narrow copy of the same depth (benchmarks/plan_checks.py).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import autoshard
from autoshard.catalogue import hand_plans as catalogue
from autoshard.frontend.request import CompileOptions
from autoshard.zoo.moe import moe_llama

from .plan_checks import (
    NOT_VERIFIED,
    applies_text,
    built_text,
    verified_text,
    verify_shrunk,
)
from .planning_common import (
    catalogue_roles,
    figures,
    mesh_search_record,
    no_plan,
    num,
    plan,
    shape_text,
)
from .report import table, write_section

PROFILE = "h100"
PLANNING_TARGET_S = 60.0
# name, moe_llama's shape, devices, (dp, ep) of the expert's layout, global batch, sequence
RUNS = [
    ("Mixtral-8x22B-like", {"dim": 6144, "n_heads": 48, "n_kv_heads": 8, "ffn_dim": 16384, "n_experts": 8, "top_k": 2,
                            "vocab_size": 32768, "n_layers": 56}, 256, (32, 8), 256, 4096),
]
QUICK = [  # the same structure at a small size and 8 devices (a smoke run)
    ("tiny MoE", {"dim": 256, "n_heads": 8, "n_kv_heads": 8, "ffn_dim": 512, "n_experts": 8, "top_k": 2,
                  "vocab_size": 512, "n_layers": 8}, 8, (1, 8), 16, 256),
]
GROUP = 1024  # tokens per routing group (capacity is per group)
# The narrow copy: the same depth and experts at width 64
TINY = {"dim": 64, "n_heads": 8, "n_kv_heads": 8, "ffn_dim": 64, "vocab_size": 128, "seq": 16, "group_size": 16}


def tiny_moe(layers: int, experts: int, top_k: int):
    """`tiny(batch, device)` for verify_shrunk: the MoE LLaMA at TINY's width, `layers` deep."""
    def build(batch: int, device: str):
        return moe_llama(batch=batch, n_layers=layers, n_experts=experts, top_k=top_k, device=device, **TINY)
    return build


def expert_options(model, inputs, loss_fn, dp: int, ep: int, batch: int) -> dict:
    """The expert's layout as `parallelize` options: `ep_dp` on (dp, ep), under the default budget (the memory
    ladder adds ZeRO over the batch axis and recomputation as far as it needs)."""
    names, shape = zip(*[(n, s) for n, s in (("dp", dp), ("ep", ep)) if s > 1])
    mesh = autoshard.Mesh(shape, names)
    hand = catalogue.ep_dp(catalogue_roles(model, inputs, loss_fn, mesh), mesh, batch, len(inputs), ep="ep")
    return {"mesh": mesh.shape, **hand.options}


def plan_run(run) -> dict:
    """autoshard's plan (`parallelize(devices=N)`) and the expert's layout, each as `parallelize` returns it."""
    _, shape, devices, (dp, ep), batch, seq = run
    model, inputs, loss_fn = moe_llama(batch=batch, seq=seq, group_size=min(GROUP, seq), device="meta", **shape)
    auto, error, wall, cpu = plan(model, inputs, loss_fn, devices=devices, profile=PROFILE)
    expert, expert_error, expert_s, _ = plan(model, inputs, loss_fn, profile=PROFILE,
                                             **expert_options(model, inputs, loss_fn, dp, ep, batch))
    check = verify_shrunk(auto, tiny_moe(shape["n_layers"], shape["n_experts"], shape["top_k"]), batch, PROFILE,
                          (model, inputs, loss_fn)) \
        if auto is not None else NOT_VERIFIED
    candidates, why = mesh_search_record(auto, error, devices, PROFILE)
    return {"run": run, "params": sum(p.numel() for p in model.parameters()),
            "auto": figures(auto) if auto is not None else no_plan(error),
            "expert": figures(expert) if expert is not None else no_plan(expert_error), "expert_s": expert_s,
            "candidates": candidates, "why": why, "planning_s": wall, "planning_cpu_s": cpu, "verify": check,
            "budget": CompileOptions.parse(profile=PROFILE, mixed_precision="bf16").memory_budget}


def report(results):
    """The section's table rows, CSV rows and the runs that miss a target."""
    rows, csv_rows, misses = [], [], []
    for r in results:
        name, _, devices, _, batch, seq = r["run"]
        auto, expert, check = r["auto"], r["expert"], r["verify"]
        ratio = auto["step_s"] / expert["step_s"]
        fits = auto["memory_bytes"] <= r["budget"]
        faster = fits and (ratio <= 1.0 + 1e-9 or not expert["mesh"])
        quick = r["planning_s"] <= PLANNING_TARGET_S
        if not (faster and quick):
            misses.append(name)
        label = f"{name} ({r['params'] / 1e9:.3g}B parameters), {devices} GPUs"
        rows.append([label, shape_text(auto), auto["roles"], auto["pipeline"], auto["recomputed"],
                     num(auto["step_s"], ".2f"), num(auto["memory_bytes"] / 1e9, ".1f"),
                     f"{shape_text(expert)}: {expert['roles']}", num(expert["step_s"], ".2f"),
                     num(expert["memory_bytes"] / 1e9, ".1f"), num(ratio, ".3f"), "yes" if faster else "NO",
                     f"{r['planning_s']:.0f} / {r['planning_cpu_s']:.0f}", "yes" if quick else "NO",
                     f"{sum('predicted_step_s' in c for c in r['candidates'])} of {len(r['candidates'])}",
                     built_text(check), applies_text(check), verified_text(check)])
        csv_rows.append([name, r["params"], devices, batch, seq, "x".join(map(str, auto["mesh"])), auto["roles"],
                         auto["pipeline"], auto["recomputed"], num(auto["step_s"], ".4g"),
                         num(auto["memory_bytes"], ".4g"), "x".join(map(str, expert["mesh"])), expert["roles"],
                         num(expert["step_s"], ".4g"), num(expert["memory_bytes"], ".4g"), num(ratio, ".4f"),
                         f"{r['planning_s']:.2f}", f"{r['planning_cpu_s']:.2f}", f"{r['expert_s']:.2f}",
                         bool(check["built_ranks"]), check["ok"], "yes" if faster and quick else "no"])
    headers = ["run", "autoshard's mesh (devices=GPUs)", "what each axis does", "pipeline", "recomputed layers",
               "predicted step s", "memory GB", "expert's layout (ep_dp + the memory ladder)", "its step s",
               "its memory GB", "ratio", "no slower and fits", "planning s (wall / CPU, workers included)", f"<= {PLANNING_TARGET_S:.0f} s",
               "meshes with a plan", "its plan file builds rank programs (real width)", "the plan applies at width 64",
               "its decisions trained at width 64"]
    csv_headers = ["model", "params", "gpus", "batch", "seq", "mesh", "roles", "pipeline", "recomputed_layers",
                   "step_s", "memory_bytes", "expert_mesh", "expert_roles", "expert_step_s", "expert_memory_bytes",
                   "ratio", "planning_s", "planning_cpu_s", "expert_planning_s", "rank_programs_built", "verify_ok", "met"]
    return rows, headers, csv_rows, csv_headers, misses


def write(results, seconds: float) -> None:
    rows, headers, csv_rows, csv_headers, misses = report(results)
    verdict = "**met**" if not misses else f"**NOT met for {', '.join(misses)}**"
    whys = "\n".join(f"- {r['run'][0]}: {r['why']}" for r in results)
    body = (
        "What is compared: `parallelize(model, devices=GPUs, example_inputs=<global batch of 4096-token sequences>, "
        "loss_fn=..., mixed_precision=\"bf16\", profile=\"h100\")` for a mixture-of-experts model of Mixtral-8x22B's "
        "size (autoshard/zoo/moe.py: grouped top-2 routing with capacity, 8 experts per layer, meta weights), next to "
        "an expert's layout planned by `parallelize` with the catalogue's hints: experts over the 8 GPUs of a node "
        "inside data parallelism over all of them (`ep_dp` on (dp=32, ep=8)), under the same memory budget (the "
        "memory ladder adds ZeRO and recomputation as it needs). Both are predicted by the same cost model on the "
        "H100-80GB profile. Targets (issue 31): autoshard's plan fits the budget and is predicted no slower than the "
        f"expert's (ratio <= 1.00), and planning takes at most {PLANNING_TARGET_S:.0f} s — {verdict}.\n\n"
        + table(headers, rows) + "\n\n"
        "Planning seconds are the devices= call's, export included, on this VM of 2 shared CPUs. The narrow copy "
        "checks are section 5's (benchmarks/plan_checks.py): the plan file applied to the real model on its mesh "
        "and rank 0's and the last rank's programs built from it, the plan itself applied at width 64 "
        "(`plan_other_shapes`), and its decisions trained one step in the simulator against the single device in "
        "float64.\n\nEvery shape the search planned, and why it kept one:\n\n" + whys
        + f"\n\nWhole benchmark: {seconds:.0f} s (`python -m benchmarks --only planning_moe`).")
    write_section("planning_moe", "17. Planning a mixture-of-experts model at scale on paper", body, csv_headers,
                  csv_rows)
    (Path(__file__).parent / "planning_moe.json").write_text(json.dumps(
        {r["run"][0]: {"mesh_candidates": r["candidates"], "why_mesh": r["why"], "verify": r["verify"]}
         for r in results}, indent=1, default=str) + "\n")


def main(quick: bool = False) -> None:
    """Plan each run (QUICK: a tiny MoE on 8 GPUs), writing the section after each."""
    start = time.perf_counter()
    results = []
    for run in QUICK if quick else RUNS:
        results.append(plan_run(run))
        r = results[-1]
        print(f"[planning_moe] {run[0]} on {run[2]}: autoshard {r['auto']['mesh']} {r['auto']['step_s']:.2f} s, "
              f"expert's {r['expert']['step_s']:.2f} s ({r['planning_s']:.0f} s planning, verified "
              f"{r['verify']['ok']})", flush=True)
        write(results, time.perf_counter() - start)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
