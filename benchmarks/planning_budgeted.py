"""Benchmark 20, planning a small model under a binding memory budget: the zoo GPT-2 and Llama on (2, 2) and (2, 4)
under the Megatron plan's predicted memory (the budget memory_accuracy's automatic rows plan under), planned as
`parallelize` does by default and again with the sharding ILP's search run at every size under the same default time
limits (autoshard/solver/time_limit.py MIP_SEARCH_MAX_COLUMNS raised past every ILP), side by side in one run:
planning seconds, the plan's predicted step, and the solves whose search was not run or was stopped.

Target (issue 31, planning time): a budget-bound joint ILP too large to search in its time limit costs its
relaxation, not its limit, and the plan is no worse than the searched one.
"""
from __future__ import annotations

import math
import time
import warnings
from unittest import mock

import autoshard
import autoshard.solver.ilp
from autoshard.zoo.hints import plan_hints

from .plan_quality import FACTORIES, SHAPES
from .report import table, write_csv, write_section

MESHES = ((2, 2), (2, 4))


def plan_once(model_name: str, mesh: tuple, budget: float, search_any_size: bool) -> dict:
    """One `parallelize` under `budget` (bytes per rank), every search run when `search_any_size`: seconds, predicted
    step, the kept plan's largest ILP and the solves not searched or stopped."""
    model, inputs, loss_fn = FACTORIES[model_name](**SHAPES[model_name])
    largest = math.inf if search_any_size else autoshard.solver.ilp.MIP_SEARCH_MAX_COLUMNS
    started = time.perf_counter()
    with warnings.catch_warnings(), mock.patch.object(autoshard.solver.ilp, "MIP_SEARCH_MAX_COLUMNS", largest):
        warnings.simplefilter("ignore")  # the stopped solves are counted below
        prog = autoshard.parallelize(model, mesh, inputs, loss_fn=loss_fn, axis_names=("dp", "tp"),
                                     memory_budget=budget)
    seconds = time.perf_counter() - started
    stopped = prog.state.ilp_stopped
    return {"seconds": seconds, "step_ms": prog.plan.predicted.step_time_s * 1e3,
            "variables": max((s["variables"] for s in prog.state.ilp_stats), default=0),
            "not_searched": sum(r.stopped == "size" for r in stopped),
            "stopped": sum(r.stopped != "size" for r in stopped)}


def main(quick: bool = False) -> None:
    rows = []
    for model_name in ("gpt2",) if quick else ("gpt2", "llama"):
        for mesh in MESHES[:1] if quick else MESHES:
            model, inputs, loss_fn = FACTORIES[model_name](**SHAPES[model_name])
            megatron = autoshard.parallelize(model, mesh, inputs, loss_fn=loss_fn, axis_names=("dp", "tp"),
                                             hints=plan_hints(model_name, ("dp", "tp"), ("dp",), "tp"))
            budget = megatron.plan.predicted["memory_bytes_per_rank"]
            default = plan_once(model_name, mesh, budget, False)
            searched = plan_once(model_name, mesh, budget, True)
            rows.append([model_name, "x".join(map(str, mesh)), f"{budget / 2**20:.1f}",
                         f"{megatron.plan.predicted.step_time_s * 1e3:.3f}", default["variables"],
                         f"{default['seconds']:.1f}", f"{default['step_ms']:.3f}", default["not_searched"],
                         default["stopped"], f"{searched['seconds']:.1f}", f"{searched['step_ms']:.3f}",
                         searched["stopped"], f"{default['seconds'] / searched['seconds']:.2f}",
                         f"{default['step_ms'] / searched['step_ms']:.3f}"])
    headers = ["model", "mesh", "budget MiB", "Megatron step ms", "largest ILP variables", "default: plan s",
               "default: step ms", "default: solves not searched", "default: solves stopped", "searched: plan s", "searched: step ms", "searched: solves stopped", "plan s default / searched",
               "step default / searched"]
    slower = [r for r in rows if float(r[-1]) > 1.0 + 1e-9]
    body = ("Each case plans twice in this process, back to back: as `parallelize` does by default, then with every "
            "search run under the same default time limits. The budget: the Megatron "
            "plan's predicted memory per rank, planned first; 'largest ILP' is the kept plan's. "
            f"**Default plans slower than the searched ones: {len(slower)} of {len(rows)}.**\n\n"
            + table(headers, rows)
            + "\n\nReproduce: `python -m benchmarks --only planning_budgeted`.\n")
    write_section("planning_budgeted", "20. Planning a small model under a binding memory budget: the search not run "
                  "past its size vs run", body)
    write_csv("planning_budgeted", headers, rows)
    print(table(headers, rows))
