"""Benchmark 8, planning at scale on paper against torchtitan's published Llama 3.1 runs on H100 clusters:
autoshard's choice of (data, tensor, pipeline) degrees, ZeRO stage over dp, micro-batches and recomputation
next to torchtitan's configuration, both predicted by autoshard's cost model on the calibrated H100-80GB
profile (autoshard/cost/profiles.py), and the predicted tokens/s/GPU next to the measured one.

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
400 Gb/s RDMA per GPU between hosts. The issue asks for an H100-80GB profile: it is planned against 80 GB.

Each model is the zoo's LLaMA (RMSNorm, RoPE, SwiGLU, grouped-query attention, untied head) at the real
width, heads, kv heads, FFN and vocabulary 128256, sequence 8192, built on the meta device in bf16 with 3
layers and planned at the real depth (autoshard/search/scale_search.py); exported once per model.
"""
from __future__ import annotations

import sys
import time

from .report import table, write_section

SEQ, VOCAB = 8192, 128256
# name: layers, dim, heads, kv heads, FFN
MODELS = {"8B": (32, 4096, 32, 8, 14336), "70B": (80, 8192, 64, 8, 28672), "405B": (126, 16384, 128, 8, 53248)}
# model, GPUs, FSDP, TP, PP, local batch, micro-batches, AC, what ran, measured TPS/GPU, memory GiB, source
RUNS = [
    ("8B", 8, 8, 1, 1, 2, 1, "selective", "bf16", 5762, 82.4, "Dec 2024 Table 1"),
    ("8B", 128, 128, 1, 1, 2, 1, "selective", "bf16", 5605, 67.0, "Dec 2024 Table 3"),
    ("8B", 64, 8, 8, 1, 12, 1, "selective", "bf16, compile", 4378, None, "Jun 2025 async-TP"),
    ("70B", 256, 32, 8, 1, 16, 1, "full", "bf16, compile", 597.3, None, "Jun 2025 async-TP"),
    ("405B", 512, 8, 8, 8, 32, 8, "full", "float8, compile, async TP", 100, 82.5, "Dec 2024 Table 5"),
]
QUICK = ("8B",)
MICROBATCH_SIZES = (1, 2, 4, 8, 16)


