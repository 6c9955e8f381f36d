"""Benchmark 1, plan quality: communication bytes per training step and memory per rank of autoshard's
automatic plan vs the hand-written Megatron plan (torch parallelize_module) and DDP / FSDP2, for the
zoo's GPT-2 and Llama at a weight-heavy width on tp = 2, 4, 8 and dp x tp = (2,2), (2,4).

Every plan trains on real gloo ranks; one step after a warm-up step is counted at the dispatcher
(comm_counter.CollectiveCounter, the same counter for every contender) and autoshard's own CommLog.
autoshard's automatic plan gets the memory budget the Megatron plan needs (its predicted bytes per
rank): without a budget the planner replicates a model this small (no communication, full memory per
rank), which is a correct plan but not a comparison.
"""
from __future__ import annotations

import os
import sys
import tempfile

import autoshard
from autoshard.ir.collective_table import TABLE
from autoshard.runtime.launch import run_distributed
from autoshard.zoo import gpt2, llama
from autoshard.zoo.hints import plan_hints

from .comm_counter import CollectiveCounter, ring_factor
from .memory import model_state_bytes, saved_activations
from .report import table, write_section

FACTORIES = {"gpt2": gpt2, "llama": llama}
# Weight-heavy shapes (as autoshard.zoo.hints.gpt2_wide / llama_wide) with 8 heads, so tp = 8 divides them.
SHAPES = {"gpt2": dict(batch=8, seq=16, dim=512, n_heads=8),
          "llama": dict(batch=8, seq=16, dim=512, n_heads=8, n_kv_heads=8, ffn_dim=1024)}
MESHES = [((2,), ("tp",)), ((4,), ("tp",)), ((8,), ("tp",)), ((2, 2), ("dp", "tp")), ((2, 4), ("dp", "tp"))]
QUICK_MESHES = [((2,), ("tp",))]
TORCH_PLANS = ("torch Megatron (parallelize_module)", "DDP", "FSDP2 (fully_shard)")

def predicted_bytes(plan) -> tuple[int, float]:
    """(logical bytes per step in the runtime's convention, ring wire bytes one rank sends) of a plan."""
    mesh = plan.mesh
    logical, wire = 0, 0.0
    for row in plan.collectives():
        k = mesh.shape[mesh.axis(row.axis)]
        collective = TABLE[row.collective]  # the ring collective each direction runs (the duality rule's backward)
        fwd_kind, bwd_kind = collective.forward, collective.backward
        logical += row.bytes_fwd + row.bytes_bwd
        wire += row.bytes_fwd * ring_factor(fwd_kind or "", k) + row.bytes_bwd * ring_factor(bwd_kind or "", k)
    for axis, per_phase in plan.predicted["comm_bytes_per_step"].items():
        logical += per_phase["sync"]
        wire += per_phase["sync"] * ring_factor("all_reduce", mesh.shape[mesh.axis(axis)])
    return logical, wire


def plan_autoshard(model_name: str, shape: dict, mesh_shape, axis_names, folder: str) -> list[dict]:
    """The Megatron-hinted plan and the automatic plan under the Megatron plan's memory: jobs for the ranks."""
    factory = FACTORIES[model_name]
    hints = plan_hints(model_name, axis_names, batch_axes=axis_names[:-1], tp_axis=axis_names[-1])
    model, inputs, loss_fn = factory(**shape)
    megatron = autoshard.parallelize(model, mesh_shape, inputs, loss_fn=loss_fn, axis_names=axis_names, hints=hints)
    budget = megatron.plan.predicted["memory_bytes_per_rank"]
    model, inputs, loss_fn = factory(**shape)
    auto = autoshard.parallelize(model, mesh_shape, inputs, loss_fn=loss_fn, axis_names=axis_names,
                                 memory_budget=budget)
    jobs = []
    for variant, prog in (("autoshard auto", auto), ("autoshard + Megatron hints", megatron)):
        path = os.path.join(folder, f"{model_name}-{'x'.join(map(str, mesh_shape))}-{len(jobs)}.json")
        prog.plan.save(path)
        logical, wire = predicted_bytes(prog.plan)
        jobs.append(dict(model=model_name, shape=shape, variant=variant, plan=path, predicted_logical=logical,
                         predicted_wire=wire, predicted_memory=prog.plan.predicted["memory_bytes_per_rank"],
                         predicted_step_s=prog.plan.predicted["step_time_s"]))
    return jobs


def _counted_step(trainer) -> dict:
    trainer.step()  # warm-up: DDP builds its buckets, FSDP its groups
    comm = getattr(trainer, "comm", None)
    if comm is not None:
        comm.log.clear()
    with CollectiveCounter() as counter, saved_activations(trainer.module.parameters) as saved:
        loss = trainer.step()
    result = {"logical": counter.total_logical(), "wire": counter.total_wire(), "calls": dict(counter.calls),
              "state": model_state_bytes(trainer.parameters()), "activations": saved["bytes"], "loss": float(loss)}
    if comm is not None:
        result["commlog"] = sum(comm.log.bytes.values())
    return result


