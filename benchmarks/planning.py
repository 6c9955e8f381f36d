"""Benchmark 3, planning time: Llama-3-8B on (8,8) and GPT-3-175B on (8,16,8) end to end (export
included, weights on the meta device), planning time vs depth (8 ... 96 layers) and vs mesh size (2 ...
1024 devices), with the ILP sizes.

Targets (issue 3): Llama-3-8B on (8,8) <= 15 s; GPT-3-175B on (8,16,8) <= 60 s; time vs depth at most
linear; (issue 7) time vs devices at most linear in the number of mesh axes (the ILP is solved per
axis, so a mesh of 1024 devices should cost about what its three axes cost, not 1024x). Each shape runs
in a fresh subprocess (cold start, as `python -m autoshard plan` would).
"""
from __future__ import annotations

import json
import math
import subprocess
import sys

from .plots import line_chart
from .report import table, write_csv, write_section

_CHILD = r"""
import json, sys, time
start = time.perf_counter()
import torch
exports = [0]
_export = torch.export.export
def _counted_export(*args, **kwargs):  # how many times the planner traced the model
    exports[0] += 1
    return _export(*args, **kwargs)
torch.export.export = _counted_export
import autoshard
from autoshard.zoo import llama, gpt2
spec = json.loads(sys.argv[1])
factory = {"llama": llama, "gpt2": gpt2}[spec.pop("model")]
mesh = tuple(spec.pop("mesh"))
budget = spec.pop("memory_budget", None)
model, inputs, loss_fn = factory(device="meta", **spec)
built = time.perf_counter()
prog = autoshard.parallelize(model, mesh, inputs, loss_fn=loss_fn, memory_budget=budget)
done = time.perf_counter()
history = {e.name: e.seconds for e in prog.history}
print(json.dumps({"total_s": done - start, "build_s": built - start, "plan_s": done - built,
                  "passes": history, "ilp": prog.state.ilp_stats,
                  "step_time_s": prog.plan.predicted["step_time_s"], "exports": exports[0],
                  "candidates": len((prog.plan.search or {}).get("candidates", [])) or 1,
                  "memory_gib": prog.plan.predicted["memory_bytes_per_rank"] / 2**30}))
"""

LLAMA3_8B = dict(model="llama", batch=8, seq=8192, dim=4096, n_heads=32, n_kv_heads=8, n_layers=32, ffn_dim=14336,
                 vocab_size=128256, mesh=[8, 8])
GPT3_175B = dict(model="gpt2", batch=8, seq=2048, dim=12288, n_heads=96, n_layers=96, vocab_size=50304,
                 mesh=[8, 16, 8])


