"""Benchmark 14 (issue 28): the automatic plan against every hand plan of the catalogue, priced by one cost model.

For each case (transformers' LlamaForCausalLM at the Llama 3 8B and 70B shapes wrapped as the zoo wraps it, and
the zoo's mixture-of-experts Llama at the Mixtral-8x7B shape; meta weights, bf16 mixed precision, the default H100
profile and its memory budget): `parallelize` without hints (the plan users get), and each catalogue plan
(autoshard/catalogue/) planned as a user would, `parallelize(model, mesh, inputs, **plan.options)`. Every row is a
plan `parallelize` returns and can run. The ratio is automatic / the fastest catalogue plan that fits (its predicted
memory per device within the budget; target <= 1.00 on every row); planning times are CPU seconds of this process (the machine's other jobs do not count).
"""
from __future__ import annotations

import time
import warnings

import torch

import autoshard
from autoshard.catalogue import hand_plans as catalogue
from autoshard.catalogue.roles import model_roles
from autoshard.frontend.request import CompileOptions, CompileRequest
from autoshard.frontend.trace import reuse_exports
from autoshard.passes.pass_lists import trace_for_plan
from autoshard.zoo import moe_llama
from autoshard.zoo.transformers_families import llama3

from .report import table, write_csv, write_section

MIXTRAL = {"dim": 4096, "n_heads": 32, "n_kv_heads": 8, "ffn_dim": 14336, "n_experts": 8, "top_k": 2,
           "vocab_size": 32000, "n_layers": 32, "batch": 64, "seq": 4096, "group_size": 1024}
# case: (factory, mesh, axis names of the automatic plan (None: unnamed), the catalogue's axis names)
CASES = {
    "Llama-3-8B, 16 x 8192": (lambda: llama3("8b", batch=16), (8, 8), ("dp", "tp"), ("dp", "tp")),
    "Llama-3-70B, 64 x 8192": (lambda: llama3("70b", batch=64), (64, 8), ("dp", "tp"), ("dp", "tp")),
    "Mixtral-8x7B shape, 64 x 4096": (lambda: moe_llama(**MIXTRAL, device="meta"), (8, 8), ("dp", "tp"),
                                      ("dp", "tp")),
    "Llama-3-70B, 64 x 8192, unnamed": (lambda: llama3("70b", batch=64), (8, 8, 8), None, ("pp", "dp", "tp")),
}
QUICK = ["Llama-3-8B, 16 x 8192"]
HEAD = ["case", "mesh", "plan", "predicted step s", "overlapped s", "memory GiB/rank", "memory savers", "fits",
        "planning CPU s", "automatic / this"]


def _plan(model, mesh, inputs, loss_fn, **options):
    start = time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            prog = autoshard.parallelize(model, mesh, inputs, loss_fn=loss_fn, mixed_precision="bf16", **options)
        except autoshard.AutoshardError as exc:
            return None, str(exc).splitlines()[0], time.process_time() - start
    return prog, "", time.process_time() - start


def _step(prog):
    if prog.plan.pipeline:
        return prog.plan.pipeline["predicted_step_s"], prog.plan.pipeline["predicted_step_s"]
    predicted = prog.plan.predicted
    return predicted["step_time_s"], predicted.get("overlapped_step_s", predicted["step_time_s"])


def _savers(prog) -> str:
    parts = [repr(prog.zero)] if getattr(prog, "zero", None) is not None else []
    regions = getattr(prog.state, "recompute_regions", None) if hasattr(prog, "state") else None
    if regions:
        parts.append(f"{len(regions)} layers recomputed")
    if prog.plan.pipeline:
        parts.append(f"pipeline over {prog.plan.pipeline['axis']}")
    return "; ".join(parts) or "-"


def _hand_plans(model, inputs, loss_fn, mesh: autoshard.Mesh):
    request = CompileRequest(model, mesh, inputs, None, loss_fn, CompileOptions.parse(mixed_precision="bf16"))
    traced, _ = trace_for_plan(request, None, request.options)
    roles = model_roles(traced.gm)
    batch, seq, n = inputs[0].shape[0], inputs[0].shape[1], len(inputs)
    if "pp" in mesh.names:
        flat = autoshard.Mesh(mesh.shape, ("dp", "dp2", "tp"))
        builders = {"fsdp_tp_pp (1F1B)": lambda: catalogue.fsdp_tp_pp(roles, mesh, batch, n),
                    "fsdp_tp_pp (interleaved)": lambda: catalogue.fsdp_tp_pp(roles, mesh, batch, n,
                                                                              schedule="Interleaved1F1B")}
    else:
        flat, builders = mesh, {}
    builders.update({"ddp": lambda: catalogue.ddp(roles, flat, batch, n),
                     "fsdp": lambda: catalogue.fsdp(roles, flat, batch, n),
                     "dp_tp": lambda: catalogue.dp_tp(roles, flat, batch, n),
                     "fsdp_tp": lambda: catalogue.fsdp_tp(roles, flat, batch, n),
                     "tp_sp": lambda: catalogue.tp_sp(roles, flat, batch, n),
                     "tp_cp": lambda: catalogue.tp_cp(roles, autoshard.Mesh(flat.shape, ("cp",) + flat.names[1:]),
                                                      batch, seq, n),
                     "ep_dp": lambda: catalogue.ep_dp(roles, flat, batch, n)})
    out = []
    for name, build in builders.items():
        try:
            out.append((name, build(), ""))
        except catalogue.NotApplicable as exc:
            out.append((name, None, str(exc)))
    return out


