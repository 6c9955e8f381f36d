"""The chosen plan of a planning benchmark (sections 5, 8 and 17) checked three ways: its own file, saved and applied
to the real model on its mesh, builds rank programs (`rank_programs_built`); the plan itself applies to a narrow copy
of the model (`plan_other_shapes`); its decisions, given as hints for the narrow copy, train one step in the simulator
like the single device in float64 (`verify_shrunk` runs all three). The `*_text` and `*_summary` helpers say the
outcomes in the tables and the sections' text.
"""
from __future__ import annotations

import math
import re
import tempfile
import time
import warnings
from pathlib import Path

import autoshard
from autoshard.catalogue.roles import layer_glob
from autoshard.ir.placement import Shard, Spec
from autoshard.search.shape_result import describe_roles
from autoshard.verify.verify import verify_simulated

from .planning_common import plan

SIMULATED_RANKS = 64  # above this the simulator takes minutes a step: the smallest mesh of the same structure


def decisions(plan, sizes: dict) -> dict:
    """The plan's decisions as `parallelize` options for the same mesh axes at `sizes` (axis name -> size): each
    parameter's and input's placement on every axis (one glob for all layers where they agree), its ZeRO and
    recomputed layers (its hints carry them), and its pipeline (axis, schedule, micro-batches per pp rank). On a
    ZeRO-3 axis the parameters' shards are ZeRO's, not placements: they are left to it."""
    hints = {k: v for k, v in (plan.hints or {}).items() if k in ("zero", "recompute")}
    zero3 = {axis for axis, stage in (hints.get("zero") or {}).items() if stage == 3}
    names = plan.mesh.names  # a pipeline's plan is its micro-batch program's: the mesh without the pp axis
    placements: dict = {}
    for row in plan.rows:
        if row.kind not in ("param", "input"):
            continue
        spec = Spec.parse(row.spec)
        hint = {n: str(p) if isinstance(p, Shard) else "R" for n, p in zip(names, spec)
                if not (row.kind == "param" and n in zero3)}
        if hint:
            placements[row.path] = hint
    globs: dict = {}
    for path, hint in placements.items():
        globs.setdefault(layer_glob(path), []).append((path, hint))
    for glob, members in globs.items():
        alike = all(hint == members[0][1] for _, hint in members)
        hints.update({glob: members[0][1]} if alike else dict(members))
    options = {"hints": hints}
    pipeline = plan.pipeline
    if pipeline:
        per_rank = max(1, pipeline["microbatches"] // pipeline["pp_size"])
        options["pipeline"] = {"axis": pipeline["axis"], "schedule": pipeline["schedule"],
                               "microbatches": per_rank * sizes[pipeline["axis"]],
                               "virtual_stages": pipeline.get("virtual_stages", 1)}
    return options


def smallest_batch(options: dict, sizes: dict) -> int:
    """The smallest batch `options` divide: the sizes of the axes the batch is split on times the micro-batches."""
    axes = {a for key, hint in options["hints"].items() if key.startswith("input:") for a, p in hint.items()
            if p == "S(0)"}
    return math.prod(sizes[a] for a in axes) * (options.get("pipeline") or {}).get("microbatches", 1)


def applied_file(prog, model, inputs, loss_fn, **options) -> tuple:
    """(Program or None, the refusal's first line): `prog`'s plan saved to a file and applied to `model` on its mesh
    shape (`parallelize(plan=<the file>, **options)` in bf16, as the benchmarks plan)."""
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "plan.json")
        prog.plan.save(path)
        applied, error, _, _ = plan(model, inputs, loss_fn, mesh=tuple(prog.mesh.shape), plan=path, **options)
    return applied, error


def rank_programs_built(prog, real: tuple, profile: str) -> dict:
    """The chosen plan's own file applied to the real model (`real`: (model, inputs, loss_fn) on the meta device, as
    planned) on its mesh, and rank 0's and the last rank's programs built from it (a pipeline's: their stages'
    graphs): the figures published are of a plan whose file compiles to rank programs. A refusal or an error is
    recorded, not raised."""
    start = time.perf_counter()
    ranks = sorted({0, prog.mesh.size - 1})
    applied, error = applied_file(prog, *real, profile=profile)
    if applied is not None:
        try:
            for rank in ranks:
                applied.graph(rank)
        except Exception as exc:  # noqa: BLE001 -- the table says what failed
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return {"built_ranks": ranks if not error else [], "built_error": error, "built_s": time.perf_counter() - start}


def built_text(check) -> str:
    """The real-width check in a few words."""
    if check.get("built_ranks"):
        return f"yes: ranks {' and '.join(map(str, check['built_ranks']))}, {check['built_s']:.0f} s"
    return f"no: {check.get('built_error', 'not checked')[:100]}"


def built_summary(results) -> str:
    """One sentence: for how many chosen plans the saved plan file built rank programs at the real width."""
    checked = [r for r in results if r["auto"]["mesh"]]
    built = sum(bool(r["verify"]["built_ranks"]) for r in checked)
    return (f"The plan file of {built} of {len(checked)} chosen plans, saved and applied to the real model on its "
            "mesh (`parallelize(plan=...)`: no solving), built rank 0's and the last rank's programs (the first check "
            "column; a pipeline's: their stages' graphs).")


