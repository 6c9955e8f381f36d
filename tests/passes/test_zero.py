"""ZeRO planning: the request (zero= and the hint file), the zero pass's placements, insert_comm's
per-use param_all_gather, errors, the solver choosing ZeRO under a memory budget, plan save/load."""
import pytest
import torch

import autoshard
from autoshard.frontend.hints import Hints
from autoshard.ir.errors import HintError
from autoshard.runtime.simulator import run_ranks
from autoshard.runtime.zero import ZeroOptimizer
from autoshard.zoo import gpt2
from autoshard.zoo.hints import plan_hints

DP = plan_hints("gpt2", ("dp",), ("dp",))


@pytest.fixture(scope="module")
def case():
    return gpt2()


def _plan(case, mesh=(4,), names=("dp",), hints=DP, **kwargs):
    model, inputs, loss_fn = case
    return autoshard.parallelize(model, mesh=mesh, axis_names=names, example_inputs=inputs, loss_fn=loss_fn,
                                 hints=hints, **kwargs)


def _gathers(prog):
    return [n for n in prog.state.gm.graph.nodes if n.meta.get("autoshard.comm", {}).get("op") == "param_all_gather"]


def test_hint_file_zero_parses_and_round_trips():
    hints = Hints.parse({"zero": {"dp": 2}, "input:0": {"dp": "S(0)"}})
    assert hints.zero == {"dp": 2} and len(hints.entries) == 1
    assert hints.to_json() == {"input:0": {"dp": "S(0)"}, "zero": {"dp": 2}}
    assert not Hints.parse({"zero": {"dp": 3}})  # ZeRO alone leaves the plan automatic


@pytest.mark.parametrize("value,message", [
    (3, "must map one data-parallel mesh axis name to a ZeRO stage"),
    ({"dp": 4}, "ZeRO stage 4 for axis 'dp' is not 1, 2 or 3"),
    ({"dp": True}, "is not 1, 2 or 3"),
    ({"dp": 1, "sp": 2}, "must map one"),
])
def test_bad_zero_hints_are_hint_errors(value, message):
    with pytest.raises(HintError, match=message):
        Hints.parse({"zero": value})


@pytest.mark.parametrize("zero,message", [
    (4, "is not 1, 2 or 3"), ("3", "must be a ZeRO stage"), ({"tp": 3}, "names mesh axis 'tp'"),
])
def test_bad_zero_arguments_say_what_to_write(case, zero, message):
    with pytest.raises(HintError, match=message):
        _plan(case, zero=zero)


def test_zero_needs_the_batch_split_on_its_axis(case):
    with pytest.raises(HintError, match="no input is split on any mesh axis; name the axis"):
        _plan(case, mesh=(2,), names=("tp",), hints={"layers.*.mlp.fc1.weight": {"tp": "S(0)"}}, zero=3)
    with pytest.raises(HintError, match="disagrees with the hints"):
        _plan(case, hints={**DP, "zero": {"dp": 2}}, zero=3)


def test_stages_1_and_2_keep_placements_stage_3_shards_every_parameter(case):
    plain, one, three = _plan(case), _plan(case, zero=1), _plan(case, zero={"dp": 3})
    assert (one.zero.axis, one.zero.stage) == ("dp", 1) and one.plan.hints["zero"] == {"dp": 1}
    assert [r.spec for r in one.plan.rows] == [r.spec for r in plain.plan.rows]
    params = [r for r in three.plan.rows if r.kind == "param"]
    assert params and all(r.spec == "[S(0)]" for r in params)
    assert not three.grad_reduce  # every gradient is reduce-scattered where its parameter is gathered


def test_stage_3_gathers_each_use_and_fuses_the_gradient_reduce_scatter(case):
    prog = _plan(case, zero=3)
    gathers = _gathers(prog)
    wte = [g for g in gathers if g.args[0].meta["autoshard.path"] == "wte.weight"]
    assert len(wte) == 2  # tied: the embedding and lm_head gather it separately, right before each use
    for g in gathers:
        (user,) = g.users
        between = g.next
        while between is not user:  # gathered right before its one consumer (after its other gathers)
            assert between in gathers, (g, between)
            between = between.next
    reduce = {g.args[0].meta["autoshard.path"]: g.args[3] for g in gathers}
    assert reduce["layers.0.mlp.fc1.weight"] and not reduce["wpe.weight"]  # wpe's gradient is already whole
    assert not any(n.meta.get("autoshard.comm", {}).get("op") == "grad_all_reduce" and n.args[0] in gathers
                   for n in prog.state.gm.graph.nodes)


