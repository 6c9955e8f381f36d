"""Benchmark 8, planning at scale on paper against torchtitan's published Llama 3.1 runs on H100 clusters: the plan
`parallelize(model, devices=N)` returns next to torchtitan's configuration priced by the same cost model (both on the
calibrated H100-80GB profile, autoshard/cost/profiles.py), and the predicted tokens/s/GPU next to the measured one.

Sources (pytorch/torchtitan at b5bcd76c66d0acb1a08b176d9639425bc55e0b2a):
- benchmarks/llama3_h100_202412_torchtitan.md (torchtitan 9dec370, torch 1963fc8, December 2024), Tables 1, 3
  and 5: 8B on 8 and 128 GPUs (FSDP, local batch 2, selective op AC, bf16 without torch.compile: 5,762 and
  5,605 TPS/GPU, 82.4 and 67.0 GiB); 405B on 512 GPUs (FSDP 8, TP 8, PP 8, local batch 32, global 256, full AC,
  torch.compile + Float8 + AsyncTP, 1F1B: 100 TPS/GPU, 82.5 GiB; no bf16 figure is published for 405B);
- benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (torchtitan 820504e, June 2025): 70B on 256 GPUs (FSDP
  32, TP 8, torch.compile, full AC, local batch 16, bf16, vanilla TP: 597.3 TPS/GPU) and 8B on 64 GPUs (FSDP 8,
  TP 8, torch.compile, per-op SAC, local batch 12, bf16, vanilla TP: 4,378 TPS/GPU); no memory reported.
- sequence length 8192 and the AC modes: train_configs/llama3_{8b,70b,405b}.toml at 9dec370; the pipeline's
  micro-batch count is torchtitan's default, the number of stages (config_manager.py at 9dec370).
Their hardware: Grand Teton hosts of 8 H100 (96 GB HBM2e, 2.4 TB/s, 500 W power limit), NVLink inside a host,
400 Gb/s RDMA per GPU between hosts. It is planned against the H100-80GB profile's 80 GB.

Each model is transformers' LlamaForCausalLM at the Llama 3 shape (autoshard.zoo.transformers_families.llama3:
RMSNorm, RoPE, SwiGLU, grouped-query attention, untied head, vocabulary 128256) at the real width and depth on the
meta device, sequence 8192, with torchtitan's global batch (FSDP degree x local batch) as its example inputs.
Both figures are plans `parallelize` returns; the helpers are benchmarks/planning_common.py's and the checks benchmarks/plan_checks.py's.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from autoshard.cost.profiles import H100_BF16_PEAK
from autoshard.frontend.request import CompileOptions
from autoshard.zoo.transformers_families import LLAMA3_SHAPES, causal_lm, llama3

from .plan_checks import (
    NOT_VERIFIED,
    applies_summary,
    applies_text,
    built_summary,
    built_text,
    verified_text,
    verify_shrunk,
)
from .planning_common import (
    PP,
    catalogue_roles,
    figures,
    hand_plan,
    mesh_search_record,
    no_plan,
    num,
    plan,
    published_mesh,
    shape_text,
)
from .report import table, write_section

SEQ, VOCAB = 8192, 128256
# model, GPUs, FSDP, TP, PP, local batch, micro-batches, AC, what ran, measured TPS/GPU, memory GiB, source
RUNS = [
    ("8B", 8, 8, 1, 1, 2, 1, "selective", "bf16", 5762, 82.4, "Dec 2024 Table 1"),
    ("8B", 128, 128, 1, 1, 2, 1, "selective", "bf16", 5605, 67.0, "Dec 2024 Table 3"),
    ("8B", 64, 8, 8, 1, 12, 1, "selective", "bf16, compile", 4378, None, "Jun 2025 async-TP"),
    ("70B", 256, 32, 8, 1, 16, 1, "full", "bf16, compile", 597.3, None, "Jun 2025 async-TP"),
    ("405B", 512, 8, 8, 8, 32, 8, "full", "float8, compile, async TP", 100, 82.5, "Dec 2024 Table 5"),
]
QUICK = (0,)  # the 8B run on 8 GPUs
PROFILE = "h100"
LAYERS = "model.layers.*"  # transformers' module path of the repeated layers
# The narrow copy each chosen plan is verified on: the same depth, 8 kv heads as the real models (tensor
# parallelism up to 8 splits whole kv heads) under 16 query heads of 16 features, FFN 256, vocabulary 128, sequence
# 16. Heads of 16 features keep the rotary buffer (half a head: 64 entries in the real models) divisible 8 ways, as
# a plan made at the real width may split it (at 8 features its 4 entries refused such a plan).
TINY = {"vocab_size": 128, "hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 16,
        "num_key_value_heads": 8, "max_position_embeddings": 16, "rope_theta": 500000.0, "attention_dropout": 0.0,
        "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
TINY_SEQ = 16


def tiny_llama(layers: int):
    """`tiny(batch, device)` for verify_shrunk: transformers' Llama at TINY's width and `layers` deep, random
    token ids."""
    def build(batch: int, device: str):
        with torch.device(device):
            model, _, loss_fn = causal_lm("LlamaForCausalLM", "LlamaConfig", num_hidden_layers=layers, **TINY)
        ids = torch.randint(3, TINY["vocab_size"], (batch, TINY_SEQ), generator=torch.Generator().manual_seed(0))
        return model, (ids.to(device), ids.to(device)), loss_fn
    return build


def torchtitan_options(model, inputs, loss_fn, run) -> dict:
    """torchtitan's configuration as `parallelize` options: its (pp, dp, tp) mesh and the catalogue plan of the same
    layout (FSDP -> fsdp, FSDP x TP -> fsdp_tp, FSDP x TP x PP -> fsdp_tp_pp with its micro-batches: ZeRO-3 over dp,
    Megatron TP over tp, a 1F1B pipeline over pp), under the same memory budget as autoshard's plan. Full activation
    checkpointing is every layer recomputed. torchtitan's selective op AC has no counterpart here (the recomputation
    unit is a module): those runs get what the memory ladder adds to fit the budget, the fewest layers recomputed
    (`plan_run` also prices their two bounds, nothing and every layer recomputed, without a budget)."""
    _, _, dp, tp, pp, local, m, ac, *_ = run
    mesh = published_mesh({PP: pp, "dp": dp, "tp": tp})
    roles = catalogue_roles(model, inputs, loss_fn, mesh)
    hand = hand_plan(roles, mesh, dp * local, len(inputs), microbatches=m if pp > 1 else None)
    options = {"mesh": mesh.shape, **hand.options}
    if ac == "full":
        options["checkpoint"] = [LAYERS]
    return options


def plan_run(run) -> dict:
    """autoshard's plan for one published run (`parallelize(devices=GPUs)`) and torchtitan's configuration priced by
    the same cost model, each as `parallelize` returns it; the chosen plan verified on a narrow copy."""
    name, gpus, dp, _, _, local, *_ = run
    model, inputs, loss_fn = llama3(name.lower(), batch=dp * local, seq=SEQ)
    auto, error, wall, cpu = plan(model, inputs, loss_fn, devices=gpus, profile=PROFILE)
    options = torchtitan_options(model, inputs, loss_fn, run)
    published, published_error, _, _ = plan(model, inputs, loss_fn, profile=PROFILE, **options)
    bounds = None
    if "checkpoint" not in options:  # selective op AC lies between recomputing nothing and every layer
        unbounded = dict(options, memory_budget=float("inf"))
        bounds = [plan(model, inputs, loss_fn, profile=PROFILE, **unbounded)[0],
                  plan(model, inputs, loss_fn, profile=PROFILE, **unbounded, checkpoint=[LAYERS])[0]]
    check = verify_shrunk(auto, tiny_llama(LLAMA3_SHAPES[name.lower()][0]), dp * local, PROFILE,
                          (model, inputs, loss_fn)) \
        if auto is not None else NOT_VERIFIED
    candidates, why = mesh_search_record(auto, error, gpus, PROFILE)
    return {"run": run, "batch": dp * local, "auto": figures(auto) if auto is not None else no_plan(error),
            "published": figures(published) if published else no_plan(published_error),
            "published_bounds": [figures(b) if b else None for b in bounds] if bounds else None, "candidates": candidates, "why": why,
            "planning_s": wall, "planning_cpu_s": cpu, "verify": check,
            "budget": CompileOptions.parse(profile=PROFILE, mixed_precision="bf16").memory_budget}


def flops_per_token(name: str) -> float:
    """torchtitan's count (get_num_flop_per_token): 6 x the parameters without the embedding + 12 x layers x heads x
    head dim x sequence (attention)."""
    layers, dim, heads, kv, ffn = LLAMA3_SHAPES[name.lower()]
    head = dim // heads
    per_layer = dim * dim * 2 + dim * kv * head * 2 + 3 * dim * ffn + 2 * dim
    params = layers * per_layer + dim + dim * VOCAB  # the norms, the final norm and the head
    return 6 * params + 12 * layers * heads * head * SEQ


def bounds_text(auto: dict, bounds) -> str:
    """A selective-AC run's two bounds priced without a budget: recomputing nothing and every layer, each with its
    memory and autoshard's ratio to it."""
    if not bounds:
        return "-"
    return " / ".join(f"{b['step_s']:.2f} s, {b['memory_bytes'] / 1e9:.1f} GB, ratio {auto['step_s'] / b['step_s']:.3f}"
                      if b else "no plan" for b in bounds)