def verify_shrunk(prog, tiny, batch: int, profile: str, real: tuple) -> dict:
    """The chosen plan's file applied to the real model (`real`, see `rank_programs_built`), and the plan checked on
    a narrow copy of the model (`tiny(batch, device)` -> (model, inputs, loss_fn): the same family and depth at a
    small width).

    Two narrow checks. "applies": the plan itself, made at the real width, applied to the narrow copy at the real `batch`
    on the same mesh shape (`parallelize(plan=..., plan_other_shapes=True)`: every decision still holds there, and
    the rank programs are generated). "trains": its decisions (`decisions`) planned for the narrow copy in float64 on the same mesh
    shape, or where that has more than SIMULATED_RANKS ranks on the smallest mesh of the same axes (each of size 2,
    the pipeline then of 2 stages), at the smallest batch they divide, and one training step in the simulator
    against the single device (float64: within 1e-6)."""
    shape, names = tuple(prog.mesh.shape), tuple(prog.mesh.names)
    sizes = dict(zip(names, shape))
    small = sizes if math.prod(shape) <= SIMULATED_RANKS else {n: 2 for n in names}
    # on the meta device at the real batch, as the plan was made: a dim of 1, or another device's attention
    # kernel (its output's strides), traces to another graph
    model, inputs, loss_fn = tiny(batch, "meta")
    start = time.perf_counter()
    applied, error = applied_file(prog, model, inputs, loss_fn, plan_other_shapes=True, profile=profile)
    applies_s = time.perf_counter() - start
    options = decisions(prog.plan, small)
    batch = smallest_batch(options, small)
    model, inputs, loss_fn = tiny(batch, "cpu")
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            report, checked = verify_simulated(model, inputs, loss_fn, mesh=tuple(small.values()), steps=1,
                                               profile=profile, **options)
        except autoshard.AutoshardError as exc:
            report, checked = None, str(exc).splitlines()[0]
    return {**rank_programs_built(prog, real, profile), "applies": applied is not None, "applies_error": error,
            "applies_s": applies_s,
            "mesh": tuple(small.values()), "batch": batch, "ok": report is not None and report.ok,
            "roles": describe_roles(checked) if report is not None else "",
            "report": repr(report) if report is not None else checked, "seconds": time.perf_counter() - start}


NOT_VERIFIED = {"built_ranks": [], "built_error": "no plan", "built_s": 0.0, "applies": False, "applies_error": "no plan",
                "applies_s": 0.0, "mesh": (), "batch": 0, "ok": False, "roles": "", "report": "no plan", "seconds": 0.0}


def verified_text(check) -> str:
    """The narrow copy's training check in a few words."""
    if not check["mesh"]:
        return "-"
    result = "OK" if check["ok"] else "MISMATCH" if check["roles"] else f"not planned: {check['report'][:90]}"
    return f"{result} on {tuple(check['mesh'])}, batch {check['batch']}"


APPLIES = {  # why a plan did not apply at the narrow width, as the tables and the text say it
    "casts": ("refused, the bf16 casts are elsewhere in the plan's rows (ZeRO-3)",
              ("a ZeRO-3 plan of this model in bf16 is refused even at its own shapes (the plan's rows have "
               "parameter casts where the traced graph has other nodes: \"the plan has node 'embedding' where the "
               "traced graph has node 'to'\")")),
    "cut": ("refused, the pipeline is cut elsewhere at this width",
            "a pipelined plan is refused: the stages its rows give do not cut the narrow copy's graph"),
    "divide": ("refused, a decision does not divide the narrow copy's dims",
               "a decision that splits a dim of the narrow copy over an axis whose size does not divide it is refused"),
}


def applies_cause(check) -> str:
    """"yes", a key of APPLIES, or "other": whether the plan itself applied at the narrow width, and if not why."""
    error = check["applies_error"]
    if check["applies"]:
        return "yes"
    if re.search(r"(the plan has|traced graph has) node 'to(_\d+)?' \(to\.dtype", error):
        return "casts"
    if "not a strategy autoshard can use there" in error:
        return "divide"
    return "cut" if "cuts the model elsewhere" in error else "other"


def applies_text(check) -> str:
    """Whether the plan itself applied at the narrow width (and why not, in short: see the section's text)."""
    cause = applies_cause(check)
    if cause == "yes":
        return "yes"
    return f"no: {APPLIES[cause][0]}" if cause in APPLIES else f"no: {check['applies_error'][:100]}"


def applies_summary(results, name) -> str:
    """One sentence: for how many of the checked plans the plan itself applied, and why the others did not."""
    checked = [r for r in results if r["verify"]["mesh"]]
    causes = [applies_cause(r["verify"]) for r in checked]
    applied = [name(r) for r, c in zip(checked, causes) if c == "yes"]
    why = []
    for cause, (_, sentence) in APPLIES.items():
        rows = [r for r, c in zip(checked, causes) if c == cause]
        if rows and cause == "divide":
            sentence += " (" + "; ".join(_undivided(r, name) for r in rows) + ")"
        if rows:
            why.append(sentence)
    text = f"The plan itself applied for {len(applied)} of {len(checked)}" + (f" ({', '.join(applied)})" if applied
                                                                             else "")
    return text + (": " + "; ".join(why) if why else "") + "."


def _undivided(r, name) -> str:
    """Where a plan's decision does not divide the narrow copy: the parameter and the axis, from the refusal."""
    found = re.search(r"at ([\w.]+)\) on mesh axis '(\w+)'", r["verify"]["applies_error"])
    if not found:
        return name(r)
    size = dict(zip(r["auto"]["names"], r["auto"]["mesh"]))[found[2]]
    return f"{name(r)}: {found[1]} over {found[2]} of {size}"

