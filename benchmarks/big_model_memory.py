"""Peak memory per rank of a model bigger than a rank's share: built on the meta device, read from safetensors.

    .venv/bin/python -m benchmarks.big_model_memory [--quick] [--layers 10] [--dim 2048]

A transformers `LlamaForCausalLM` whose float32 weights are 2.2 GiB (10 layers, dim 2048, GQA 16/4 heads,
MLP 5632, vocab 32000, untied head) is saved once as a safetensors file from a seeded model. Then 8 gloo
ranks on mesh (2, 4) = dp x tp (Megatron hints on tp with a vocabulary-parallel head, ZeRO-3 on dp, so that
every parameter is split 8 ways) each build the model on the meta device, plan it, build their rank module with
`prog.module(rank, comm, weights=file)` and run one training step (forward, backward, gradient sync, SGD).

Measured on every rank, as resident set size (RSS, /proc/self/status VmHWM = the peak, file-backed pages of
the memory-mapped checkpoint included) above the rank's RSS after `import torch` and the process-group
start (the interpreter and torch's libraries, the same for any model):
- `load`: the peak up to the rank module being built (planning + reading the rank's slices);
- `step`: the peak through the first step (adds gradients, activations, the optimizer's work).

Compared with:
- the bound of issue 14 item 4: the rank's shards plus the largest single tensor it reads (+ activations
  and, during the step, gradients), and the target `1.3 x (model bytes / ranks) + largest tensor`;
- today's path before weights=: the full model with real weights on every rank, then `prog.module(rank,
  comm)` cuts the shards out. Measured in one process for rank 0 (load phase only): 8 such processes need
  8 x the model on this 24 GiB machine, which is the problem this benchmark is about.
"""
from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time

import torch

from .report import table, write_section

MESH, AXES = (2, 4), ("dp", "tp")
GIB = 2**30


def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident set (VmRSS) or its peak so far (VmHWM), from /proc (Linux)."""
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    """Start VmHWM again from the current RSS (Linux >= 4.0: write 5 to clear_refs)."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
        handle.write("5")


def config(layers: int, dim: int, quick: bool):
    from transformers import LlamaConfig
    if quick:
        return LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                           num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128, use_cache=False,
                           tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaConfig(vocab_size=32000, hidden_size=dim, intermediate_size=int(dim * 2.75), num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=256, use_cache=False,
                       tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def hints() -> dict:
    """Megatron on tp (the families' hints) with the embedding and the head split on tp too (vocabulary-
    parallel head), so that with ZeRO-3 on dp every weight is split 8 ways."""
    from autoshard.zoo.transformers_hints import HINTS
    return {**HINTS["llama"], "model.embed_tokens.weight": {"tp": "S(1)"}, "lm_head.weight": {"tp": "S(0)"}}


def build(cfg):
    """transformers' LlamaForCausalLM with a positional (input_ids, labels) forward (names unchanged)."""
    import transformers
    from transformers import LlamaForCausalLM
    transformers.logging.set_verbosity_error()

    class Positional(LlamaForCausalLM):
        def forward(self, input_ids, labels):
            return super().forward(input_ids=input_ids, labels=labels)

    return Positional(cfg)


def loss_of(outputs, *inputs):
    return outputs["loss"]


def example_inputs(cfg, batch: int, seq: int):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, cfg.vocab_size, (batch, seq), generator=generator)
    return ids, ids.clone()


def plan(cfg, batch: int, seq: int):
    import autoshard
    with torch.device("meta"):
        model = build(cfg)
    return autoshard.parallelize(model, MESH, example_inputs(cfg, batch, seq), loss_fn=loss_of, axis_names=AXES,
                                 hints=hints(), zero={"dp": 3})