def rank_task(rank, world, mesh_shape, axis_names, jobs):
    """Every contender on this rank, one after another; returns {job index: counted result}."""
    from .autoshard_runner import autoshard_trainer
    from .torch_baselines import ddp, fsdp, megatron_dtensor
    results = {}
    for i, job in enumerate(jobs):
        model, inputs, loss_fn = FACTORIES[job["model"]](**job["shape"])
        variant = job["variant"]
        if variant.startswith("autoshard"):
            trainer = autoshard_trainer(model, inputs, loss_fn, rank, mesh_shape, axis_names, plan=job["plan"])
        elif variant == TORCH_PLANS[0]:
            trainer = megatron_dtensor(job["model"], model, inputs, loss_fn, mesh_shape, axis_names)
        elif variant == "DDP":
            trainer = ddp(model, inputs, loss_fn)
        else:
            trainer = fsdp(model, inputs, loss_fn)
        results[i] = _counted_step(trainer)
    return results


def measure(meshes, models, shapes=None) -> list[dict]:
    rows = []
    dp_baselines_done: set = set()  # DDP / FSDP depend only on the number of ranks
    with tempfile.TemporaryDirectory() as folder:
        for mesh_shape, axis_names in meshes:
            world = 1
            for n in mesh_shape:
                world *= n
            jobs = []
            for model_name in models:
                shape = (shapes or SHAPES)[model_name]
                jobs += plan_autoshard(model_name, shape, mesh_shape, axis_names, folder)
                jobs += [dict(model=model_name, shape=shape, variant=v) for v in TORCH_PLANS
                         if v == TORCH_PLANS[0] or world not in dp_baselines_done]
            dp_baselines_done.add(world)
            per_rank = run_distributed(rank_task, world, mesh_shape, axis_names, jobs, timeout_s=600)
            for i, job in enumerate(jobs):
                counted = [per_rank[r][i] for r in sorted(per_rank)]
                mesh_name = "x".join(map(str, mesh_shape)) if job["variant"] not in ("DDP", "FSDP2 (fully_shard)") \
                    else f"{world} ranks"
                rows.append(dict(job, mesh=mesh_name, axes=",".join(axis_names), world=world,
                                 counted_logical=max(c["logical"] for c in counted),
                                 counted_wire=max(c["wire"] for c in counted),
                                 commlog=max(c.get("commlog", 0) for c in counted),
                                 memory=max(c["state"] + c["activations"] for c in counted),
                                 activations=max(c["activations"] for c in counted),
                                 loss=counted[0]["loss"]))
    return rows


MiB = 2**20


def _best_torch(rows, row) -> dict:
    """The torch plan with the fewest wire bytes for the same model on the same mesh / number of ranks."""
    peers = [r for r in rows if r["model"] == row["model"] and r["variant"] in TORCH_PLANS and
             (r["mesh"] == row["mesh"] or (r["variant"] != TORCH_PLANS[0] and r["world"] == row["world"]))]
    return min(peers, key=lambda r: r["counted_wire"])


def _megatron_peer(rows, row) -> dict:
    return next(r for r in rows if r["model"] == row["model"] and r["mesh"] == row["mesh"] and
                r["variant"] == TORCH_PLANS[0])


def _megatron_hinted(rows, row) -> dict:
    return next(r for r in rows if r["model"] == row["model"] and r["mesh"] == row["mesh"] and
                r["variant"] == "autoshard + Megatron hints")


def _why_missed(auto, hinted, bytes_ratio, memory_ratio) -> str:
    """Why the automatic plan missed on this row and what would close it, from the measured figures."""
    notes = [f"Why {auto['model']} on {auto['mesh']} misses:"]
    if bytes_ratio > 1.0 and auto["predicted_step_s"] < hinted["predicted_step_s"]:
        notes.append(f"the ILP minimises predicted step time, not bytes: it predicts "
                     f"{auto['predicted_step_s'] * 1e6:.0f} us for its plan against "
                     f"{hinted['predicted_step_s'] * 1e6:.0f} us for the Megatron plan, having traded bytes for less "
                     "compute or cheaper links by its profile; on gloo's flat links those bytes are not cheaper. A "
                     "profile calibrated on these ranks (python -m autoshard calibrate) would price them as they run.")
    elif bytes_ratio > 1.0:
        notes.append(f"the ILP's plan is predicted no faster ({auto['predicted_step_s'] * 1e6:.0f} us) than the "
                     f"Megatron plan ({hinted['predicted_step_s'] * 1e6:.0f} us) yet was chosen: the axis-by-axis "
                     "solve is not globally optimal; solving the axes jointly would close it.")
    if memory_ratio > 1.05:
        notes.append(f"memory: the plan was predicted at {auto['predicted_memory'] / MiB:.1f} MiB/rank (inside the "
                     f"{hinted['predicted_memory'] / MiB:.1f} MiB budget) but measured "
                     f"{auto['memory'] / MiB:.1f} MiB: the cost model under-counts the activations this plan saves "
                     "for backward (e.g. a gathered copy kept beside the sharded one); counting saved tensors per "
                     "chosen strategy in predict/cost would close it.")
    return " ".join(notes)