def tokens(r, step_s: float) -> float:
    """Tokens/s/GPU of a predicted step: global batch x 8192 / (step x GPUs)."""
    return r["batch"] * SEQ / (step_s * r["run"][1])


def report(results):
    """The section's tables, CSV headers and rows, and the runs that miss the target."""
    configs, figures_rows, measured_rows, checks, csv_rows, misses = [], [], [], [], [], []
    for r in results:
        auto, pub, bounds, check = r["auto"], r["published"], r["published_bounds"], r["verify"]
        model, gpus, dp, tp, pp, local, m, ac, ran, measured, memory, source = r["run"]
        label = f"Llama 3.1 {model}, {gpus} GPUs"
        ratio = auto["step_s"] / pub["step_s"]
        # torchtitan's configuration with no plan under the budget cannot be the faster plan that fits
        met = auto["memory_bytes"] <= r["budget"] and (ratio <= 1.0 + 1e-9 or not pub["mesh"])
        if not met:
            misses.append(f"{model} on {gpus}")
        published = f"FSDP {dp}, TP {tp}, PP {pp}, local batch {local}" + (f", {m} micro-batches" if pp > 1 else "") \
            + f", {ac} AC"
        configs.append([label, published, shape_text(pub), pub["zero"], pub["pipeline"],
                        f"{pub['recomputed']} / {LLAMA3_SHAPES[model.lower()][0]}", shape_text(auto), auto["roles"],
                        auto["zero"], auto["pipeline"], f"{auto['recomputed']} / {LLAMA3_SHAPES[model.lower()][0]}",
                        auto["chosen_plan"] or "automatic"])
        figures_rows.append([label, num(auto["step_s"], ".2f"), num(pub["step_s"], ".2f"), num(ratio, ".3f"),
                             "yes" if met else "NO", num(auto["memory_bytes"] / 1e9, ".1f"),
                             num(pub["memory_bytes"] / 1e9, ".1f"),
                             bounds_text(auto, bounds),
                             f"{r['budget'] / 1e9:.0f}", f"{r['planning_s']:.0f} / {r['planning_cpu_s']:.0f}",
                             f"{sum('predicted_step_s' in c for c in r['candidates'])} of {len(r['candidates'])}"])
        predicted_pub = tokens(r, pub["step_s"])
        measured_rows.append([label, ran, source, f"{measured:,}", f"{memory} GiB" if memory else "—",
                              num(predicted_pub, ",.0f"), num(predicted_pub / measured, ".2f"),
                              num(predicted_pub * flops_per_token(model) / H100_BF16_PEAK, ".1%"),
                              num(tokens(r, auto["step_s"]), ",.0f")])
        checks.append([label, shape_text(auto), built_text(check), applies_text(check), verified_text(check),
                       check["roles"] or "-",
                       f"{check['seconds']:.0f}"])
        csv_rows.append([model, gpus, dp, tp, pp, local, m, ac, ran, measured, memory or "",
                         "x".join(map(str, pub["mesh"])), pub["roles"], num(pub["step_s"], ".4g"),
                         num(pub["memory_bytes"], ".4g"), num(predicted_pub, ".4g"),
                         *[f"{b[key]:.4g}" if bounds and b else "" for b in (bounds or [None, None])
                           for key in ("step_s", "memory_bytes")],
                         "x".join(map(str, auto["mesh"])), auto["roles"], auto["zero"], auto["pipeline"],
                         auto["recomputed"], auto["chosen_plan"], num(auto["step_s"], ".4g"),
                         num(auto["memory_bytes"], ".4g"), num(tokens(r, auto["step_s"]), ".4g"), num(ratio, ".4f"),
                         f"{r['budget']:.4g}", f"{r['planning_s']:.2f}", f"{r['planning_cpu_s']:.2f}",
                         len(r["candidates"]), bool(check["built_ranks"]), check["applies"],
                         "x".join(map(str, check["mesh"])), check["batch"],
                         check["ok"], f"{check['seconds']:.1f}", "yes" if met else "no"])
    headers = (["published run", "torchtitan's configuration", "its mesh here", "its ZeRO", "its pipeline",
                "its recomputed layers", "autoshard's mesh (devices=GPUs)", "what each axis does", "ZeRO", "pipeline",
                "recomputed layers", "plan the search kept"],
               ["published run", "predicted step s (autoshard)", "predicted step s (torchtitan's)",
                "ratio autoshard / torchtitan", "met", "memory GB (autoshard)", "memory GB (torchtitan's)",
                "selective AC's bounds, no budget: nothing / every layer recomputed", "budget GB",
                "planning s (wall / CPU, workers included)", "meshes with a plan"],
               ["published run", "what ran", "source", "measured TPS/GPU", "measured memory",
                "predicted TPS/GPU (torchtitan's config)", "predicted / measured", "predicted MFU (989 TF)",
                "predicted TPS/GPU (autoshard)"],
               ["published run", "chosen mesh", "its plan file builds rank programs (real width)",
                "the plan applies at width 256 (plan_other_shapes)",
                "its decisions trained at width 256 (float64, simulator)", "what each axis does there", "verify s"])
    csv_headers = ["model", "gpus", "fsdp", "tp", "pp", "local_batch", "microbatches", "ac", "ran",
                   "measured_tps_per_gpu", "measured_memory_gib", "published_mesh", "published_roles",
                   "published_step_s", "published_memory_bytes", "published_predicted_tps_per_gpu",
                   "published_no_ac_step_s", "published_no_ac_memory_bytes", "published_full_ac_step_s",
                   "published_full_ac_memory_bytes", "mesh", "roles",
                   "zero", "pipeline", "recomputed_layers", "chosen_plan", "step_s", "memory_bytes",
                   "predicted_tps_per_gpu", "ratio", "budget_bytes", "planning_s", "planning_cpu_s", "meshes_tried",
                   "rank_programs_built", "plan_applies_narrow", "verify_mesh", "verify_batch", "verify_ok", "verify_s", "met"]
    return (configs, figures_rows, measured_rows, checks), headers, csv_headers, csv_rows, misses