def _rank_task(rank, world, cfg_json, batch, seq, plan_json, path):
    """One rank: meta model, the launcher's plan, this rank's slices from `path`, one SGD step."""
    from transformers import LlamaConfig

    import autoshard
    from autoshard.plan.plan import Plan
    from autoshard.runtime.launch import communicator_for
    from autoshard.runtime.zero import ZeroOptimizer
    cfg = LlamaConfig.from_dict(cfg_json)
    gc.collect()
    base = rss_bytes()
    reset_peak()
    comm = communicator_for(autoshard.Mesh(MESH, AXES))
    with torch.device("meta"):
        model = build(cfg)
    inputs = example_inputs(cfg, batch, seq)
    prog = autoshard.parallelize(model, MESH, tuple(x.to("meta") for x in inputs), loss_fn=loss_of, axis_names=AXES,
                                 plan=Plan.from_json(plan_json, "the launcher's plan"))  # its hints and ZeRO stage
    started = time.perf_counter()
    module = prog.module(rank, comm, weights=path)
    load_s = time.perf_counter() - started
    load_peak = rss_bytes("VmHWM")
    params = dict(module.named_local_parameters())
    shard_bytes = sum(p.numel() * p.element_size() for p in params.values())
    opt = ZeroOptimizer(module, torch.optim.SGD(list(params.values()), lr=0.01))
    started, phases = time.perf_counter(), {}
    reset_peak()
    loss, _ = module(*module.local_inputs(*inputs))
    phases["forward"] = rss_bytes("VmHWM") - base
    for phase, run in (("backward", loss.backward), ("sync", module.sync_grads), ("optimizer", opt.step)):
        reset_peak()
        run()
        phases[phase] = rss_bytes("VmHWM") - base
    step_s = time.perf_counter() - started
    return {"base": base, "load_peak": load_peak - base, "step_peak": max(load_peak - base, *phases.values()),
            "phases": phases, "shard_bytes": shard_bytes, "load_s": load_s, "step_s": step_s}


