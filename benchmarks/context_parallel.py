"""Benchmark 12, context parallelism: memory per rank and bytes per step of the three strategies (allgather, ring,
alltoall), and what the planner picks for long sequences.

1. Predicted memory per rank at sequence 32k (transformers' Llama at the Llama-3-8B shape on the meta device,
   bf16 mixed precision, H100 profile, batch 1, mesh (cp, tp) = (c, 8) with Megatron on tp and the sequence of
   the inputs on cp) for cp = 1 (the unsharded attention), 2 and 4, each strategy; no memory budget, so the
   figures are the plans' own footprints.
2. Measured on gloo at the largest size this machine allows in the run time (benchmarks/models/attention_block.py:
   one causal attention block, float32, width 256 in 4 heads, sequence 16384; --quick 1024; the q/k/v projection's output
   pinned to the sequence split, so that the strategies differ only in the attention): peak resident memory of a
   rank through one training step (VmHWM above the rank's RSS before the step) for cp = 1 (one process, the
   unsharded block: "plain" is the model itself, "none" autoshard's program of it on a 1-rank mesh) and cp = 2, 4
   with each strategy, beside the plan's prediction (CPU profile); gloo's own collectives (not autoshard's exact
   fixed-order sums, which hold every rank's summand of a reduce-scatter); MALLOC_MMAP_THRESHOLD_=65536, so that
   the resident peak follows the live tensors.
3. Bytes per step each rank sends on cp in those runs (the runtime's counting) against the closed forms, with
   q = the rank's query block bytes B H (L/k) E s (keys and values the same size here, k = cp):
   allgather: forward k-gathered k and v = 2 k q, backward their reduce-scatters = 2 k q;
   alltoall: q, k, v to head-sharded and the output back = 4 q each way;
   ring (causal, zigzag): forward (k - 1) 2q shifts + 4q reordering; backward (k - 1) 2q + k 2q gradient shifts +
   4q reordering.
4. The planner's own choice (no hints; unnamed (8, 8) mesh, H100, bf16) for the 8B shape at sequences 8k, 32k,
   128k, batch 1.

Reading part 2: one block is the worst case for context parallelism's memory, because the attention's transient
buffers (the zigzag reordering's copies, a ring's block in flight, the all-gathered keys and values, an
all-to-all's output) are a large share of one layer; in a model they live one layer at a time while the saved
activations of every layer shrink by cp. The prediction counts every op's output as kept for backward (an
upper bound: views and the outputs autograd does not save are counted too), so it overestimates the
unsharded program and is close where the saved activations dominate.
"""
from __future__ import annotations

import gc
import time
import warnings

import torch

from .big_model_memory import reset_peak, rss_bytes
from .report import table, write_section

STRATEGIES = ("allgather", "ring", "alltoall")
GIB, MIB = 2**30, 2**20
SCALE_SEQ, SCALE_TP = 32768, 8


def _quiet():
    warnings.filterwarnings("ignore", message="autoshard: the hint")


# --- 1. predicted memory at 32k on the 8B shape --------------------------------------------------------------------

def predicted_at_scale(seq: int = SCALE_SEQ) -> list:
    import autoshard
    from autoshard.cost.profiles import load_profile
    from autoshard.zoo.transformers_families import llama3
    from autoshard.zoo.transformers_hints import HINTS
    _quiet()
    tp = {k: v for k, v in HINTS["llama"].items() if "tp" in v}
    rows = []
    for cp, method in [(1, "none")] + [(c, m) for c in (2, 4) for m in STRATEGIES]:
        model, inputs, loss_fn = llama3("8b", batch=1, seq=seq)
        hints = {**tp, "input:0": {"cp": "S(1)"}, "input:1": {"cp": "S(1)"}}
        if cp > 1:
            hints["*:attention"] = {"cp": method}
        started = time.perf_counter()
        prog = autoshard.parallelize(model, (cp, SCALE_TP), inputs, loss_fn=loss_fn, axis_names=("cp", "tp"),
                                     hints=hints, mixed_precision="bf16", profile=load_profile("h100"),
                                     memory_budget=1e15)
        p = prog.plan.predicted
        rows.append([cp, method, f"{p['memory_bytes_per_rank'] / GIB:.1f}", f"{p['memory']['activations'] / GIB:.1f}",
                     f"{p['step_time_s']:.2f}", f"{p['comm_s']:.2f}", f"{time.perf_counter() - started:.0f}"])
        print(rows[-1], flush=True)
    return rows