def run(spec: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)], capture_output=True, text=True,
                          timeout=900)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(quick: bool = False) -> None:
    rows, results = [], []
    for name, spec, target in (("Llama-3-8B (8,8)", LLAMA3_8B, 15.0), ("GPT-3-175B (8,16,8)", GPT3_175B, 60.0)):
        result = run(dict(spec))
        results.append((name, result))
        ilp = "; ".join(f"{'+'.join(s['axes'])}: {s['variables']} vars, {s['constraints']} rows"
                        for s in result["ilp"])
        rows.append([name, f"{result['total_s']:.1f}", f"{target:.0f}", "yes" if result["total_s"] <= target else "NO",
                     f"{result['passes'].get('solve', 0):.2f}", ilp, f"{result['step_time_s']:.3g}",
                     f"{result['memory_gib']:.1f}"])
    headers = ["model / mesh", "plan s (cold, export incl.)", "target s", "met", "solve s", "ILP size",
               "predicted step s", "memory GiB/rank"]
    body = table(headers, rows)
    if any(r[3] == "NO" for r in rows):
        body += ("\n\nWhy a target is missed: on an unnamed mesh the planner also plans a pipeline over each class "
                 "of axes and compares predicted steps (" + "; ".join(
                     f"{name}: {r['candidates']} candidates, {r['exports']} torch.export traces"
                     for name, r in results) + "); each candidate's micro-batch program has other shapes, so "
                 "each is traced again, and export is most of the time (solve is the 'solve s' column). "
                 "What would close it: trace once with a symbolic batch dim and specialise the shapes per "
                 "candidate, or bound a pipeline's step from the flat plan's stage costs and plan it only "
                 "when the bound can win. With a named mesh (no search) one trace suffices.")
    depth_rows = []
    depths = (8, 16) if quick else (8, 16, 32, 64, 96)
    for layers in depths:
        # Deep stacks of 8B-wide layers do not fit 64 x 80 GB without activation checkpointing; this table
        # measures planning time only, so the memory bound is lifted.
        spec = dict(LLAMA3_8B, n_layers=layers, memory_budget=float("inf"))
        result = run(spec)
        depth_rows.append([layers, f"{result['plan_s']:.2f}", f"{result['passes'].get('solve', 0):.2f}",
                           f"{result['passes'].get('normalize', 0):.2f}",
                           sum(s["variables"] for s in result["ilp"]), f"{result['plan_s'] / layers:.3f}"])
    depth_headers = ["layers", "plan s (after import/build)", "solve s", "normalize s", "ILP variables",
                     "plan s per layer"]
    per_layer = [float(r[-1]) for r in depth_rows]
    linear = per_layer[-1] <= per_layer[0] * 1.25
    body += ("\n\nPlanning time vs depth (Llama-3-8B layer shape on (8,8)); target: at most linear — "
             f"{'met' if linear else 'NOT met'} (time per layer {per_layer[0]:.3f} s at {depths[0]} layers, "
             f"{per_layer[-1]:.3f} s at {depths[-1]}). Repeated layers share one ILP decision, so the ILP does "
             "not grow with depth; the remaining linear part is export, shape propagation and per-node cost "
             "evaluation.\n\n" + table(depth_headers, depth_rows))
    mesh_body, mesh_headers, mesh_rows = mesh_scaling(quick)
    body += "\n\n" + mesh_body
    write_section("planning", "3. Planning time vs model, depth and mesh size", body, headers, rows)
    write_csv("planning_depth", depth_headers, depth_rows)
    write_csv("planning_mesh", mesh_headers, mesh_rows)
    line_chart("planning_depth", "Planning time vs depth (Llama-3-8B layers, (8,8))", "layers", "seconds",
               [r[0] for r in depth_rows], {"plan": [float(r[1]) for r in depth_rows],
                                            "solve": [float(r[2]) for r in depth_rows]})
    line_chart("planning_mesh", "Planning time vs devices (8 Llama-3-8B layers)", "devices", "seconds",
               [r[1] for r in mesh_rows], {"plan": [float(r[2]) for r in mesh_rows],
                                           "solve": [float(r[3]) for r in mesh_rows]}, logx=True)


# Meshes from 2 to 1024 devices; one axis per factor of 8-ish, as clusters are built (8 GPUs per node).
MESHES = ([2], [8], [8, 8], [8, 16], [8, 16, 8])
QUICK_MESHES = ([2], [8, 8])
MESH_SCALING_LAYERS = 8


def mesh_scaling(quick: bool):
    """Planning time of an 8-layer Llama-3-8B-shaped model on meshes of 2 ... 1024 devices."""
    rows, per_axis = [], []
    for mesh in (QUICK_MESHES if quick else MESHES):
        spec = dict(LLAMA3_8B, n_layers=MESH_SCALING_LAYERS, mesh=mesh, memory_budget=float("inf"))
        result = run(spec)
        per_axis.append(result["plan_s"] / len(mesh))
        rows.append([str(tuple(mesh)), math.prod(mesh), f"{result['plan_s']:.2f}",
                     f"{result['passes'].get('solve', 0):.2f}", f"{per_axis[-1]:.2f}",
                     sum(s["variables"] for s in result["ilp"]), sum(s["constraints"] for s in result["ilp"]),
                     "; ".join(f"{'+'.join(s['axes'])}: {s['variables']}/{s['constraints']}" for s in result["ilp"])])
    headers = ["mesh", "devices", "plan s (after import/build)", "solve s", "plan s per mesh axis", "ILP variables",
               "ILP constraints", "ILP per axis: variables/constraints"]
    met = max(per_axis) <= 1.25 * per_axis[0]
    body = (f"Planning time vs mesh size ({MESH_SCALING_LAYERS}-layer Llama-3-8B shape, meta weights, no memory "
            "bound); "
            "target: time grows with the number of mesh axes, not with devices (plan s per mesh axis at most 1.25x "
            f"that of the {rows[0][1]}-device mesh) — {'met' if met else 'NOT met'} (largest ratio "
            f"{max(per_axis) / per_axis[0]:.2f}; {rows[-1][2]} s at {rows[-1][1]} devices vs {rows[0][2]} s at "
            f"{rows[0][1]}). The ILP is solved axis by axis; an "
            "axis's ILP has the same variables whatever the axis size, which only changes the costs.\n\n"
            + table(headers, rows))
    return body, headers, rows


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