def todays_path(cfg, batch: int, seq: int, path: str, plan_json: dict) -> dict:
    """Rank 0 of the path before weights=: the full model with real weights, then its shards cut out.
    Runs in a fresh process so that its peak is its own."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    # A worker that dies raises BrokenProcessPool here (a multiprocessing.Pool would wait for it forever).
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_full_model_rank0, cfg.to_dict(), batch, seq, path, plan_json).result(timeout=900)


def _full_model_rank0(cfg_json, batch, seq, path, plan_json):
    from transformers import LlamaConfig

    import autoshard
    from autoshard.lowering.rank_module import build_rank_module
    from autoshard.plan.plan import Plan
    torch.set_num_threads(1)
    cfg = LlamaConfig.from_dict(cfg_json)
    gc.collect()
    base = rss_bytes()
    reset_peak()
    with torch.device("meta"):
        model = build(cfg)
    # The full model in memory, as a rank held it before weights= (load_weights copies each tensor out of the
    # file; safetensors' load_file would leave them as views of the mapped file, resident only where touched).
    model.load_state_dict(autoshard.load_weights(path), assign=True)
    prog = autoshard.parallelize(model, MESH, example_inputs(cfg, batch, seq), loss_fn=loss_of, axis_names=AXES,
                                 plan=Plan.from_json(plan_json, "the launcher's plan of the real model"))
    rank_module = build_rank_module(prog.state, 0)  # what prog.module(0, comm) holds, without a process group
    shard_bytes = sum(p.numel() * p.element_size() for p in rank_module.parameters())
    return {"load_peak": rss_bytes("VmHWM") - base, "shard_bytes": shard_bytes}


def write_checkpoint(cfg, folder: str, batch: int, seq: int) -> tuple[str, int, int, dict]:
    """The seeded single-device model's weights as one safetensors file: (path, model bytes, largest tensor,
    the plan of the real model for today's path: its trace can differ from the meta model's)."""
    from safetensors.torch import save_file

    import autoshard
    torch.manual_seed(0)
    model = build(cfg)
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    largest = max(t.numel() * t.element_size() for t in tensors.values())
    path = os.path.join(folder, "model.safetensors")
    save_file(tensors, path)
    real = autoshard.parallelize(model, MESH, example_inputs(cfg, batch, seq), loss_fn=loss_of, axis_names=AXES,
                                 hints=hints(), zero={"dp": 3}).plan
    del model, tensors
    gc.collect()
    return path, total, largest, {**real.to_json(), "fingerprint": real.fingerprint}


def main(quick: bool = False, layers: int = 10, dim: int = 2048, batch: int = 2, seq: int = 64) -> list:
    from autoshard.runtime.launch import run_distributed
    cfg = config(layers, dim, quick)
    world = MESH[0] * MESH[1]
    with tempfile.TemporaryDirectory(prefix="autoshard-bigmodel-") as folder:
        path, model_bytes, largest, real_plan = write_checkpoint(cfg, folder, batch, seq)
        program = plan(cfg, batch, seq)
        plan_json = {**program.plan.to_json(), "fingerprint": program.plan.fingerprint}
        predicted = program.plan.predicted["memory_bytes_per_rank"]
        ranks = run_distributed(_rank_task, world, cfg.to_dict(), batch, seq, plan_json, path, timeout_s=900)
        before = todays_path(cfg, batch, seq, path, real_plan)
    share = model_bytes / world
    target = 1.3 * share + largest
    rows = []
    for rank in sorted(ranks):
        r = ranks[rank]
        bound = r["shard_bytes"] + largest
        rows.append([rank, f"{r['shard_bytes'] / GIB:.3f}", f"{r['load_peak'] / GIB:.3f}", f"{r['step_peak'] / GIB:.3f}",
                     f"{bound / GIB:.3f}", f"{target / GIB:.3f}", f"{r['load_peak'] / target:.2f}",
                     f"{r['load_s']:.1f}", f"{r['step_s']:.1f}"])
    worst_load = max(r["load_peak"] for r in ranks.values())
    worst_step = max(r["step_peak"] for r in ranks.values())
    by_phase = ", ".join(f"{phase} {max(r['phases'][phase] for r in ranks.values()) / GIB:.3f}"
                         for phase in ranks[0]["phases"])
    headers = ["rank", "shards GiB", "load peak GiB", "step peak GiB", "shards + largest GiB", "target GiB",
               "load / target", "load s", "step s"]
    body = (f"transformers LlamaForCausalLM, {cfg.num_hidden_layers} layers, dim {cfg.hidden_size}, vocab "
            f"{cfg.vocab_size}: **{model_bytes / GIB:.2f} GiB** of float32 weights, largest tensor "
            f"{largest / GIB:.3f} GiB. Mesh (2, 4) dp x tp, Megatron hints on tp (embedding and head too), ZeRO-3 on dp; one SGD step on "
            f"batch {batch} x {seq} tokens. Peaks are RSS above each rank's RSS after `import torch` and the "
            f"process-group start (about {min(r['base'] for r in ranks.values()) / GIB:.2f} GiB).\n\n"
            + table(headers, rows)
            + f"\n\nTarget (issue 14): 1.3 x (model / {world}) + largest tensor = {target / GIB:.3f} GiB. Worst load "
            f"peak {worst_load / GIB:.3f} GiB ({worst_load / target:.2f} x target); worst step peak "
            f"{worst_step / GIB:.3f} GiB (gradients, activations and the step's temporaries on top; the plan "
            f"predicts {predicted / GIB:.3f} GiB per rank for training with Adam: parameters, gradients, "
            f"2 x optimizer state, activations). Peak by phase of the step, worst rank (GiB): {by_phase}.\n\n"
            f"Today's path before weights= (the full model with real weights on the rank, then its shards cut "
            f"out; rank 0, measured in one process): load peak **{before['load_peak'] / GIB:.3f} GiB** = "
            f"{before['load_peak'] / max(worst_load, 1):.1f} x the meta + safetensors path's worst rank.\n")
    title = "Big model: peak memory per rank, meta model + safetensors slices vs the full model per rank"
    write_section("big_model_memory", title, body, headers, rows)
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model (a smoke run, seconds)")
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    main(args.quick, args.layers, args.dim, args.batch, args.seq)
