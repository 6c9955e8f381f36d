"""Planning never runs unbounded (issue 34, item 1): every ILP solve has a time limit; a search it stops returns
the best plan found with its optimality gap, which the plan's summary says; a solve that found no plan by then
says so, naming the limit; problems met again in one planning call are not solved again; and the memory ladder
does not solve rungs a refused rung already rules out.

The case from the issue: a WavLM in float64 (as verify plans it) under a budget of 0.6 x its plan's memory, whose
ILPs HiGHS takes 15-25 s each to solve to optimality (minutes for larger configurations), is planned here with a
limit of 3 s per solve.
"""
import os
import random
import time
import warnings

import pytest

import autoshard
from autoshard.cost.collective_time import INF
from autoshard.frontend.request import CompileOptions, CompileRequest
from autoshard.ir.errors import PlanError
from autoshard.ir.mesh import Mesh
from autoshard.passes.memory_fit import Rung, fit_memory
from autoshard.passes.pass_lists import compile_state, state_before
from autoshard.program.program import Program
from autoshard.solver.errors import IlpTimeLimitError, MemoryBudgetError
from autoshard.solver.ilp import solve_ilp
from autoshard.solver.problem import IlpProblem
from autoshard.solver.session import highs_options, solver_session
from autoshard.verify.verify import build_case
from autoshard.zoo import mlp
from autoshard.zoo.transformers_families import WAVLM_BUDGET


def _problem(classes: int = 400, seed: int = 0) -> IlpProblem:
    """A chain of 4-candidate classes with extra edges and a memory row 15% above its smallest footprint: HiGHS
    needs a few tenths of a second and several improving plans to solve it."""
    rng = random.Random(seed)
    sizes = [4] * classes
    costs = [[rng.uniform(0, 10) for _ in range(4)] for _ in range(classes)]
    memory = [[rng.uniform(1, 10) for _ in range(4)] for _ in range(classes)]
    edges = {(i, i + 1): [[0.0 if a == b else rng.uniform(0, 5) for b in range(4)] for a in range(4)]
             for i in range(classes - 1)}
    edges.update({(i, (7 * i + 3) % classes): [[rng.uniform(0, 5) for _ in range(4)] for _ in range(4)]
                  for i in range(0, classes, 3) if (7 * i + 3) % classes > i + 1})
    return IlpProblem(sizes, costs, edges, memory, budget=1.15 * sum(min(m) for m in memory))


def test_a_stopped_search_returns_its_best_plan_and_gap():
    problem = _problem()
    exact = solve_ilp(problem)
    assert exact.stopped == "" and exact.gap == 0.0
    with highs_options(mip_max_improving_sols=1):  # stops at its first plan, as a time limit would
        first = solve_ilp(problem)
    assert first.stopped == "search" and first.gap > 0
    assert problem.evaluate_memory(first.choice) <= problem.budget  # a plan that fits, worse than the optimum
    assert first.objective >= exact.objective


def test_a_solve_that_finds_no_plan_in_time_names_the_limit():
    with pytest.raises(IlpTimeLimitError, match=r"found no plan within its time limit of 0\.001 s \(searched "):
        solve_ilp(_problem(), {"time_limit": 0.001})


def test_a_start_plan_is_the_searchs_first_incumbent():
    """A plan found another way (the joint ILP's: the axes solved one after another) is handed to HiGHS whole: a
    search its time limit stops at once still returns a plan, no worse than the start; with time, the optimum."""
    problem = _problem()
    smallest = [min(range(4), key=lambda s: per[s]) for per in problem.memory]  # fits: the budget is above it
    called = []

    def start():
        called.append(1)
        return smallest
    stopped = solve_ilp(problem, {"time_limit": 0.001}, start=start)
    assert stopped.stopped == "search" and stopped.choice == smallest and called
    assert problem.evaluate_memory(stopped.choice) <= problem.budget
    assert solve_ilp(problem, start=start).objective == pytest.approx(solve_ilp(problem).objective)
    unbounded = IlpProblem([2, 2], [[1.0, 2.0], [2.0, 1.0]])  # its relaxation is a plan: no search, start not called
    called.clear()
    assert solve_ilp(unbounded, start=start).choice == [0, 1] and not called


