"""`python -m autoshard calibrate` times each mesh axis and the compute rates on spawned gloo ranks and writes a
profile that parallelize loads and prices ops with (the CLI runs end to end; its docstring example cannot start
processes)."""
import subprocess
import sys

import torch

import autoshard
from autoshard.cost.axis_cost import compute_time
from autoshard.cost.calibrate import compute_slowdown, host_cores
from autoshard.cost.collective_time import IN_FLIGHT
from autoshard.cost.flops import node_flops
from autoshard.cost.profiles import load_profile
from autoshard.zoo import mlp


def test_calibrate_writes_a_profile_parallelize_uses(tmp_path):
    out = tmp_path / "profile.json"
    run = subprocess.run([sys.executable, "-m", "autoshard", "calibrate", "--mesh", "2", "--sizes", "4096,65536",
                          "--dtypes", "float64,float32", "--output", str(out)], capture_output=True, text=True,
                         timeout=300, check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "axis a0 (size 2): all-reduces: alpha" in run.stdout and "matmul float32" in run.stdout, run.stdout
    profile = load_profile(str(out))
    (link,) = profile.axis_links
    assert link.alpha > 0 and link.bandwidth > 0
    for collective in ("all_gather", "reduce_scatter", "all_to_all"):  # each timed on its own
        figures = getattr(link, collective if collective != "all_gather" else "gather")
        assert figures is not None and link.of(collective).alpha > 0 and link.of(collective).bandwidth > 0
    assert "reduce-scatters: alpha" in run.stdout and "all-to-alls: alpha" in run.stdout
    assert link.measured_seconds(IN_FLIGHT, 0, 2) > 0 and "ms in a run of them (2 in flight)" in run.stdout
    assert 0.0 <= profile.comm_overlap <= 1.0 and "of an asynchronous collective" in run.stdout
    rates = dict(profile.dtype_flops)
    assert sorted(rates) == ["float32", "float64"] and all(r > 0 for r in rates.values()), rates
    assert profile.attention_flops > 0 and profile.memory_bandwidth > 0
    assert profile.op_overhead_s >= 0 and profile.grad_op_overhead_s >= 0 and profile.recorded_op_overhead_s >= 0
    updates = profile.optimizer_updates  # SGD's and AdamW's, timed as they run
    assert [f for f, *_ in updates] == [0.0, 2.0] and all(t >= 0 and rate > 0 for _, t, rate in updates), updates
    assert "optimizer updates" in run.stdout
    model, inputs, loss_fn = mlp(n_layers=1)
    inputs = tuple(x.double() for x in inputs)
    prog = autoshard.parallelize(model.double(), (2,), inputs, loss_fn=loss_fn, profile=str(out), pipeline=False)
    assert prog.plan.predicted["step_time_s"] > 0
    # a float64 matmul is priced at the measured float64 rate, plus linear's measured fixed costs (forward, recording, backward)
    linear = next(n for n in prog.state.gm.graph.nodes if n.target is torch.ops.aten.linear.default)
    assert linear.meta["val"].dtype == torch.float64
    assert {name: costs for name, *costs in profile.op_overheads}["aten.linear.default"]  # timed on its own
    expected = 3 * node_flops(linear) / rates["float64"] + sum(profile.fixed_costs(linear.target))
    assert abs(compute_time(linear, 1, profile) - expected) <= 1e-12 * expected


def _slowdown_task(rank, world):
    return compute_slowdown(rank, world, at_once=2, seconds=0.1)


def test_ranks_outnumbering_the_cores_measure_how_much_slower_they_compute_together(pool):
    """calibrate times the compute rates with as many CPU ranks at once as the host has cores, then scales them by
    the slowdown of all ranks computing together (8 ranks here: 4 per core of this 2-core machine, or more)."""
    slowdowns = pool.run(_slowdown_task)
    assert len(slowdowns) == 8 and max(slowdowns.values()) >= min(8, 4 * host_cores()) / 4, slowdowns