def run_case(name: str):
    factory, shape, names, hand_names = CASES[name]
    model, inputs, loss_fn = factory()
    rows = []
    with reuse_exports():
        auto, error, seconds = _plan(model, shape, inputs, loss_fn, axis_names=names)
        if auto is None:
            raise RuntimeError(f"{name}: the automatic plan failed: {error}")
        step, overlapped = _step(auto)
        chosen = auto.plan.search.get("chosen_plan", "automatic")
        rows.append([name, "x".join(map(str, shape)), f"automatic (its search chose: {chosen})", step, overlapped,
                     _memory(auto), _savers(auto), _fits(auto), seconds, 1.0])
        best = float("inf")
        for plan_name, plan, why in _hand_plans(model, inputs, loss_fn, autoshard.Mesh(shape, hand_names)):
            if plan is None:
                rows.append([name, "", plan_name, "-", "-", "-", "-", f"n/a: {why}", "-", "-"])
                continue
            prog, error, seconds = _plan(model, shape, inputs, loss_fn, **plan.options)
            if prog is None:
                rows.append([name, "", plan_name, "-", "-", "-", "-", f"no: {error[:90]}", seconds, "-"])
                continue
            hand_step, hand_overlapped = _step(prog)
            fits = _fits(prog)
            if fits == "yes":
                best = min(best, hand_step)
            rows.append([name, "", plan_name, hand_step, hand_overlapped, _memory(prog), _savers(prog), fits,
                         seconds, step / hand_step])
    return rows, step / best if best < float("inf") else None


BUDGET = CompileOptions.parse(mixed_precision="bf16").memory_budget  # the default profile's, per device


def _fits(prog) -> str:
    """'yes' when the plan's predicted memory per device is within the budget; a plan returned over it (the ILP's
    memory row and predict disagreeing) is shown as such and does not count as the best catalogue plan."""
    memory = prog.plan.predicted["memory_bytes_per_rank"]
    return "yes" if memory <= BUDGET else f"NO: predicted {memory / 2**30:.1f} GiB > budget {BUDGET / 2**30:.1f} GiB"


def _memory(prog) -> float:
    """GiB per rank as the planner checked it against the budget. For a pipeline that is its micro-batch program's
    figure: every stage's parameters (an upper bound: a stage holds 1/pp of them) and one micro-batch's activations
    of the whole model (what 1F1B's first stage holds: pp micro-batches of 1/pp of the layers)."""
    return prog.plan.predicted["memory_bytes_per_rank"] / 2**30


def main(quick: bool = False) -> None:
    """Run the cases, writing the section after each (a long run leaves every finished case in RESULTS.md)."""
    torch.manual_seed(0)
    rows, ratios = [], {}
    for name in (QUICK if quick else CASES):
        case_rows, ratio = run_case(name)
        rows += case_rows
        ratios[name] = ratio
        print(f"[hand_plans] {name}: automatic / best catalogue plan = {ratio}", flush=True)
        _write(rows, ratios)


def _write(rows, ratios) -> None:
    formatted = [[f"{v:.3f}" if isinstance(v, float) else v for v in row] for row in rows]
    write_csv("hand_plans", HEAD, formatted)
    autos_fit = all(row[7] == "yes" for row in rows if str(row[2]).startswith("automatic"))
    met = autos_fit and all(r is not None and r <= 1.0 + 1e-9 for r in ratios.values())
    summary = "; ".join(f"{k}: {v:.3f}" if v is not None else f"{k}: no catalogue plan fits"
                        for k, v in ratios.items())
    body = (__doc__.split("\n", 2)[2].strip() + "\n\n" + f"automatic / best catalogue plan: {summary} — target <= 1.00 "
            + ("**met on every row**." if met else "**NOT met**.") + "\n\n" + table(HEAD, formatted))
    write_section("hand_plans", "14. The automatic plan vs the hand plans people write (one cost model)", body)