# --- 2 and 3. measured on gloo -------------------------------------------------------------------------------------

def _rank_task(rank, world, method, batch, seq, dim, heads):
    import autoshard
    from autoshard.runtime.launch import communicator_for

    from .models.attention_block import attention_block
    _quiet()
    torch.set_num_threads(1)
    model, inputs, loss_fn = attention_block(batch, seq, dim, heads)
    if method == "plain":  # the single device: the unsharded attention
        gc.collect()
        base = rss_bytes()
        reset_peak()
        loss_fn(model(*inputs), *inputs).backward()
        return {"peak": rss_bytes("VmHWM") - base}
    # gloo's own collectives, as NCCL's in training (the exact path gathers every rank's summand to add them
    # in a fixed order: k times a reduce-scatter's memory)
    comm = communicator_for(autoshard.Mesh((world,), ("cp",)), exact=False)
    hints = {"input:0": {"cp": "S(1)"}, "qkv:output": {"cp": "S(1)"}}
    if method != "none":
        hints["*:attention"] = {"cp": method}
    prog = autoshard.parallelize(model, (world,), inputs, loss_fn=loss_fn, axis_names=("cp",), profile="cpu",
                                 hints=hints)
    module = prog.module(rank, comm)
    local = module.local_inputs(*inputs)
    del model
    gc.collect()
    base = rss_bytes()
    reset_peak()
    started = time.perf_counter()
    loss, _ = module(*local)
    loss.backward()
    module.sync_grads()
    return {"peak": rss_bytes("VmHWM") - base, "seconds": time.perf_counter() - started,
            "counts": comm.log.summary().get("cp", {}), "predicted": prog.plan.predicted["memory_bytes_per_rank"]}


def formula(method: str, k: int, batch: int, seq: int, dim: int, itemsize: int = 4) -> tuple[int, int]:
    """(forward, backward) bytes a rank sends on cp for one causal attention (module docstring, part 3)."""
    q = batch * seq // k * dim * itemsize  # heads x head dim = dim
    if method == "allgather":
        return 2 * k * q, 2 * k * q
    if method == "alltoall":
        return 4 * q, 4 * q
    return (k - 1) * 2 * q + 4 * q, (k - 1) * 2 * q + k * 2 * q + 4 * q


ATTENTION_KINDS = ("all_gather", "reduce_scatter", "all_to_all", "send_recv", "permute")


def measured_on_gloo(seq: int, dim: int = 256, heads: int = 4, batch: int = 1) -> tuple[list, list]:
    import os

    from autoshard.runtime.launch import run_distributed
    # Every allocation above 64 KiB its own mapping, returned when freed: the resident peak is then the peak of
    # live tensors, not of malloc's reuse pattern (glibc reads this when a rank starts).
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    memory, bytes_rows = [], []
    for cp, method in [(1, "plain"), (1, "none")] + [(c, m) for c in (2, 4) for m in STRATEGIES]:
        results = run_distributed(_rank_task, cp, method, batch, seq, dim, heads, timeout_s=1200)
        peak = max(r["peak"] for r in results.values())
        predicted = results[0].get("predicted")
        memory.append([cp, method, f"{peak / MIB:.0f}", "" if predicted is None else f"{predicted / MIB:.0f}",
                       f"{max(r.get('seconds', 0) for r in results.values()):.1f}" if cp > 1 else ""])
        print(memory[-1], flush=True)
        if cp == 1:
            continue  # "plain": the model itself; "none": autoshard's program of it on one rank
        counts = results[0]["counts"]
        # send_recv/permute log fwd and bwd separately; the kinds' totals per phase come from the counts' bytes
        counted = sum(counts.get(kind, {}).get("bytes", 0) for kind in ATTENTION_KINDS)
        fwd, bwd = formula(method, cp, batch, seq, dim)
        bytes_rows.append([cp, method, counted, fwd + bwd, "yes" if counted == fwd + bwd else "NO",
                           ", ".join(f"{k} {v['fwd']}/{v['bwd']}" for k, v in sorted(counts.items())
                                     if k in ATTENTION_KINDS)])
    return memory, bytes_rows