def text(results, misses) -> str:
    """The section's opening: what is compared and the verdict."""
    met = [f"{r['run'][0]} on {r['run'][1]}" for r in results if f"{r['run'][0]} on {r['run'][1]}" not in misses]
    verdict = "**met for every run**" if not misses else \
        f"**met for {', '.join(met) or 'no run'}; NOT met for {', '.join(misses)}**"
    return (
        "What is compared: for each published torchtitan Llama 3.1 run, the plan `parallelize(model, devices=GPUs, "
        "example_inputs=<torchtitan's global batch of 8192-token sequences>, loss_fn=..., mixed_precision=\"bf16\", "
        "profile=\"h100\")` returns (the mesh shape it kept and everything the compiler chose on it) next to "
        "torchtitan's configuration planned by `parallelize` on its own mesh with the catalogue plan of the same "
        "layout (autoshard/catalogue/hand_plans.py): FSDP -> `fsdp` on (dp), FSDP x TP -> `fsdp_tp` on (dp, tp), "
        "FSDP x TP x PP -> `fsdp_tp_pp` on (pp, dp, tp) with its 8 micro-batches and 1F1B; full activation "
        "checkpointing as every layer recomputed (`checkpoint=[\"model.layers.*\"]`); the same memory budget as "
        "autoshard's plan. torchtitan's selective op AC has no counterpart (autoshard recomputes whole modules, not "
        "single ops): those runs get what the memory ladder adds to fit the budget, the fewest layers recomputed "
        "(slower than selective AC for the bytes it saves, faster than recomputing every layer); the ratio and the "
        "verdict use it. Their two bounds without a budget are in the second table: recomputing nothing (faster than "
        "they ran, and far over the budget in this memory model) and every layer. Both plans are predicted by the same "
        "cost model on the calibrated H100-80GB profile. Target: autoshard's plan fits the budget (72 GB: 80 GB less "
        f"the 10% headroom) and is predicted no slower than torchtitan's configuration (ratio <= 1.00) — {verdict}.")