def test_stage_3_with_megatron_shards_a_dim_tp_leaves_free(case):
    hints = plan_hints("gpt2", ("dp", "tp"), ("dp",), "tp")
    prog = _plan(case, mesh=(2, 2), names=("dp", "tp"), hints=hints, zero=3)
    spec = {r.path: r.spec for r in prog.plan.rows if r.kind == "param"}
    assert spec["layers.0.mlp.fc1.weight"] == "[S(1), S(0)]"  # column parallel on tp, ZeRO on the other dim
    assert spec["layers.0.mlp.fc2.weight"] == "[S(0), S(1)]"
    assert spec["layers.0.mlp.fc1.bias"] == "[R, S(0)]"  # no dim left: the optimizer shards it flat
    assert prog.plan.grad_reduce["layers.0.mlp.fc1.bias"] == ("dp",)


def test_solver_applies_the_zero_stage_that_fits_the_budget(case):
    plain = _plan(case).plan.predicted["memory_bytes_per_rank"]
    fitted = {}
    for stage in (1, 2, 3):
        fitted[stage] = _plan(case, zero=stage).plan.predicted["memory_bytes_per_rank"]
    assert plain > fitted[1] > fitted[2] > fitted[3]
    for stage in (1, 2, 3):
        budget = (fitted[stage] + (fitted[stage - 1] if stage > 1 else plain)) / 2
        prog = _plan(case, memory_budget=budget)
        assert (prog.zero.stage, prog.zero.reason) == (stage, "memory budget")
        assert prog.plan.hints["zero"] == {"dp": stage} and "memory budget" in repr(prog.zero)
    with pytest.raises(autoshard.ir.errors.PlanError, match="no plan fits the memory budget"):
        _plan(case, memory_budget=fitted[3] / 10)


def test_zero_3_plan_saves_and_applies_unchanged(case, tmp_path):
    prog = _plan(case, zero=3)
    prog.plan.save(tmp_path / "plan.json")
    again = _plan(case, hints=None, plan=tmp_path / "plan.json")
    assert again.plan.dumps() == prog.plan.dumps() and again.zero.stage == 3


def test_zero_2_refuses_to_train_without_the_sharded_optimizer(case):
    prog = _plan(case, zero=2)
    _model, inputs, _ = case

    def step(module):
        loss, _ = module(*module.local_inputs(*inputs))
        loss.backward()
        module.sync_grads()

    with pytest.raises(RuntimeError, match="shards gradients .*ZeroOptimizer"):
        run_ranks(prog, step)


def test_zero_optimizer_refuses_non_elementwise_optimizers(case):
    prog = _plan(case, zero=1)
    with pytest.raises(RuntimeError, match="LBFGS is not elementwise"):
        run_ranks(prog, lambda m: ZeroOptimizer(m, torch.optim.LBFGS(m.parameters())))
    plain = _plan(case)
    with pytest.raises(RuntimeError, match="needs a program planned with ZeRO"):
        run_ranks(plain, lambda m: ZeroOptimizer(m, torch.optim.SGD(m.parameters(), lr=0.1)))