def report(rows) -> tuple[str, list, list]:
    headers = ["model", "mesh", "plan", "predicted MiB/step", "counted MiB/step", "CommLog MiB/step",
               "wire MiB/rank/step", "predicted mem MiB/rank", "measured mem MiB/rank"]
    def fmt(v):
        return f"{v / MiB:.2f}" if isinstance(v, (int, float)) else "—"
    table_rows = [[r["model"], r["mesh"], r["variant"], fmt(r.get("predicted_logical")), fmt(r["counted_logical"]),
                   fmt(r["commlog"]) if r["variant"].startswith("autoshard") else "—", fmt(r["counted_wire"]),
                   fmt(r.get("predicted_memory")), fmt(r["memory"])] for r in rows]
    autos = [r for r in rows if r["variant"] == "autoshard auto"]
    ratio_rows, all_met, whys = [], True, []
    for r in autos:
        best, megatron = _best_torch(rows, r), _megatron_peer(rows, r)
        exact = all(abs(r[k] - r["predicted_logical"]) <= 0.01 * max(r["predicted_logical"], 1)
                    for k in ("counted_logical", "commlog"))
        bytes_ratio = r["counted_wire"] / max(best["counted_wire"], 1)
        memory_ratio = r["memory"] / megatron["memory"]
        met = bytes_ratio <= 1.0 and exact and memory_ratio <= 1.05
        all_met &= met
        if not met:
            whys.append(_why_missed(r, _megatron_hinted(rows, r), bytes_ratio, memory_ratio))
        ratio_rows.append([r["model"], r["mesh"], "yes" if exact else "NO", best["variant"],
                           f"{bytes_ratio:.2f}", f"{r['counted_wire'] / max(megatron['counted_wire'], 1):.2f}",
                           f"{memory_ratio:.2f}", "yes" if met else "NO"])
    ratio_headers = ["model", "mesh", "predicted = counted", "fewest-bytes torch plan", "wire ratio vs it",
                     "wire ratio vs torch Megatron", "memory ratio vs torch Megatron", "met"]
    body = (
        "Target: autoshard's automatic plan sends no more bytes per training step than the best of torch's plans "
        "on the same ranks (Megatron via parallelize_module, DDP, FSDP2), at no more memory per rank than the "
        "Megatron plan (its budget; 5% slack for measurement), and autoshard's predicted bytes equal the bytes "
        f"counted at run time. **{'Met on every row below' if all_met else 'NOT met on the rows marked NO'}.**\n\n"
        + table(ratio_headers, ratio_rows) + "".join(f"\n\n{why}" for why in whys) +
        "\n\nHow measured: every plan trains on real gloo ranks (float32, SGD); the second step is counted by one "
        "TorchDispatchMode on every rank (benchmarks/comm_counter.py) that sees DTensor's functional collectives "
        "and the c10d ops of DDP, FSDP2, torch.distributed and autoshard's runtime alike (largest rank shown). "
        "'MiB/step' is the runtime's logical convention (all_gather: gathered output; others: this rank's input); "
        "'wire' is what one rank sends on a ring (all_reduce x 2(k-1)/k, the others x (k-1)/k), the fair figure "
        "between all-reduce plans and reduce-scatter/all-gather plans. 'Predicted' is autoshard's plan (its cost "
        "model); for torch's plans the row 'autoshard + Megatron hints' is the prediction of the same Megatron "
        "plan. Memory: local parameters x (1 + gradient + 2 Adam states), autoshard's prediction convention, plus "
        "the storages autograd saved for backward (parameters excluded; FSDP2's transient unsharded layer is not "
        "counted). DDP and FSDP2 run on all the ranks of the mesh (batch split over all of them). The automatic "
        "plan is given the Megatron plan's predicted memory as its budget: unbounded, it replicates models this "
        "small (zero bytes, full memory). torch's Megatron sends more than autoshard's same plan because "
        "ColwiseParallel all-reduces the input gradient of q, k and v (and w1, w3) separately in backward, where "
        "autoshard sums them first and reduces once. parallelize_module also needed the attention rewritten for "
        "local head counts (benchmarks/models/local_heads.py); autoshard took the model unchanged.\n\n"
        + table(headers, table_rows))
    csv_headers = ["model", "mesh", "axes", "world", "variant", "predicted_logical_bytes", "counted_logical_bytes",
                   "commlog_bytes", "counted_wire_bytes", "predicted_memory_bytes", "measured_memory_bytes",
                   "activation_bytes", "loss"]
    csv_rows = [[r["model"], r["mesh"], r["axes"], r["world"], r["variant"], r.get("predicted_logical", ""),
                 r["counted_logical"], r["commlog"], int(r["counted_wire"]), r.get("predicted_memory", ""),
                 r["memory"], r["activations"], f"{r['loss']:.6g}"] for r in rows]
    return body, csv_headers, csv_rows


def main(quick: bool = False) -> None:
    rows = measure(QUICK_MESHES if quick else MESHES, ["gpt2"] if quick else ["gpt2", "llama"])
    body, headers, csv_rows = report(rows)
    write_section("plan_quality", "1. Plan quality: bytes and memory vs torch's plans", body, headers, csv_rows)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
