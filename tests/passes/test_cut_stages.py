"""Tier 1: stage annotations (all notations), their errors, and the automatic cut against brute force."""
import itertools
import json

import pytest
import torch
from torch import nn

import autoshard
from autoshard.ir import meta
from autoshard.ir.errors import HintError, UserInputError
from autoshard.passes import auto_cut as cut_mod
from autoshard.passes.auto_cut import CutCosts
from autoshard.zoo import gpt2, llama
from autoshard.zoo.staged import gpt2_staged, llama_staged

DP = {"input:0": {"dp": "S(0)"}}


def _plan(model, inputs, loss_fn, pipeline=None, hints=DP, mesh=(2, 2), names=("pp", "dp"), **kw):
    return autoshard.parallelize(model, mesh, inputs, loss_fn=loss_fn, axis_names=names, hints=hints,
                                 pipeline=pipeline, **kw)


def _stages(prog):
    return {n.name: n.meta[meta.STAGE] for n in prog.state.gm.graph.nodes if n.op == "call_function"}


def test_every_notation_gives_the_same_cut():
    """balance, split points, ':stage' hints, autoshard.stage() and MindSpore's pipeline_stage agree."""
    model, inputs, loss_fn = gpt2()
    # top-level sequence: wte, wpe, drop, layers.0 | layers.1, ln_f, lm_head
    by_balance = _plan(model, inputs, loss_fn, {"balance": [4, 3]})
    by_split = _plan(model, inputs, loss_fn, {"split_points": ["layers.1"]})
    by_split_end = _plan(model, inputs, loss_fn, {"split_points": {"layers.0": "end"}})
    stage_hints = dict(DP, **{"w*:stage": 0, "drop:stage": 0, "layers.0:stage": 0, "layers.1:stage": 1,
                              "ln_f:stage": 1, "lm_head:stage": 1})
    by_hints = _plan(model, inputs, loss_fn, hints=stage_hints)
    by_attr = _plan(*gpt2_staged())
    reference = _stages(by_balance)
    assert set(reference.values()) == {0, 1}
    for other in (by_split, by_split_end, by_hints, by_attr):
        assert _stages(other) == reference
    assert by_balance.plan.pipeline["cut"] == "balance=[4, 3]"


def test_mindspore_attribute_and_module_stage_table():
    prog = _plan(*llama_staged())
    table = prog.plan.pipeline["stage_table"]
    assert table[0]["first_module"] == "tok_embeddings" and table[1]["last_module"] == "output"
    assert all(row["ops"] > 0 for row in table)


def test_tied_embedding_in_two_stages_is_listed():
    prog = _plan(*gpt2_staged())
    assert prog.tied_params == {"wte.weight": (0, 1)}
    assert prog.plan.pipeline["tied_params"] == {"wte.weight": [0, 1]}


def test_stage_graphs_carry_values_through_and_end_with_the_loss():
    prog = _plan(*gpt2(n_layers=2), mesh=(4,), names=("pp",), hints=None,
                 pipeline={"balance": [3, 1, 1, 2], "microbatches": 4})
    graphs = prog.all_stage_graphs(0)
    assert len(graphs) == 4
    assert graphs[0].inputs == ["ids"] or len(graphs[0].inputs) == 1
    # the token ids are needed by the loss in the last stage: carried through every stage
    ids = graphs[0].inputs[0]
    assert all(ids in g.inputs for g in graphs[1:])
    assert len(graphs[-1].outputs) == 2  # (loss, logits)
    assert prog.graph(rank=3)[0].index == 3


