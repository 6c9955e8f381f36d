"""What the planning benchmarks (sections 5, 8 and 17) share: a `parallelize` call measured (wall and CPU seconds, the
refusal's first line), the figures their tables show of a plan, and the hand plans they price on a published mesh.
"""
from __future__ import annotations

import math
import os
import re
import time
import warnings

import autoshard
from autoshard.catalogue import hand_plans as catalogue
from autoshard.catalogue.roles import model_roles
from autoshard.cost.profiles import load_profile
from autoshard.frontend.request import CompileOptions, CompileRequest
from autoshard.passes.pass_lists import trace_for_plan
from autoshard.search.mesh_search import candidate_shapes
from autoshard.search.shape_result import describe_roles

PP = "pp"  # the pipeline axis of a published mesh


def _cpu_s() -> float:
    """CPU seconds of this process and of its children that finished (the mesh search's planning workers)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def plan(model, inputs, loss_fn, **options):
    """`parallelize` in bf16 mixed precision: (Program or None, the refusal's first line, wall s, CPU s of this
    process and its planning workers)."""
    wall, cpu = time.perf_counter(), _cpu_s()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            prog = autoshard.parallelize(model, example_inputs=inputs, loss_fn=loss_fn, mixed_precision="bf16",
                                         **options)
        except autoshard.AutoshardError as exc:
            prog, error = None, str(exc).splitlines()[0]
        else:
            error = ""
    return prog, error, time.perf_counter() - wall, _cpu_s() - cpu


def memory_bytes(prog) -> float:
    """Bytes per device the plan is predicted to hold: a pipeline's fullest pp rank (its stages' parameters and
    the micro-batches 1F1B keeps in flight), else the intra-op plan's figure (what the mesh search compares)."""
    pipeline = prog.plan.pipeline
    if pipeline and pipeline.get("memory_bytes_per_pp_rank"):
        return max(pipeline["memory_bytes_per_pp_rank"])
    return prog.plan.predicted["memory_bytes_per_rank"]


def figures(prog) -> dict:
    """What the tables show of one plan."""
    pipeline = prog.plan.pipeline or {}
    hints = prog.plan.hints or {}
    return {"mesh": tuple(prog.mesh.shape), "names": tuple(prog.mesh.names), "roles": describe_roles(prog),
            "zero": repr(prog.zero) if getattr(prog, "zero", None) is not None else "none",
            "pipeline": (f"{pipeline['stages']} stages over {pipeline['axis']}, {pipeline['microbatches']} "
                         f"micro-batches, {pipeline['schedule']}") if pipeline else "none",
            "recomputed": len(hints.get("recompute", [])), "step_s": prog.plan.step_s,
            "memory_bytes": memory_bytes(prog), "chosen_plan": prog.plan.search.get("chosen_plan", ""),
            "overlapped_s": prog.plan.predicted.get("overlapped_step_s", prog.plan.predicted["step_time_s"])}


def no_plan(error: str) -> dict:
    """`figures` of a refusal: what the tables show where `parallelize` returned no plan.

    >>> no_plan("no plan fits the memory budget of 67.055 GiB (...): the smallest footprint ... is 148.297 GiB (...)")["roles"]
    'no plan fits the budget (smallest footprint 148.3 GiB)'
    """
    footprint = re.search(r"smallest footprint .*? is ([\d.]+) GiB", error)
    short = f"no plan fits the budget (smallest footprint {float(footprint[1]):.1f} GiB)" if footprint else \
        f"no plan: {error[:100]}"
    return {"mesh": (), "names": (), "roles": short, "zero": "-", "pipeline": "-", "recomputed": 0,
            "step_s": math.nan, "memory_bytes": math.nan, "chosen_plan": "-", "overlapped_s": math.nan}


def mesh_search_record(prog, error: str, devices: int, profile: str) -> tuple[list, str]:
    """The candidate meshes `parallelize(devices=...)` compared and why it kept one; on a refusal, the shapes it
    tried (none planned: the refusal is the one with the smallest footprint)."""
    if prog is not None:
        return prog.plan.search["mesh_candidates"], prog.plan.search["why_mesh"]
    nodes = load_profile(profile).devices_per_node
    return [{"mesh": list(shape), "error": "no plan"} for shape in candidate_shapes(devices, nodes)], error


def num(value: float, spec: str) -> str:
    """`value` formatted, or "-" where there is none (NaN: no plan)."""
    return "-" if math.isnan(value) else format(value, spec)


def catalogue_roles(model, inputs, loss_fn, mesh: autoshard.Mesh):
    """The model's roles for the catalogue's hand plans, from its (folded) trace."""
    request = CompileRequest(model, mesh, inputs, None, loss_fn, CompileOptions.parse(mixed_precision="bf16"))
    traced, _ = trace_for_plan(request, None, request.options)
    return model_roles(traced.gm)


def published_mesh(sizes: dict) -> autoshard.Mesh:
    """The published degrees as a named mesh, pipeline outermost and tensor parallelism innermost (the fastest
    links); degrees of 1 are left out."""
    names = tuple(n for n in (PP, "dp", "tp") if sizes.get(n, 1) > 1)
    return autoshard.Mesh(tuple(sizes[n] for n in names), names)


def hand_plan(roles, mesh: autoshard.Mesh, batch: int, n_inputs: int, microbatches: int | None = None):
    """The catalogue plan for the published layout: FSDP x TP x PP with a pipeline axis, FSDP x TP with a tp axis,
    else FSDP (torchtitan's names; Megatron's layouts are the same plans without ZeRO)."""
    if PP in mesh.names:
        return catalogue.fsdp_tp_pp(roles, mesh, batch, n_inputs, microbatches=microbatches)
    if "tp" in mesh.names:
        return catalogue.fsdp_tp(roles, mesh, batch, n_inputs)
    return catalogue.fsdp(roles, mesh, batch, n_inputs)



def shape_text(f) -> str:
    """A plan's mesh with its axis names: (a0=4, a1=8); "-" for no plan."""
    return "(" + ", ".join(f"{n}={s}" for n, s in zip(f["names"], f["mesh"])) + ")" if f["mesh"] else "-"