def notes(results) -> str:
    """How it is planned, what the comparison cannot see, reading the gaps."""
    checked = [r for r in results if r["verify"]["mesh"]]
    gap = {f"{r['run'][0]}/{r['run'][1]}": tokens(r, r["published"]["step_s"]) / r["run"][9] for r in results}
    def at(key, values, spec=".2f") -> str:
        return format(values[key], spec) if key in values else "—"
    return (
        "How autoshard's plan is made: as in section 5, `parallelize(devices=N)` plans the model on each candidate "
        "mesh shape (at most 6; the last column of the second table says how many found a plan) and keeps the "
        "fastest predicted step; on each shape the ILP gives the axes their roles, the pipeline search tries each "
        "axis as a pipeline (micro-batch counts estimated over every multiple of p from plans at p or 2p and at one "
        "sample per data-parallel device; the schedules 1F1B, interleaved and zero-bubble), the "
        "catalogue's hand plans are compared with the ILP's, and the memory ladder adds ZeRO and recomputation to "
        "fit the budget. The model is transformers' LlamaForCausalLM at the real size on the meta device, depth "
        "folded. Planning seconds are the devices= call's, export included, wall and CPU of this process on a VM of "
        "2 shared CPUs. Memory is the predicted bytes per device (a pipeline's fullest pp rank).\n\n"
        "The H100-80GB profile (autoshard/cost/profiles.py) is calibrated: matmuls at 742 TFLOP/s (0.75 of the 989 "
        "TFLOP/s dense bf16 peak), other ops at 0.9 x 3.35 TB/s of HBM3, NVLink at 360 GB/s bus bandwidth, "
        "InfiniBand at 40 GB/s per GPU, 5 and 10 us per ring step: assumptions from public figures, not a "
        "measurement (no machine here has an H100).\n\n"
        + built_summary(results) + " "
        "Each chosen plan on a narrow copy (the fourth table; transformers' Llama at width 256, 16 heads on 8 kv "
        "heads, FFN 256, vocabulary 128, sequence 16, the real depth): as in section 5, \"applies\" is the plan "
        "itself applied to the narrow copy on the same mesh shape (`parallelize(plan=..., plan_other_shapes=True)`), "
        "\"trained\" its decisions as hints on the same mesh shape up to 64 ranks, else on the smallest mesh of the "
        "same axes, one step in the simulator against the single device in float64 (the model computes its rotary "
        "frequencies in float32, so verify derives the tolerance from that noise). "
        f"The decisions trained correctly for {sum(r['verify']['ok'] for r in checked)} of {len(checked)} plans. "
        + applies_summary(results, lambda r: f"{r['run'][0]} on {r['run'][1]}") + "\n\n"
        "What the comparison cannot see: float8 linears (the 405B run's only figure is float8 + async TP), "
        "torch.compile's fusions, async TP and FSDP's overlap of communication with compute (the cost model charges "
        "every collective in full, for both configurations), the 500 W power limit and HBM2e of torchtitan's H100s, "
        "fp32 gradient reduce-scatters (torchtitan's default; bf16 here), vocabulary-parallel loss (the ILP gathers "
        "the logits: the head keeps a whole vocabulary row per token, which is most of the memory of the published "
        "configurations priced without recomputation), and the memory model's approximations (every value with a "
        "gradient counted as saved; no allocator fragmentation). A pipeline's stage times include their "
        "recomputation, on both sides.\n\n"
        "Reading the figures, run by run.\n\n" + "\n".join(f"- {line}" for line in run_by_run(results)) + "\n\n"
        "Predicted against measured (tokens/s/GPU of torchtitan's configuration as priced): 8B on 8, "
        + at("8B/8", gap) + " and 8B on 128, " + at("8B/128", gap) + " (eager, bf16; selective AC priced "
        "as the layers recomputed to fit), 8B on 64, " + at("8B/64", gap) + " and 70B on 256, " + at("70B/256", gap) + " (torch.compile), "
        "405B on 512, " + at("405B/512", gap) + " (float8 with async TP, which bf16 pricing cannot reach). Above 1 the "
        "cost model is optimistic (kernel efficiency, power limit, unmodelled fusions), below 1 pessimistic (it "
        "charges FSDP's collectives without the overlap that hides them).")