def test_split_stage_modules_compute_the_rank_program():
    """Chaining the stage modules gives exactly the unsplit rank module's loss and logits."""
    model, inputs, loss_fn = gpt2()
    prog = _plan(model, inputs, loss_fn, {"split_points": ["layers.1"]}, mesh=(2,), names=("pp",), hints=None)
    whole = prog.state.gm  # global program == rank program on a 1-device intra-op mesh
    from autoshard.lowering.rank_module import build_rank_module
    from autoshard.runtime.collectives import use_communicator
    from autoshard.runtime.thread_communicator import ThreadCommunicator, ThreadHub
    gm = build_rank_module(prog.state, 0)
    stages = prog.all_stage_graphs(0)
    mb = tuple(x[: x.shape[0] // prog.config.microbatches] for x in inputs)
    comm = ThreadCommunicator(ThreadHub(prog.inner_mesh, 5.0), 0)
    with use_communicator(comm):
        expected = gm(*mb)
        values = mb
        for s in stages:
            values = tuple(s.gm(*values))
    assert whole is not None and len(values) == len(expected)
    for a, b in zip(values, expected):
        assert torch.equal(a, b)


@pytest.mark.parametrize("pipeline, hints, message", [
    ({"balance": [3, 3]}, DP, r"balance=\[3, 3\] covers 6 layers but the model's top-level sequence has 7"),
    ({"balance": [7]}, DP, r"the annotations use pipeline stages \[0\] but the pipeline has 2 stages"),
    ({"split_points": ["layers.9"]}, DP, r"split point 'layers.9' names no module .* did you mean"),
    ({"split_points": ["layers.1", "layers.0"]}, DP, r"not in execution order"),
    ({"balance": [4, 3], "split_points": ["layers.1"]}, DP, r"more than one notation"),
    ({"schedule": "bogus"}, DP, r"unknown pipeline schedule 'bogus'"),
    ({"schedule": "gpipe", "virtual_stages": 2}, DP, r"virtual_stages=2 needs an interleaved schedule"),
    ({"schedule": "zbv", "virtual_stages": 3}, DP, r"runs exactly 2 stages per rank"),
    ({"microbatches": 3}, DP, r"batch of 8 .* does not split into 3 micro-batches"),
    ({"micro_batches": 2}, DP, r"unknown pipeline option\(s\) \['micro_batches'\]"),
    (None, dict(DP, **{"layers.0:stage": 1, "layers.1:stage": 0}), r"out of execution order: .*layers\.1"),
    (None, dict(DP, **{"layerz.*:stage": 0}), r"'layerz.\*' .* matches no module"),
])
def test_bad_pipeline_input_is_a_clear_error(pipeline, hints, message):
    model, inputs, loss_fn = gpt2()
    with pytest.raises(UserInputError, match=message):
        _plan(model, inputs, loss_fn, pipeline, hints=hints)


def test_stage_hints_without_a_pipeline_axis():
    model, inputs, loss_fn = gpt2()
    with pytest.raises(HintError, match=r"'layers.0:stage' puts modules into a pipeline stage but the mesh has no "
                                        r"pipeline axis; name a mesh axis 'pp'"):
        autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
                              hints={"layers.0:stage": 0})


def test_pipeline_options_need_a_pipeline_axis():
    model, inputs, loss_fn = gpt2()
    with pytest.raises(UserInputError, match=r"no pipeline axis: name a mesh axis 'pp'"):
        autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",), pipeline={"microbatches": 2})


class Unequal(nn.Module):
    """A big embedding, small blocks of different widths and a big head: unequal stage costs."""

    def __init__(self, vocab=512, dim=32, widths=(32, 64, 16, 96, 48)):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, w), nn.GELU(), nn.Linear(w, dim)) for w in widths)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _brute_force(costs, stages):
    allowed = [k for k in range(1, costs.n) if costs.allowed[k]]
    return min(costs.max_stage_time(cuts) for cuts in itertools.combinations(allowed, stages - 1))


def _auto(stages):
    model = Unequal()
    ids = torch.randint(0, 512, (12, 64))
    return autoshard.parallelize(model, (stages,), (ids,), axis_names=("pp",),
                                 pipeline={"microbatches": stages, "schedule": "1F1B"}, profile="cpu")


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_automatic_cut_is_optimal_over_every_position(stages):
    prog = _auto(stages)
    nodes = [n for n in prog.state.gm.graph.nodes if n.op == "call_function"]
    costs = CutCosts(prog.state, nodes, prog.config)
    cuts = [i for i in range(1, len(nodes)) if nodes[i].meta[meta.STAGE] != nodes[i - 1].meta[meta.STAGE]]
    assert len(cuts) == stages - 1
    assert costs.max_stage_time(cuts) <= _brute_force(costs, stages) * (1 + 1e-12)


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_module_boundary_cut_within_ten_percent_of_optimal(monkeypatch, stages):
    """Big graphs only cut between blocks; on this unequal model that stays within 10% of the optimum."""
    monkeypatch.setattr(cut_mod, "AUTO_CUT_ALL_POSITIONS", 0)
    prog = _auto(stages)
    nodes = [n for n in prog.state.gm.graph.nodes if n.op == "call_function"]
    monkeypatch.setattr(cut_mod, "AUTO_CUT_ALL_POSITIONS", 10**6)
    costs = CutCosts(prog.state, nodes, prog.config)
    cuts = [i for i in range(1, len(nodes)) if nodes[i].meta[meta.STAGE] != nodes[i - 1].meta[meta.STAGE]]
    optimum = _brute_force(costs, stages)
    assert costs.max_stage_time(cuts) <= 1.10 * optimum, (costs.max_stage_time(cuts), optimum)