# --- 4. the planner's own choice -----------------------------------------------------------------------------------

def planner_choice(seqs=(8192, 32768, 131072)) -> list:
    import autoshard
    from autoshard.cost.profiles import load_profile
    from autoshard.strategies.attention import method_of
    from autoshard.zoo.transformers_families import llama3
    _quiet()
    rows = []
    for seq in seqs:
        model, inputs, loss_fn = llama3("8b", batch=1, seq=seq)
        started = time.perf_counter()
        prog = autoshard.parallelize(model, (8, 8), inputs, loss_fn=loss_fn, mixed_precision="bf16",
                                     profile=load_profile("h100"))
        attention = next(n for n in prog.state.gm.graph.nodes
                         if n.target is torch.ops.aten.scaled_dot_product_attention.default)
        per_axis = [f"{prog.mesh.names[a]}={method_of(attention, c) or repr(c.output)}"
                    for a, c in enumerate(attention.meta["autoshard.choice"])]
        p = prog.plan.predicted
        stages = prog.plan.to_json().get("pipeline", {}) or {}
        rows.append([seq, repr(prog.mesh), stages.get("stages", 1) if isinstance(stages, dict) else "",
                     ", ".join(per_axis), f"{p['step_time_s']:.2f}", f"{p['memory_bytes_per_rank'] / GIB:.1f}",
                     f"{time.perf_counter() - started:.0f}"])
        print(rows[-1], flush=True)
    return rows


def main(quick: bool = False) -> None:
    seq = 1024 if quick else 16384
    scale = predicted_at_scale(8192 if quick else SCALE_SEQ)
    memory, bytes_rows = measured_on_gloo(seq)
    choice = planner_choice((8192,) if quick else (8192, 32768, 131072))
    body = [__doc__.split("\n\n", 1)[1].strip(), "",
            f"### 1. Predicted memory per rank, Llama-3-8B shape, sequence {8192 if quick else SCALE_SEQ}, (cp, tp=8)",
            "", table(["cp", "strategy", "memory GiB", "activations GiB", "step s", "comm s", "plan s"], scale), "",
            f"### 2. Measured peak per rank on gloo, attention block, sequence {seq}", "",
            table(["cp", "strategy", "measured peak MiB", "predicted MiB (cpu)", "step s"], memory), "",
            "### 3. Bytes per step on cp: counted vs formula", "",
            table(["cp", "strategy", "counted B", "formula B", "equal", "kinds fwd/bwd"], bytes_rows), "",
            "### 4. The planner's choice, Llama-3-8B shape, batch 1, unnamed (8, 8), H100 bf16", "",
            table(["seq", "mesh", "stages", "attention per axis", "step s", "memory GiB", "plan s"], choice)]
    headers = ["part", "a", "b", "c", "d", "e", "f", "g"]
    rows = [["1", *r] for r in scale] + [["2", *r] for r in memory] + [["3", *r] for r in bytes_rows] + \
        [["4", *r] for r in choice]
    write_section("context_parallel", "12. Context parallelism: memory, bytes, the planner's choice",
                  "\n".join(body), headers, rows)


if __name__ == "__main__":
    import sys
    main(quick="--quick" in sys.argv)