def test_a_budget_bound_mip_over_the_size_limit_is_not_searched(monkeypatch):
    """Over MIP_SEARCH_MAX_COLUMNS (lowered here to this problem's size) a fractional relaxation's MIP is not searched
    under the default time limit: the start plan is the answer, said as stopped "size" with the relaxation's gap;
    a time limit the call gives searches it (the zoo Llama on (2, 2) under the Megatron plan's memory: its 80k-column
    joint ILP spent its 17.6 s limit and returned the plan it started from)."""
    import autoshard.solver.ilp as ilp_module
    problem = _problem()
    smallest = [min(range(4), key=lambda s: per[s]) for per in problem.memory]
    monkeypatch.setattr(ilp_module, "MIP_SEARCH_MAX_COLUMNS", 100)
    kept = solve_ilp(problem, start=lambda: smallest)
    searched = solve_ilp(problem, {"time_limit": 60.0}, start=lambda: smallest)
    assert kept.stopped == "size" and kept.objective <= problem.evaluate(smallest) and 0 < kept.gap < 1
    assert searched.stopped == "" and searched.objective < kept.objective
    with solver_session(time_limit=60.0):  # parallelize(ilp_time_limit=...) opens this session
        assert solve_ilp(problem, start=lambda: smallest).stopped == ""
    from autoshard.solver.time_limit import describe_stopped
    assert "did not search 1 solve" in describe_stopped([kept])


def test_a_joint_ilp_stopped_early_keeps_the_axis_by_axis_plan(monkeypatch):
    """A joint ILP (every axis at once) whose search stops at once, as a time limit far too short for it would (the
    axis-by-axis solves it starts from keep their own limit), keeps the plan of the axes solved one after another
    (before: an 80k-column budget-bound Llama ILP on (2, 4) found no plan in 17 s, or one 12x slower)."""
    import autoshard.passes.solve as solve_module
    model, inputs, loss_fn = mlp(n_layers=4)
    mesh = Mesh.of((2, 2), ("dp", "tp"))
    options = CompileOptions.parse(memory_budget=0.6 * compile_state(
        CompileRequest(model, mesh, inputs, loss_fn=loss_fn))[0].predicted.memory_bytes_per_rank)
    real = solve_module.solve_ilp
    starts = []

    def joint_stopped_at_once(problem, options=None, start=None):
        if start is None:  # an axis-by-axis solve
            return real(problem, options)
        starts.append(start)
        return real(problem, {"time_limit": 1e-3}, start=start)
    monkeypatch.setattr(solve_module, "solve_ilp", joint_stopped_at_once)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = compile_state(CompileRequest(model, mesh, inputs, loss_fn=loss_fn, options=options))[0]
    assert starts and [stat["axes"] for stat in state.ilp_stats] == [["dp", "tp"]]
    assert state.ilp_stopped and state.predicted.memory_bytes_per_rank <= options.budget_bytes
    monkeypatch.setattr(solve_module, "JOINT_MAX_VARIABLES", 0)  # the axes one after another
    by_axis = compile_state(CompileRequest(model, mesh, inputs, loss_fn=loss_fn, options=options))[0]
    assert len(by_axis.ilp_stats) == 2 and state.objective_s <= by_axis.objective_s * (1 + 1e-9)


def test_a_session_solves_a_problem_once_and_remembers_a_refusal():
    problem, tight = _problem(classes=60), _problem(classes=60)
    tight.budget = 0.9 * sum(min(m) for m in tight.memory)
    with solver_session() as session:
        assert solve_ilp(problem).choice == solve_ilp(problem).choice
        for _ in range(2):
            with pytest.raises(MemoryBudgetError):
                solve_ilp(tight)
    assert len(session.solved) == 2


def _rung_of(state) -> Rung:
    savers = state.memory_savers
    return Rung(savers.zero.stage if savers.zero is not None else None, savers.recompute)