def test_predicted_step_is_the_planned_timeline_and_follows_the_1f1b_formula():
    """One predicted step per pipeline: the planned timeline's span. With 1F1B it lies between the slowest
    stage's m micro-batches plus the sync, and the closed formula (sum + (m - 1) x slowest stage + sync)
    plus the stage-to-stage transfers."""
    prog = _auto(2)
    table = prog.plan.pipeline["stage_table"]
    m, p = prog.config.microbatches, prog.config.pp_size
    formula = sum(r["seconds"] for r in table) + (m - 1) * max(r["seconds"] for r in table) + \
        max(r["sync_s"] for r in table)
    step = prog.plan.pipeline["predicted_step_s"]
    assert step == prog.planned_timeline().span()
    link = prog.config.link
    transfer = link.alpha + max(r["send_bytes"] for r in table) / 2 / link.bandwidth
    slowest = m * max(r["seconds"] for r in table) + max(r["sync_s"] for r in table)
    assert slowest < step <= formula + 2 * (m + p - 1) * transfer * (1 + 1e-9)


def test_pipeline_plan_fingerprint_depends_on_the_schedule():
    model, inputs, loss_fn = llama()
    a = _plan(model, inputs, loss_fn, {"schedule": "gpipe", "microbatches": 2})
    b = _plan(model, inputs, loss_fn, {"schedule": "1f1b", "microbatches": 2})
    assert a.plan.fingerprint != b.plan.fingerprint
    assert meta.SPEC in next(iter(a.state.gm.graph.nodes)).meta


def test_cli_plans_a_pipeline_and_prints_the_stage_table(capsys):
    from autoshard.__main__ import main
    code = main(["plan", "autoshard.zoo:gpt2", "--mesh", "2,2", "--axis-names", "pp,dp", "--schedule", "gpipe",
                 "--microbatches", "4", "--balance", "4,3"])
    out = capsys.readouterr().out
    assert code == 0
    assert "axis pp (pipeline): 2 stages on 2 ranks (1 per rank), GPipe, 4 micro-batches, cut balance=[4, 3]" in out
    assert "stage 1 (pp rank 1)" in out and "tied parameters summed over pp: ['wte.weight']" in out


