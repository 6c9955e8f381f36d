"""The accuracy report's predicted phases (autoshard/report/accuracy.py) put each cost where the runtime spends it:
ZeRO-3's deferred gradient reduce-scatters in the gradient sync (`sync_grads` runs them, one after another), not
in backward, and a pipeline's optimizer update as its fullest pp rank's, not the whole model's."""
import dataclasses
import warnings

import pytest

import autoshard
from autoshard.cost.collective_time import IN_FLIGHT
from autoshard.cost.pipeline_schedule import rank_nodes, stage_nodes
from autoshard.cost.prediction import node_cost
from autoshard.cost.profiles import CPU_PROFILE, Link
from autoshard.cost.zero_cost import optimizer_step_time, reduce_scatter_groups
from autoshard.ir import meta
from autoshard.ir.meta import COMM_COST
from autoshard.report.accuracy import predicted_phases
from autoshard.zoo import mlp


def _plan(**options):
    model, inputs, loss_fn = mlp(n_layers=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, **options)


def test_zero3_reduce_scatters_deferred_to_the_sync_are_predicted_there():
    prog = _plan(axis_names=("dp",), hints={"input:0": {"dp": "S(0)"}}, zero=3)
    gathers = [n for n in prog.state.gm.graph.nodes if n.meta.get(meta.COMM, {}).get("op") == "param_all_gather"]
    deferred = {g for group in reduce_scatter_groups(prog.state.gm.graph, prog.mesh) for g, _ in group}
    assert gathers and deferred == set(gathers)  # the MLP's parameters are used by their gathers alone
    in_sync = sum(g.meta[COMM_COST].sync_s for g in gathers)
    regathers = sum(g.meta[COMM_COST].seconds - node_cost(g).forward_seconds() for g in gathers) - in_sync
    assert in_sync > 0 and regathers > 0
    phases = predicted_phases(prog)
    assert phases["sync_s"] >= in_sync * (1 - 1e-9)
    compute_backward = sum(node_cost(n).seconds - node_cost(n).forward_seconds() for n in prog.state.gm.graph.nodes
                           if n.op == "call_function" and n.meta.get(meta.KIND) != "comm")
    assert phases["backward_s"] == pytest.approx(compute_backward + regathers, rel=1e-9)
    assert phases["step_s"] == pytest.approx(prog.plan.predicted["step_time_s"] + phases["optimizer_s"], rel=1e-12)


def test_a_pipelines_optimizer_phase_is_its_fullest_ranks_update():
    prog = _plan(axis_names=("pp",), pipeline={"schedule": "1f1b", "microbatches": 4})
    state = prog.state
    per_rank = [optimizer_step_time(state, nodes)
                for nodes in rank_nodes(prog.config, stage_nodes(state, prog.config.num_stages))]
    assert len(per_rank) == 2 and all(t > 0 for t in per_rank)
    assert predicted_phases(prog)["optimizer_s"] == max(per_rank) < optimizer_step_time(state)


def test_deferred_reduce_scatters_after_the_first_pay_the_latency_calibrate_timed_in_a_run_of_them():
    """`sync_grads` starts ZeRO-3's deferred per-layer reduce-scatters one right after another, two in flight; where
    calibrate timed such a run (`IN_FLIGHT`), each group after the first pays that latency, not the one after compute."""
    after_compute, in_a_run = 1e-3, 4e-4
    reduce_scatters = ("reduce_scatter", ((4096, after_compute), (65536, after_compute + 1e-4)))
    run = (IN_FLIGHT, ((4096, in_a_run),))
    plain, timed = (dataclasses.replace(CPU_PROFILE, axis_links=(Link(1e-4, 1e9, measured=(2, tables)),))
                    for tables in ((reduce_scatters,), (reduce_scatters, run)))
    options = {"axis_names": ("dp",), "hints": {"input:0": {"dp": "S(0)"}}, "zero": 3}
    plans = [_plan(profile=profile, **options) for profile in (plain, timed)]
    groups = reduce_scatter_groups(plans[0].state.gm.graph, plans[0].mesh)
    assert len(groups) == 4 and all(even for group in groups for _, even in group)  # a layer's weight and bias each
    saved = plans[0].plan.predicted["step_time_s"] - plans[1].plan.predicted["step_time_s"]
    assert saved == pytest.approx((len(groups) - 1) * (after_compute - in_a_run), rel=1e-6)
    phases = [predicted_phases(prog) for prog in plans]
    assert phases[0]["sync_s"] - phases[1]["sync_s"] == pytest.approx(saved, rel=1e-6)
    assert phases[0]["backward_s"] == pytest.approx(phases[1]["backward_s"], rel=1e-9)


def test_the_optimizer_phase_is_priced_at_the_update_rate_calibrate_timed():
    """An update moves (3 + 2 f) x its parameters' bytes and pays a cost per tensor, as calibrate timed torch's SGD (f 0)
    and AdamW (f 2); a profile without those timings prices it from its memory bandwidth."""
    timed = dataclasses.replace(CPU_PROFILE, optimizer_updates=((0.0, 1e-6, 1e10), (2.0, 5e-6, 4e9)))
    prog = _plan(axis_names=("dp",), hints={"input:0": {"dp": "S(0)"}}, profile=timed, optimizer_state_factor=0.0)
    params = [p for p in prog.state.gm.graph.nodes if p.op == "placeholder" and p.meta.get(meta.KIND) == "param"]
    nbytes = sum(p.meta["val"].numel() * p.meta["val"].element_size() for p in params)
    assert predicted_phases(prog)["optimizer_s"] == pytest.approx(3 * nbytes / 1e10 + len(params) * 1e-6, rel=1e-9)
    adam = _plan(axis_names=("dp",), hints={"input:0": {"dp": "S(0)"}}, profile=timed)  # optimizer state factor 2
    assert predicted_phases(adam)["optimizer_s"] == pytest.approx(7 * nbytes / 4e9 + len(params) * 5e-6, rel=1e-9)
    plain = _plan(axis_names=("dp",), hints={"input:0": {"dp": "S(0)"}}, optimizer_state_factor=0.0)
    profile = plain.state.options.profile
    assert predicted_phases(plain)["optimizer_s"] == pytest.approx(
        3 * nbytes / profile.memory_bandwidth + len(params) * profile.op_overhead_s, rel=1e-9)