def plan_run(run, search) -> dict:
    """autoshard's choice for one published run, and the published configuration as autoshard prices it."""
    _, gpus, dp, tp, pp, local, m, ac, *_ = run
    start = time.perf_counter()
    search.devices, search.global_batch = gpus, dp * local
    result = search.search()
    # torchtitan's FSDP is ZeRO-3; under a pipeline it does not reshard after forward (parallelize_llama.py at
    # 9dec370): whole parameters held through the step, one gather and one reduce-scatter per micro-batch. ZeRO-2
    # holds the same and gathers once per step, so pricing it as ZeRO-2 flatters it, never autoshard.
    published = search.evaluate(dp, tp, pp, split="even", recompute=ac, zero=3 if pp == 1 else 2,
                                microbatch_sizes=(local // m,), fit=False)
    return {"run": run, "best": result.best, "published": published, "candidates": len(result.candidates),
            "feasible": sum(c.feasible for c in result.candidates), "plans": result.planned,
            "planning_s": time.perf_counter() - start, "budget": search.budget}


def searches(quick: bool):
    """One ScaleSearch (one export) per model, re-used for each of its runs."""
    import torch

    from autoshard.cost.profiles import H100_80GB
    from autoshard.search.scale_search import ScaleSearch
    from autoshard.zoo import llama
    for name, (layers, dim, heads, kv, ffn) in MODELS.items():
        if quick and name not in QUICK:
            continue
        start = time.perf_counter()
        model, inputs, loss_fn = llama(batch=1, seq=SEQ, dim=dim, n_heads=heads, n_kv_heads=kv, n_layers=3,
                                       ffn_dim=ffn, vocab_size=VOCAB, device="meta")
        search = ScaleSearch(model.to(torch.bfloat16), inputs, loss_fn, n_layers=layers, devices=8, global_batch=8,
                             profile=H100_80GB, microbatch_sizes=MICROBATCH_SIZES)
        yield name, search, time.perf_counter() - start


def _config(c) -> str:
    zero = f"ZeRO-{c.zero}" if c.zero else "no ZeRO"
    recompute = f"{sum(c.recomputed)} full + {sum(c.selective)} selective of {sum(c.stage_layers)}"
    return f"dp {c.dp} ({zero}), tp {c.tp}, pp {c.pp}, b {c.microbatch_size} x m {c.microbatches}; {recompute}"


def _tokens(c, gpus) -> float:
    return c.dp * c.microbatch_size * c.microbatches * SEQ / (c.step_s * gpus)


def report(results, peak: float, nominal: float) -> tuple[str, list, list]:
    """The section's text, CSV headers and rows."""
    rows, detail, csv_rows, misses = [], [], [], []
    for r in results:
        best, pub = r["best"], r["published"]
        model, gpus, dp, tp, pp, local, m, ac, ran, measured, memory, source = r["run"]
        ratio = best.step_s / pub.step_s
        met = best.memory_bytes <= r["budget"] and ratio <= 1.0 + 1e-9
        if not met:
            misses.append(f"{model} on {gpus}")
        predicted, predicted_pub = _tokens(best, gpus), _tokens(pub, gpus)
        label = f"Llama 3.1 {model}, {gpus} GPUs"
        published = f"FSDP {dp}, tp {tp}, pp {pp}, local batch {local} ({m} micro-batches), seq {SEQ}, {ac} AC"
        rows.append([label, published, _config(best), f"{pub.step_s:.2f}", f"{best.step_s:.2f}", f"{ratio:.3f}",
                     f"{pub.memory_bytes / 1e9:.1f}", f"{best.memory_bytes / 1e9:.1f}", "yes" if met else "NO"])
        detail.append([label, ran, source, f"{measured:,}", f"{memory} GiB" if memory else "—",
                       f"{predicted_pub:,.0f}", f"{predicted_pub / measured:.2f}", f"{pub.mfu * peak / nominal:.1%}",
                       f"{predicted:,.0f}", r["candidates"], r["feasible"], f"{r['planning_s']:.1f}"])
        csv_rows.append([model, gpus, dp, tp, pp, local, m, ac, ran, measured, memory or "", pub.step_s,
                         pub.memory_bytes, predicted_pub, best.dp, best.zero, best.tp, best.pp, best.microbatch_size,
                         best.microbatches, sum(best.recomputed), sum(best.selective), best.step_s, best.memory_bytes,
                         predicted, f"{ratio:.4f}", "yes" if met else "no"])
    headers = ["published run", "torchtitan's configuration", "autoshard's choice",
               "predicted step s (published)", "predicted step s (autoshard)", "step ratio autoshard / published",
               "memory GB (published)", "memory GB (autoshard)", "met"]
    detail_headers = ["published run", "what ran", "source", "measured TPS/GPU", "measured memory",
                      "predicted TPS/GPU (published config)", "predicted / measured", "predicted MFU (989 TF)",
                      "predicted TPS/GPU (autoshard)", "candidates", "feasible", "planning s"]
    csv_headers = ["model", "gpus", "fsdp", "tp", "pp", "local_batch", "microbatches", "ac", "ran",
                   "measured_tps_per_gpu", "measured_memory_gib", "published_step_s", "published_memory_bytes",
                   "published_predicted_tps_per_gpu", "dp", "zero", "tp_chosen", "pp_chosen", "microbatch_size",
                   "microbatches_chosen", "full_recomputed", "selective_recomputed", "step_s", "memory_bytes",
                   "predicted_tps_per_gpu", "ratio", "met"]
    gap = {f"{r['run'][0]}/{r['run'][1]}": f"{float(d[6]):.2f}" for r, d in zip(results, detail)}
    verdict = "**met for every run**" if not misses else f"**NOT met for {', '.join(misses)}**"
    body = (
        "Target: for each published torchtitan Llama 3.1 run, autoshard's plan fits 90% of an H100's 80 GB (the "
        "10% headroom of the compiler's plans) and is predicted no slower than torchtitan's configuration under "
        "the same cost model (step ratio <= 1.00) — " + verdict + ". The published configuration is priced as "
        "it ran (FSDP = ZeRO-3 over its data-parallel degree — ZeRO-2 under a pipeline, see below — its local batch and micro-batches, its activation "
        "checkpointing on every layer, L/pp layers per stage) whether or not it fits autoshard's memory model.\n\n"
        + table(headers, rows) + "\n\n"
        "Predicted against measured throughput (tokens/s/GPU = global batch x 8192 / (step x GPUs)):\n\n"
        + table(detail_headers, detail) + "\n\n"
        f"The H100-80GB profile (autoshard/cost/profiles.py) is calibrated: matmuls at {peak / 1e12:.0f} TFLOP/s "
        f"(0.75 of the {nominal / 1e12:.0f} TFLOP/s dense bf16 peak: large cuBLAS GEMMs sustain 70-80% of it), "
        "other ops at 0.9 x 3.35 TB/s of HBM3, NVLink at 360 GB/s bus bandwidth (0.8 x 450 GB/s per direction: "
        "nccl-tests' ring figure without NVLink SHARP), InfiniBand at 40 GB/s per GPU (0.8 x 400 Gb/s), 5 and 10 "
        "us per ring step. These factors are assumptions from public figures, not a measurement on this project's "
        "machines (none here has an H100).\n\n"
        "How it is planned: each model is exported once (one sequence of 8192 tokens, 3 layers at the real "
        "width) and each tensor-parallel degree is planned once by the compiler's passes and ILP on (tp,); the ILP "
        "itself shards the norms' activations over tp (Megatron-SP: all-gather before the column-parallel "
        "linears, reduce-scatter after the row-parallel one). Every (dp, tp, pp) of the cluster, ZeRO stage over "
        "dp (none, 1, 2, 3), micro-batch size (1-16 sequences) and per-layer recomputation (none, torchtitan's "
        "selective-op policy, full) is priced from that plan: ZeRO-1 reduce-scatters the gradients and "
        "all-gathers the parameters once per step; ZeRO-2 reduce-scatters every micro-batch; ZeRO-3 (FSDP) "
        "all-gathers each unit's parameters forward and again backward and reduce-scatters its gradients every "
        "micro-batch, and keeps two units' gathered parameters (one running, one prefetched); memory of "
        "parameters, gradients and optimizer state follows cost/zero_cost.memory_scale at 16 bytes per parameter "
        "(bf16 weights and gradients, fp32 master and Adam moments). Nothing overlaps: every collective, FSDP's "
        "included, adds to the step, for both configurations alike.\n\n"
        "What the comparison cannot see: float8 linears (the 405B row's only figure is float8 + async TP, faster "
        "than bf16 would be), torch.compile's fusions (the 8B rows without compile measure eager), async TP and "
        "FSDP's overlap of communication with compute (they hide most of FSDP's traffic; the cost model charges "
        "it in full), the 500 W power limit and HBM2e of torchtitan's H100s (torchtitan notes its actual peak is "
        "below the SXM figure), fp32 gradient reduce-scatters (torchtitan's default; priced here in bf16), "
        "vocabulary-parallel loss (torchtitan's loss_parallel: the ILP has no sharded log_softmax rule and "
        "gathers the logits, so the head keeps a whole vocabulary row per token), and the memory model's "
        "approximations (every value with a gradient is counted as saved, views included; no allocator "
        "fragmentation): the predicted memory is not the measured one.\n\n"
        "Reading the gaps, run by run (predicted / measured tokens/s/GPU of the published configuration): "
        f"8B on 8 GPUs, {gap.get('8B/8', '—')}: the cost model is optimistic, as for Megatron in section 5 — eager "
        "PyTorch at 500 W reaches about a third of the SXM peak (torchtitan reports 33-39% MFU), the profile "
        "assumes 75% for matmuls and HBM speed for everything else. 8B on 128 GPUs, "
        f"{gap.get('8B/128', '—')}: the one pessimistic row — FSDP over 128 GPUs gathers the parameters twice "
        "and reduce-scatters the gradients across InfiniBand every step, which the model charges in full (about a "
        "third of the predicted step) while FSDP hides it behind compute; this is also why autoshard prefers "
        "tensor and pipeline parallelism inside nodes here, and its advantage would shrink under an overlap "
        f"model. 8B on 64 GPUs (tp 8), {gap.get('8B/64', '—')}, and 70B on 256 GPUs, {gap.get('70B/256', '—')}: "
        "torch.compile ran, so the gap is mostly kernel efficiency and the unmodelled overlap; in the memory "
        "model both published configurations exceed 80 GB because the gathered logits (12 and 16 sequences of "
        "8192 x 128256) are kept, which loss_parallel avoids — autoshard's own plans fit with 1-sequence "
        "micro-batches. 405B on 512 GPUs, " + gap.get("405B/512", "—") + ": the measured figure is float8 with "
        "async TP, which bf16 pricing cannot reach; torchtitan's 8 micro-batches on 8 stages leave a 1F1B "
        "bubble of 7/15 of the step (its interleaved schedule measured 28% faster), which is where autoshard's "
        "choice of more stages with many more, smaller micro-batches gains most (it is predicted, not measured; "
        "interleaved schedules are not searched).")
    return body, csv_headers, csv_rows


def main(quick: bool = False) -> None:
    from autoshard.cost.profiles import H100_80GB, H100_BF16_PEAK
    start = time.perf_counter()
    results = []
    for name, search, export_s in searches(quick):
        for run in RUNS:
            if run[0] != name:
                continue
            results.append(plan_run(run, search))
            r = results[-1]
            r["planning_s"] += export_s
            export_s = 0.0
            print(f"[planning_llama] {name} on {run[1]}: autoshard {_config(r['best'])} {r['best'].step_s:.2f} s, "
                  f"published {r['published'].step_s:.2f} s ({r['planning_s']:.1f} s)", flush=True)
    body, headers, rows = report(results, H100_80GB.peak_flops, H100_BF16_PEAK)
    body += (f"\n\nWhole benchmark: {time.perf_counter() - start:.0f} s for {len(results)} runs "
             f"(`python -m benchmarks --only planning_llama`); planning s includes the model's export for its "
             "first run.")
    write_section("planning_llama", "8. Planning at scale on paper: torchtitan's Llama 3.1 runs on H100 clusters",
                  body, headers, rows)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
