"""Benchmark 5, planning at scale on paper: GPT shapes from 1.7B to 1T parameters on A100-80GB clusters of
32 to 3072 GPUs (8 per node), autoshard's choice of (data, tensor, pipeline) degrees, micro-batches and
recomputation next to Megatron-LM's published choice (Narayanan et al. 2021, arXiv 2104.04473, Table 1),
both predicted by autoshard's cost model (autoshard/search/scale_search.py).

Each model is the zoo's GPT-2 (pre-LN, learned positions, tied head, 4x MLP, biases) at the real width,
heads, sequence 2048 and vocabulary 51200, built on the meta device in bf16 with 3 layers and planned at
the real depth (the middle layer's planned costs repeated); exported once per model. Target: autoshard's
choice predicted no slower than Megatron's degrees (ratio of predicted step times <= 1.00) and within 90% of
the 80 GB of a device; predicted tokens/s/GPU next to the paper's.
"""
from __future__ import annotations

import sys
import time

from .report import table, write_section

SEQ, VOCAB = 2048, 51200
# Table 1 of Narayanan et al. 2021: name, attention heads, hidden, layers, tensor-parallel, pipeline-parallel,
# GPUs, batch (sequences), achieved TFLOP/s per GPU as a share of the A100's 312 (their count includes the
# recompute forward: 96 B s l h^2 (1 + s/6h + V/16lh) FLOPs per step).
MEGATRON = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 0.44),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 0.44),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 0.46),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 0.43),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 0.44),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 0.45),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 0.47),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 0.50),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 0.52),
    ("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 0.52),
]
QUICK = ("1.7B", "1008B")


def plan_model(row, seq: int = SEQ, vocab: int = VOCAB, profile=None) -> dict:
    """Search one model's cluster and evaluate Megatron's degrees (as planned by autoshard, and as published:
    L/pp layers per stage, every layer recomputed)."""
    import torch

    from autoshard.cost.profiles import A100_80GB
    from autoshard.search.scale_search import ScaleSearch
    from autoshard.zoo import gpt2
    name, heads, hidden, layers, tp, pp, gpus, batch, achieved = row
    start = time.perf_counter()
    model, inputs, loss_fn = gpt2(batch=1, seq=seq, dim=hidden, n_heads=heads, n_layers=3, vocab_size=vocab,
                                  device="meta")
    model = model.to(torch.bfloat16)
    search = ScaleSearch(model, inputs, loss_fn, n_layers=layers, devices=gpus, global_batch=batch,
                         profile=profile or A100_80GB)
    result = search.search()
    planning_s = time.perf_counter() - start
    dp = gpus // (tp * pp)
    return {"name": name, "gpus": gpus, "batch": batch, "layers": layers, "achieved": achieved,
            "params": search.static_bytes() / (2 + search.factor) / 2, "best": result.best,
            "megatron": search.evaluate(dp, tp, pp),
            "published": search.evaluate(dp, tp, pp, split="even", recompute="full", zero=0, fit=False),
            "candidates": len(result.candidates), "pruned": sum("alone" in c.note for c in result.candidates),
            "feasible": sum(c.feasible for c in result.candidates), "plans": result.planned,
            "exports": result.exports, "planning_s": planning_s, "memory_limit": search.budget,
            "heads": heads, "hidden": hidden}


def _degrees(c) -> str:
    return f"({c.dp}, {c.tp}, {c.pp})" + (f" ZeRO-{c.zero}" if c.zero else "")


def _recomputed(c) -> str:
    return f"{sum(c.recomputed)} + {sum(c.selective)} sel. / {sum(c.stage_layers)}"


def paper_tokens(r, seq: int = SEQ, vocab: int = VOCAB, peak: float = 312e12) -> float:
    """Tokens/s/GPU Megatron achieved: its achieved share of the peak over its FLOPs per token (their formula,
    recompute forward included: 96 s l h^2 (1 + s/6h + V/16lh) per sequence)."""
    layers, hidden = r["layers"], r["hidden"]
    per_token = 96 * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    return r["achieved"] * peak / per_token


def predicted_tokens(c, r, seq: int = SEQ) -> float:
    """Tokens/s/GPU of a candidate's predicted step."""
    return r["batch"] * seq / (c.step_s * r["gpus"])