def test_param_groups_keep_their_options_on_the_shards(case):
    prog = _plan(case, zero=2)

    def build(module):
        params = dict(module.named_local_parameters())
        decay = [p for k, p in params.items() if k.endswith("weight")]
        rest = [p for k, p in params.items() if not k.endswith("weight")]
        opt = ZeroOptimizer(module, torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                                       {"params": rest, "weight_decay": 0.0}], lr=1e-3))
        return [(g["weight_decay"], g["lr"], [t.numel() for t in g["params"]]) for g in opt.param_groups], \
            [p.numel() for p in decay]

    groups, decay_sizes = run_ranks(prog, build)[1]
    assert [g[:2] for g in groups] == [(0.1, 1e-3), (0.0, 1e-3)]
    assert groups[0][2] == [-(-n // 4) for n in decay_sizes]  # one padded quarter of each parameter


def test_predicted_reduce_scatters_are_the_collectives_the_runtime_starts(case, monkeypatch):
    """The cost model charges ZeRO-3's gradient reduce-scatters one collective's latencies per group the runtime
    starts (cost/zero_cost.reduce_scatter_shares: a layer's gradients together); counted on simulated ranks."""
    from autoshard.cost.zero_cost import reduce_scatter_groups, reduce_scatter_shares
    from autoshard.runtime import zero_overlap

    prog = _plan(case, mesh=(2,), zero=3)
    shares = reduce_scatter_shares(prog.state.gm.graph, prog.mesh)
    started = []
    original = zero_overlap.start_reduce_scatters
    monkeypatch.setattr(zero_overlap, "start_reduce_scatters",
                        lambda comm, grads: started.append(len(grads)) or original(comm, grads))
    _, inputs, _ = case

    def step(module):
        module.overlap = False
        ZeroOptimizer(module, torch.optim.SGD(module.parameters(), lr=0.1))
        module(*module.local_inputs(*inputs))[0].backward()
        module.sync_grads()

    run_ranks(prog, step)
    coalesced = len(started) // 2  # both ranks' calls
    assert shares and coalesced == round(sum(shares.values())), (coalesced, shares)  # the tied embedding: twice
    # each group's shares sum to one collective's latencies
    assert all(0 < share <= 1 for share in shares.values())
    assert all(abs(sum(shares[g] for g, even in group if even) - 1) < 1e-9
               for group in reduce_scatter_groups(prog.state.gm.graph, prog.mesh) if any(even for _, even in group))


def test_gathers_soon_after_a_collective_are_priced_at_the_back_to_back_latency(case):
    """A profile that timed all-gathers after 10 ms of compute (0.9 ms each) and back to back (0.5 ms): a gather
    `after` seconds of compute since the rank's last collective saves 0.4 ms x (1 - after / 10 ms), in forward and
    for its re-gather in backward (one that no collective came before saves nothing); without the back-to-back table or the
    gap, nothing changes."""
    from autoshard.cost.axis_cost import needs_grad
    from autoshard.cost.profiles import HardwareProfile, Link
    from autoshard.cost.zero_cost import gather_gaps, regathered

    def profile(timed, gap):
        link = Link(1e-4, 1e9, gather=(4e-4, 1e9), measured=(4, timed))
        return HardwareProfile(axis_links=(link,), collective_gap_s=gap)

    after_compute = (("all_gather", ((4096, 9e-4), (1 << 20, 2e-3))),)
    back_to_back = (*after_compute, ("all_gather_back_to_back", ((4096, 5e-4),)))
    plain = _plan(case, zero=3, profile=profile(after_compute, 1e-2))
    soon = _plan(case, zero=3, profile=profile(back_to_back, 1e-2))
    assert _plan(case, zero=3, profile=profile(back_to_back, 0.0)).plan.predicted.comm_s == pytest.approx(
        plain.plan.predicted.comm_s, rel=1e-12)
    graph = soon.state.gm.graph
    gaps, grads = gather_gaps(graph), needs_grad(graph)
    priced = [(after, True) for after, _ in map(gaps.get, _gathers(soon))] + [
        (after, grads.get(g, False) and regathered(g)) for g, (_, after) in zip(_gathers(soon), map(gaps.get,
                                                                                              _gathers(soon)))]
    expected = sum(4e-4 * max(0.0, 1.0 - after / 1e-2) for after, paid in priced if paid and after is not None)
    assert priced[0][0] is None and expected > 0.0  # the step's first gather follows no collective
    assert plain.plan.predicted.comm_s - soon.plan.predicted.comm_s == pytest.approx(expected, rel=1e-6)
    # the overlap model and recomputation read each collective's forward part as predict priced it: never negative
    from autoshard.cost.overlap import step_works
    from autoshard.cost.prediction import node_cost
    assert all(0.0 < node_cost(g).forward_s <= node_cost(g).seconds for g in _gathers(soon))
    assert all(work.seconds >= 0.0 for work in step_works(soon.state))