def run_by_run(results) -> list[str]:
    """One line per run: the two plans in words, and what explains the ratio where the data says it."""
    lines = []
    for r in results:
        model, gpus, _, tp, pp, _, m, _, _, _, memory, _ = r["run"]
        auto, pub, bounds = r["auto"], r["published"], r["published_bounds"]
        layers = LLAMA3_SHAPES[model.lower()][0]
        line = f"{model} on {gpus} GPUs, ratio {num(auto['step_s'] / pub['step_s'], '.3f')}: autoshard "
        if not auto["mesh"]:
            lines.append(line + f"returns no plan ({auto['roles']}).")
            continue
        line += (f"on {shape_text(auto)}: {auto['roles']}; {auto['recomputed']} of {layers} layers recomputed. "
                 f"torchtitan's on {shape_text(pub)}: {pub['roles']}; {pub['recomputed']} recomputed.")
        if bounds is not None:
            none, every = bounds
            measured = f" (torchtitan measured {memory} GiB of 96 GB HBM)" if memory else ""
            line += (" Selective op AC is priced as the layers the memory ladder recomputes to fit the budget; "
                     "recomputing nothing" + (f" takes {none['step_s']:.2f} s (ratio {auto['step_s'] / none['step_s']:.3f}) "
                     f"but needs {none['memory_bytes'] / 1e9:.0f} GB a device in this memory model{measured}"
                     if none else " has no plan") + (f", every layer {every['step_s']:.2f} s (ratio "
                     f"{auto['step_s'] / every['step_s']:.3f})" if every else "") + ": what it ran lies between.")
        if pub["pipeline"] != "none":
            line += (f" torchtitan's {pp}-stage pipeline of {m} micro-batches has a 1F1B bubble of "
                     f"{pp - 1}/{m + pp - 1} of its step.")
        if tp == 1 and gpus > 8:
            line += (f" FSDP over {gpus} GPUs gathers every parameter across InfiniBand twice a step and "
                     "reduce-scatters the gradients there, which the cost model charges in full (FSDP overlaps it).")
        lines.append(line)
    return lines