def report(results) -> tuple[str, list, list]:
    """The section's text, CSV headers and rows."""
    rows, detail, csv_rows, misses = [], [], [], []
    for r in results:
        best, meg, pub = r["best"], r["megatron"], r["published"]
        ratio = best.step_s / meg.step_s if best and meg.feasible else float("nan")
        ratio_pub = best.step_s / pub.step_s if best and pub.feasible else float("nan")
        fits = best is not None and best.memory_bytes <= r["memory_limit"]
        met = fits and ratio <= 1.0 + 1e-9 and ratio_pub <= 1.0 + 1e-9
        if not met:
            misses.append(r["name"])
        rows.append([r["name"], r["gpus"], r["batch"], _degrees(best), f"{best.microbatch_size} x {best.microbatches}",
                     _recomputed(best), f"{best.step_s:.2f}", f"{best.mfu:.1%}", f"{best.memory_bytes / 1e9:.1f}",
                     _degrees(meg), f"{meg.microbatch_size} x {meg.microbatches}", _recomputed(meg),
                     f"{meg.step_s:.2f}", f"{meg.mfu:.1%}", f"{meg.memory_bytes / 1e9:.1f}", f"{ratio:.3f}",
                     "yes" if met else "NO"])
        tokens, paper = predicted_tokens(pub, r), paper_tokens(r)
        detail.append([r["name"], f"{r['params'] / 1e9:.1f}B", f"{pub.step_s:.2f}", f"{pub.mfu:.1%}",
                       f"{pub.hfu:.1%}", f"{r['achieved']:.0%}", f"{tokens:,.0f}", f"{paper:,.0f}",
                       f"{tokens / paper:.2f}", f"{pub.memory_bytes / 1e9:.1f}", f"{ratio_pub:.3f}",
                       r["candidates"], r["pruned"], r["feasible"], r["plans"], r["exports"],
                       f"{r['planning_s']:.1f}"])
        csv_rows.append([r["name"], f"{r['params']:.4g}", r["gpus"], r["batch"], r["layers"], best.dp, best.tp, best.pp,
                         best.microbatch_size, best.microbatches, sum(best.recomputed), f"{best.step_s:.4g}",
                         f"{best.mfu:.4f}", f"{best.memory_bytes:.4g}", meg.dp, meg.tp, meg.pp, meg.microbatch_size,
                         meg.microbatches, sum(meg.recomputed), f"{meg.step_s:.4g}", f"{meg.mfu:.4f}",
                         f"{meg.memory_bytes:.4g}", f"{pub.step_s:.4g}", f"{pub.mfu:.4f}", f"{pub.hfu:.4f}",
                         f"{pub.memory_bytes:.4g}", r["achieved"], f"{tokens:.4g}", f"{paper:.4g}", f"{ratio:.4f}",
                         f"{ratio_pub:.4f}", best.zero, sum(best.selective), meg.zero, sum(meg.selective),
                         r["candidates"], r["pruned"], r["plans"], f"{r['planning_s']:.2f}", "yes" if met else "no"])
    headers = ["model", "GPUs", "batch", "autoshard (dp, tp, pp)", "b x m", "recomputed layers", "step s", "MFU",
               "memory GB", "Megatron (dp, tp, pp)", "b x m ", "recomputed layers ", "step s ", "MFU ", "memory GB ",
               "step ratio autoshard / Megatron", "met"]
    detail_headers = ["model", "parameters", "published: step s", "MFU", "MFU incl. recompute", "achieved (paper)",
                      "predicted tokens/s/GPU", "paper tokens/s/GPU", "predicted / paper", "memory GB", "step ratio autoshard / published", "candidates", "pruned by parameter memory",
                      "feasible", "ILP plans", "exports", "planning s (export incl.)"]
    csv_headers = ["model", "parameters", "gpus", "batch", "layers", "dp", "tp", "pp", "microbatch_size",
                   "microbatches", "recomputed_layers", "step_s", "mfu", "memory_bytes", "megatron_dp", "megatron_tp",
                   "megatron_pp", "megatron_microbatch_size", "megatron_microbatches", "megatron_recomputed_layers",
                   "megatron_step_s", "megatron_mfu", "megatron_memory_bytes", "published_step_s", "published_mfu",
                   "published_hfu", "published_memory_bytes", "paper_achieved", "published_predicted_tps_per_gpu",
                   "paper_tps_per_gpu", "ratio", "ratio_published", "zero", "selective_layers", "megatron_zero",
                   "megatron_selective_layers",
                   "candidates", "pruned", "ilp_plans", "planning_s", "met"]
    verdict = ("**met for every model**" if not misses else f"**NOT met for {', '.join(misses)}**")
    ratios = [float(row[15]) for row in rows]
    gaps = [float(d[8]) for d in detail]
    same = [r["name"] for r in results if r["best"].degrees == r["megatron"].degrees]
    predicted = [r["published"].hfu for r in results]
    achieved = [r["achieved"] for r in results]
    body = (
        "Target: for each Megatron-LM model of Narayanan et al. 2021 (Table 1), autoshard's choice of (data, tensor, "
        "pipeline) degrees, micro-batch size b, micro-batch count m and recomputed layers is predicted no slower "
        "than Megatron's published degrees (step ratio <= 1.00, both predicted by autoshard's cost model on the same "
        "A100-80GB cluster profile) and fits 90% of the 80 GB of a device (the compiler's 10% headroom) — " + verdict + f" (ratios {min(ratios):.3f} to "
        f"{max(ratios):.3f}; the same degrees as Megatron for {', '.join(same) or 'no model'}). Planning, export "
        f"included, took {min(r['planning_s'] for r in results):.1f} to {max(r['planning_s'] for r in results):.1f} "
        "s per model.\n\n"
        "The first table plans Megatron's degrees exactly like autoshard's own candidates (best b, ZeRO stage, "
        "balanced stages, layers recomputed selectively or fully only to fit), so its ratio is the value of the "
        "choice of degrees alone. The second table is Megatron's configuration as published (no ZeRO, L/pp layers "
        "per stage, every layer recomputed, best b; priced even where it exceeds the 72 GB budget) next to the "
        "paper's achieved throughput (their FLOP count includes the recompute forward, so compare it with \"MFU "
        "incl. recompute\"), also as tokens/s/GPU: predicted = batch x 2048 / (step x GPUs), the paper's = its "
        "achieved TFLOP/s over its FLOPs per token. The A100 profile stays nominal (the hardware of the published "
        "figures, uncalibrated, as before; section 8 calibrates an H100 profile), so the predicted / paper "
        f"column ({min(gaps):.2f} to {max(gaps):.2f}) is how optimistic the uncalibrated cost model is.\n\n"
        + table(headers, rows) + "\n\n" + table(detail_headers, detail) + "\n\n"
        "How it is planned (autoshard/search/scale_search.py): each model is exported once (meta weights, bf16, one "
        "sequence of 2048 tokens) with 3 layers at the real width and normalized once; one intra-op plan per "
        "tensor-parallel degree (1, 2, 4, 8 — inside a node) runs the real passes (strategies, the ILP on HiGHS, "
        "insert_comm, predict) on the mesh (tp,) with NVLink, and the real depth repeats the middle layer's "
        "planned costs. Every (dp, tp, pp) with dp x tp x pp = GPUs and pp <= layers is evaluated from that plan: "
        "data parallelism adds, per ZeRO stage over dp (none; 1: reduce-scatter + all-gather once per step; 2: "
        "reduce-scatter every micro-batch; 3: two all-gathers and a reduce-scatter every micro-batch), each "
        "parameter's collectives on its link (InfiniBand when dp x tp > 8) and shards parameters, gradients and "
        "optimizer state (cost/zero_cost.memory_scale); the units (embedding, layers, head) are cut into pp stages balanced by predicted time, with "
        "stage-to-stage sends of the boundary activations and gradients on the pp link; the step is the 1F1B "
        "formula of pipeline_search (sum of stage times + (m - 1) x the slowest + the slowest stage's gradient "
        "sync), with stage times scaled from one sequence per micro-batch to b (b in 1, 2, 4, 8); communication "
        "does not overlap compute. Candidates whose parameters alone cannot fit are not evaluated. Data "
        "parallelism is not an ILP axis: the ILP prices one micro-batch with the gradient all-reduce in full, and "
        "given a dp axis it traded that once-per-step all-reduce for weights sharded across nodes (ZeRO-3 or "
        "cross-node tensor parallelism) whose collectives recur in each of the m micro-batches, or left the "
        "batch unsplit (parallelize's own pipeline planning solves the micro-batch program the same way, so it "
        "can make the same trade).\n\n"
        "Memory per device (the fullest pipeline stage): parameters, gradients and optimizer state of its units "
        "at 16 bytes per parameter under their ZeRO stage (bf16 weights and gradients, fp32 master weights and Adam moments; the tied "
        "embedding is held by the first and the last stage), plus the saved activations (every value with a "
        "gradient that the plan keeps, as predict counts them) of min(pp - s, m) micro-batches in flight on "
        "stage s (1F1B; one without a pipeline), plus one layer's activations while it is recomputed; layers "
        "are checkpointed selectively (torchtitan's selective-op policy: matmul and attention outputs kept except "
        "every second linear's) or fully (cost/recompute_cost.region_savings: only the layer's inputs kept, its "
        "forward run again), the most bytes per second of recompute first, only while the stage does not fit. MFU = 3 x forward matmul FLOPs (attention included) x "
        "batch / (step x GPUs x 312 TFLOP/s).\n\n"
        "What is approximated: the cost model, not a measurement (matmuls at peak FLOP/s, other ops at HBM "
        "bandwidth, ring collectives with alpha-beta links, no overlap of communication with compute, no kernel "
        "inefficiency) — it predicts utilisations well above what Megatron achieved, so the absolute MFU "
        "column is optimistic and only ratios are meaningful; attention is scaled_dot_product_attention "
        "(flash-style: its s x s scores are not kept); the ZeRO collectives do not overlap compute "
        "either; the intra-op plan is chosen for time alone (no memory bound in its ILP), so a candidate that would "
        "need a leaner intra-op plan is rejected rather than re-planned; schedules other than 1F1B (interleaved) "
        "are not searched; the tied embedding's gradient "
        "exchange between the first and last stage is not counted.\n\n"
        "Reading the figures: where autoshard departs from Megatron it is on the cost model's word. It prefers "
        "pipeline stages to data parallelism on the small models and tp = 4 to tp = 8 on the middle ones because "
        "the model charges the once-per-step gradient all-reduce (InfiniBand when dp x tp > 8) and every "
        "tensor-parallel collective without overlap, while a 1F1B bubble of (p - 1) / m with dozens of "
        "micro-batches is cheap; on the memory-bound largest models it finds Megatron's degrees. Against the "
        "published configurations, which recompute every layer, it also gains by recomputing only the layers "
        f"that do not fit (ratio {min(float(d[10]) for d in detail):.2f} to {max(float(d[10]) for d in detail):.2f}). "
        "In absolute terms "
        f"the cost model is optimistic: it predicts {min(predicted):.0%} to {max(predicted):.0%} utilisation "
        f"(recompute included) for the published configurations where the paper achieved {min(achieved):.0%} to "
        f"{max(achieved):.0%}. Closing that gap is calibration (an achievable matmul rate instead of the peak, "
        "measured collective rates, overlap); it shifts the balance between compute and communication, so it "
        "may move some choices — the ratios above hold for this uncalibrated profile.")
    return body, csv_headers, csv_rows


def main(quick: bool = False) -> None:
    start = time.perf_counter()
    results = []
    for row in MEGATRON:
        if quick and row[0] not in QUICK:
            continue
        results.append(plan_model(row))
        r = results[-1]
        print(f"[planning_scale] {r['name']}: autoshard {_degrees(r['best'])} {r['best'].step_s:.2f} s, Megatron "
              f"{_degrees(r['megatron'])} {r['megatron'].step_s:.2f} s ({r['planning_s']:.1f} s)", flush=True)
    body, headers, rows = report(results)
    body += f"\n\nWhole benchmark: {time.perf_counter() - start:.0f} s for {len(results)} models."
    write_section("planning_scale", "5. Planning at scale on paper: Megatron-LM's models on A100 clusters", body,
                  headers, rows)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