@pytest.mark.parametrize("fitting, chosen, solved", [
    # Only the most saving rung fits: ZeRO-1 refused, so ZeRO-3 is tried next (refused: ZeRO-2 is not solved);
    # recomputation refused, so ZeRO-2 + recomputation next (refused: ZeRO-1 + recomputation is not solved).
    ({Rung(3, True)}, Rung(3, True),
     [Rung(3, True), Rung(1, False), Rung(3, False), Rung(None, True), Rung(2, True), Rung(3, True)]),
    # ZeRO-2 and up fit: ZeRO-1 refused, ZeRO-3 fits, so ZeRO-2 is tried and kept.
    ({Rung(z, r) for z in (2, 3) for r in (False, True)}, Rung(2, False),
     [Rung(3, True), Rung(1, False), Rung(3, False), Rung(2, False)]),
    # ZeRO-1 fits: the first rung, as before.
    ({Rung(z, r) for z in (1, 2, 3) for r in (False, True)}, Rung(1, False), [Rung(3, True), Rung(1, False)]),
])
def test_the_ladder_skips_the_rungs_a_refused_one_rules_out(fitting, chosen, solved):
    model, inputs, loss_fn = mlp(n_layers=2)
    state = state_before("solve", model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
                         hints={"input:0": {"dp": "S(0)"}}, memory_budget=1e6)
    calls = []

    def solve_once(state):
        calls.append(_rung_of(state))
        if calls[-1] not in fitting:
            raise MemoryBudgetError(IlpProblem([1], [[0.0]], memory=[[2.0]], budget=1.0))

    assert fit_memory(state, solve_once, MemoryBudgetError(IlpProblem([1], [[0.0]], memory=[[2.0]], budget=1.0))) \
        == chosen
    assert calls == solved


@pytest.mark.skipif(os.environ.get("AUTOSHARD_FULL_MATRIX") != "1",
                    reason="20 s; the LP floor and the time limit's behaviour are tested on small problems above; "
                           "AUTOSHARD_FULL_MATRIX=1 runs it")
def test_wavlm_under_a_tight_budget_plans_within_the_time_limit():
    model, inputs, loss_fn = build_case("autoshard.zoo.transformers_families:wavlm")  # float64, as verify plans
    options = CompileOptions.parse(memory_budget=WAVLM_BUDGET, ilp_time_limit=3.0)
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ops without a sharding rule (group norm, weight norm)
        try:
            state, history = compile_state(CompileRequest(model, Mesh.of((2, 2), ("dp", "tp")), inputs, None,
                                                          loss_fn, options))
        except IlpTimeLimitError as refused:  # a machine too slow to find any plan in 3 s: named, not endless
            assert "time limit of 3 s" in str(refused)
            return
    assert time.perf_counter() - started < 45  # was: not done after 250 s (the default limit: about 20 s per solve)
    plan = Program(state, history).plan
    assert plan.predicted["memory_bytes_per_rank"] <= WAVLM_BUDGET
    if state.ilp_stopped:  # on this machine: always (3 s is far from the 15 s an exact solve takes)
        assert all(r.time_limit == 3.0 and r.stopped for r in state.ilp_stopped)
        assert "  solver: the sharding ILP stopped early in" in plan.summary()


def test_ilp_time_limit_is_checked_where_it_enters():
    model, inputs, loss_fn = mlp(n_layers=2)
    with pytest.raises(autoshard.UserInputError, match=r"ilp_time_limit=-1: give the seconds"):
        autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, ilp_time_limit=-1)


def test_a_budget_below_the_memory_floor_is_refused_without_the_mip(monkeypatch):
    """A budget no plan can meet because of the copies conversions keep (which the per-class minimum does not see)
    is refused by one LP, before the MIP: a 2-layer Llama under 0.2 of its memory took 15 s in the MIP's proof."""
    from autoshard.solver import ilp

    problem = IlpProblem(sizes=[2, 2], costs=[[0.0, 1.0]] * 2, edges={(0, 1): [[0.0, 1.0], [1.0, 0.0]]},
                         memory=[[4.0, 2.0], [4.0, 2.0]], edge_memory={(0, 1): [[0.0, 0.0], [9.0, 9.0]]}, budget=5.0)
    assert sum(min(per) for per in problem.memory) <= problem.budget  # the quick check cannot tell

    def no_mip(*args, **kwargs):
        raise AssertionError("the MIP ran")

    monkeypatch.setattr(ilp, "run_highs", no_mip)
    with pytest.raises(MemoryBudgetError):
        solve_ilp(problem)
    problem.budget = 6.0  # (0, 1): 4 + 2, no copy: fits; its LP relaxation is that plan, so no MIP runs either
    assert solve_ilp(problem).choice == [0, 1]


def test_a_problem_without_a_budget_and_no_consistent_choice_is_a_plan_error():
    # Every pair forbidden: without a memory row, infeasibility is not about memory.
    problem = IlpProblem(sizes=[2, 2], costs=[[1.0, 1.0], [1.0, 1.0]], edges={(0, 1): [[INF, INF], [INF, INF]]})
    with pytest.raises(PlanError, match="no consistent choice"):
        solve_ilp(problem)