def write(results, seconds: float) -> None:
    tables, headers, csv_headers, csv_rows, misses = report(results)
    body = text(results, misses) + "\n\n" + table(headers[0], tables[0]) + "\n\n" + table(headers[1], tables[1]) \
        + "\n\nPredicted against measured throughput (tokens/s/GPU = global batch x 8192 / (step x GPUs)):\n\n" \
        + table(headers[2], tables[2]) + "\n\nEach chosen plan on a narrow copy of the model:\n\n" \
        + table(headers[3], tables[3]) + "\n\n" + notes(results) \
        + f"\n\nWhole benchmark: {seconds:.0f} s for {len(results)} runs (`python -m benchmarks --only planning_llama`)."
    write_section("planning_llama", "8. Planning at scale on paper: torchtitan's Llama 3.1 runs on H100 clusters",
                  body, csv_headers, csv_rows)
    (Path(__file__).parent / "planning_llama.json").write_text(json.dumps(
        {f"{r['run'][0]}/{r['run'][1]}": {"mesh_candidates": r["candidates"], "why_mesh": r["why"],
                                          "verify": r["verify"]} for r in results}, indent=1, default=str) + "\n")


def main(quick: bool = False) -> None:
    """Plan every published run (QUICK: 8B on 8 GPUs), writing the section after each."""
    start = time.perf_counter()
    results = []
    for i, run in enumerate(RUNS):
        if quick and i not in QUICK:
            continue
        results.append(plan_run(run))
        r = results[-1]
        print(f"[planning_llama] {run[0]} on {run[1]}: autoshard {r['auto']['mesh']} {r['auto']['step_s']:.2f} s, "
              f"torchtitan's {r['published']['step_s']:.2f} s ({r['planning_s']:.0f} s planning, verified "
              f"{r['verify']['ok']})", flush=True)
        write(results, time.perf_counter() - start)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