def test_a_pipelined_plans_step_is_its_schedules_not_one_micro_batchs(capsys):
    """`plan.predicted` of a pipelined plan prices its micro-batch program; `plan.step_s` (and `plan --json`'s
    "step_s") is the whole step: what a user compares plans by."""
    from autoshard.__main__ import main
    from autoshard.plan.plan import Plan
    code = main(["plan", "autoshard.zoo:gpt2", "--mesh", "2,2", "--axis-names", "pp,dp", "--schedule", "1f1b",
                 "--microbatches", "4", "--json"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    cli_extras = ("ilp", "ilp_stopped", "axis_roles", "step_s")  # what --json prints besides the plan file
    plan = Plan.from_json({k: v for k, v in printed.items() if k not in cli_extras})
    assert printed["step_s"] == plan.step_s == printed["pipeline"]["predicted_step_s"]
    assert plan.step_s > 2 * plan.predicted.step_time_s  # four micro-batches and the fill and drain


def test_planned_timeline_matches_the_bubble_formula():
    from autoshard.program.pipeline import PipelineConfig
    from autoshard.report.timeline import simulate
    for schedule, v in (("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2)):
        for p, m in ((2, 4), (4, 8)):
            config = PipelineConfig("pp", p, m, schedule, v)
            timeline = simulate(config, {s: {"F": 1.0 / v, "B": 2.0 / v} for s in range(config.num_stages)})
            assert timeline.bubble_fraction() == pytest.approx((p - 1) / (v * m + p - 1))
    config = PipelineConfig("pp", 4, 8, "ZBVZeroBubble", 2)
    zero_bubble = simulate(config, {s: {"F": 0.5, "B": 1.0} for s in range(8)}).bubble_fraction()
    assert zero_bubble < 3 / 11 / 2
    assert "bubble" in repr(simulate(PipelineConfig("pp", 2, 4, "1F1B"), {0: {"F": 1, "B": 2}, 1: {"F": 1, "B": 2}}))


def test_measured_timeline_takes_one_row_per_pp_rank():
    from autoshard.report.timeline import measured_timeline
    model, inputs, loss_fn = gpt2()
    prog = _plan(model, inputs, loss_fn, {"microbatches": 2})
    # what pipeline_rank_run returns per rank: (stage, kind, micro-batch, start, end) chunk timings
    results = {r: {"timeline": [(prog.stages_of(r)[0], "F", 0, 1.0 * r, 1.0 * r + 1.0)]} for r in range(4)}
    timeline = measured_timeline(results, prog)
    assert timeline.ranks == [0, 1] and len(timeline.events) == 2  # intra-op rank 0 of each pp coordinate
    assert timeline.source == "measured" and "pp rank 1" in repr(timeline)


def test_a_pipeline_rank_allocates_only_its_stages_weights():
    model, inputs, loss_fn = gpt2()
    prog = _plan(model, inputs, loss_fn, {"microbatches": 2, "balance": [4, 3]})
    first = prog.all_stage_graphs(0, stages={0})
    held = {name for name, p in first[0].gm.named_parameters()}
    assert all(not p.is_meta for p in first[0].gm.parameters())
    assert all(p.is_meta for name, p in first[1].gm.named_parameters() if name not in held)
    assert any(p.is_meta for p in first[1].gm.parameters())  # layers.1 and ln_f live on pp rank 1 only


def test_batchnorm_with_microbatches_warns_that_the_step_differs():
    from autoshard.zoo import resnet
    model, inputs, loss_fn = resnet()
    with pytest.warns(UserWarning, match=r"BatchNorm module\(s\) in training mode .* see one micro-batch at a time"):
        autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("pp",), pipeline={"microbatches": 2})


def test_the_cut_weighs_each_tensor_crossing_it_as_a_message():
    """torch.distributed.pipelining sends every tensor crossing a boundary as its own message: where the profile
    prices them (`pipeline_tensor_s`, calibrated on CPU ranks) the cut moves to a boundary fewer tensors cross, and
    the stage table counts them (`send_tensors`, `grad_tensors`; a llama block's boundary carries the rotary
    tables and the residual besides the hidden state)."""
    from autoshard.cost.profiles import HardwareProfile
    model, inputs, loss_fn = llama(n_layers=2)
    tables = {}
    for seconds in (0.0, 1e-3):
        prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("pp",),
                                     profile=HardwareProfile(name="messages", pipeline_tensor_s=seconds),
                                     pipeline={"schedule": "1f1b", "microbatches": 2})
        tables[seconds] = prog.plan.pipeline["stage_table"]
    free, priced = tables[0.0][0], tables[1e-3][0]
    assert priced["send_tensors"] < free["send_tensors"] and priced["grad_tensors"] <= free["grad_tensors"]
    assert tables[0.0][-1]["send_tensors"] == tables[1e-3][-1]["send_tensors"] == 0  # the last stage sends nothing


def test_the_stage_table_counts_the_tensors_each_stage_graph_sends():
    """`send_tensors` is what the runtime sends: each stage graph's outputs; GPT-2's embedding, tied to its head on
    the last stage, is held by both stages, not sent (it was counted once)."""
    model, inputs, loss_fn = gpt2()
    prog = _plan(model, inputs, loss_fn, pipeline={"microbatches": 2})
    graphs = prog.all_stage_graphs(0)
    for row, stage in zip(prog.plan.pipeline["stage_table"], graphs):
        out = next(n for n in stage.gm.graph.nodes if n.op == "output").args[0]
        sent = len(out) if isinstance(out, (tuple, list)) else 1
        if row["stage"] < len(graphs) - 1:
            assert row["send_tensors"] == sent, (row["stage"], row["send_tensors"], out)
