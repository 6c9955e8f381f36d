"""Pipelines compose with ZeRO-1, 2 and 3: pp x dp x tp on (2,2,2) (torchtitan's FSDP x TP x PP layout) trains
exactly like one device in the simulator (float64, bit-identical to gloo; tests/multirank/test_pipeline_zero_gloo.py
runs the schedules on real ranks). ZeRO shards over each stage's dp group; the plan's predicted memory and
synchronisation, per stage too, follow the stage's ZeRO."""
import pytest
import torch

import autoshard
from autoshard.cost.pipeline_schedule import rank_memory
from autoshard.ir import meta
from autoshard.program.pipeline_program import InnerRanks
from autoshard.runtime.collectives import use_communicator
from autoshard.runtime.pipeline import simulated_rank_step
from autoshard.runtime.simulator import run_ranks
from autoshard.runtime.zero import ZeroOptimizer
from autoshard.verify.verify import verify_simulated
from autoshard.zoo import FACTORIES
from autoshard.zoo.hints import plan_hints

NAMES = ("pp", "dp", "tp")
# (model, ZeRO stage, optimizer, micro-batches, accumulated passes): each stage once, both models, SGD and Adam
CASES = [("gpt2", 1, "adam", 2, 1), ("llama", 2, "sgd", 2, 2), ("llama", 3, "adam", 4, 1), ("gpt2", 3, "sgd", 2, 1)]


def _plan(model, stage, microbatches=2, **options):
    module, inputs, loss_fn = FACTORIES[model]()
    return autoshard.parallelize(module, (2, 2, 2), inputs, loss_fn=loss_fn, axis_names=NAMES,
                                 hints=plan_hints(model, ("dp", "tp"), ("dp",), "tp"), zero=stage,
                                 pipeline={"microbatches": microbatches, "schedule": "1F1B"}, **options), inputs


@pytest.mark.parametrize("model,stage,optimizer,microbatches,accumulate", CASES,
                         ids=[f"{c[0]}-zero{c[1]}-{c[2]}-mb{c[3]}" + ("-accumulate2" if c[4] > 1 else "") for c in CASES])
def test_pipeline_with_zero_equals_single_device(model, stage, optimizer, microbatches, accumulate):
    report, program = verify_simulated(*FACTORIES[model](), mesh=(2, 2, 2), axis_names=NAMES, optimizer=optimizer,
                                       hints=plan_hints(model, ("dp", "tp"), ("dp",), "tp"), zero=stage,
                                       accumulate=accumulate, pipeline={"microbatches": microbatches})
    assert report.ok, f"{model} ZeRO-{stage}:\n{report}"
    # The schedule is searched (zero bubble wins on these small models): ZeRO holds under its stage layout too.
    config = program.config
    assert (program.zero.axis, program.zero.stage) == ("dp", stage) and config.num_stages == 2 * config.virtual
    dp = report.collectives["dp"]
    if stage < 3:  # each stage's updated chunks all-gathered after the step
        assert dp["all_gather"]["sync"] >= 1 and dp["all_gather"]["fwd"] == 0
    if stage == 2:  # the accumulated gradients reduce-scattered once per step (one bucket), not all-reduced
        assert dp["reduce_scatter"]["sync"] == 1 and dp["all_reduce"]["sync"] == 0
    if stage == 3:  # gathered before each use in every micro-batch, re-gathered in backward, reduce-scattered
        assert dp["all_gather"]["fwd"] >= microbatches and dp["reduce_scatter"]["bwd"] >= microbatches


def test_each_stage_shards_only_its_own_parameters_over_its_dp_group():
    prog, inputs = _plan("gpt2", 2)

    def step(module):
        opt = ZeroOptimizer(module, torch.optim.SGD(module.parameters(), lr=0.1))
        simulated_rank_step(module, inputs)
        return opt.k, opt.rank, {e.fqn: e.grad_shard.numel() for e in opt.entries if e.grad_shard is not None}

    results = run_ranks(InnerRanks(prog), step)
    sharded = results[0][2]
    assert {r: results[r][:2] for r in results} == {0: (2, 0), 1: (2, 0), 2: (2, 1), 3: (2, 1)}  # (dp, tp) ranks
    norm = prog.traced.params["ln_f.weight"]
    assert sharded["ln_f.weight"] == norm.numel() // 2  # half of a replicated weight's gradient per dp rank


def test_zero3_gathers_sit_in_the_stage_that_uses_them():
    """A gathered parameter never crosses a stage boundary: it would travel between stages in full, and
    a zero-bubble schedule, which computes weight gradients from the stage's own graph, would miss it."""
    prog, _ = _plan("gpt2", 3)
    gathers = [n for n in prog.state.gm.graph.nodes if n.meta.get(meta.COMM, {}).get("op") == "param_all_gather"]
    assert gathers
    for gather in gathers:
        assert {u.meta[meta.STAGE] for u in gather.users} == {gather.meta[meta.STAGE]}, gather.name


def test_predicted_memory_and_sync_follow_the_stages_zero():
    plans = {stage: _plan("gpt2", stage)[0] for stage in (None, 1, 2, 3)}
    memory = {s: p.plan.predicted["memory"] for s, p in plans.items()}
    assert memory[1]["optimizer"] < memory[None]["optimizer"] and memory[1]["grads"] == memory[None]["grads"]
    assert memory[2]["grads"] < memory[1]["grads"] and memory[3]["params"] < memory[2]["params"]
    for stage, prog in plans.items():  # the stage table's parameter bytes add up to the pp ranks' figures
        ranks = rank_memory(prog.state, prog.config)
        held = sum(parts[k] for parts in ranks for k in ("params", "grads", "optimizer"))
        assert memory[stage] == max(ranks, key=lambda parts: sum(parts.values()))  # the plan's: one device's
        assert len(prog.tied_params) > 0  # the tied embedding: held by both of its stages' pp ranks
        assert sum(row["param_bytes"] for row in prog.state.pipeline_stages) == pytest.approx(held), stage
    stage_bytes = {s: [row["param_bytes"] for row in p.state.pipeline_stages] for s, p in plans.items()}
    assert all(a > b for a, b in zip(stage_bytes[None], stage_bytes[2]))
    # ZeRO-1 adds the chunks' all-gather after the step to each stage's sync, and so to the predicted step
    sync = {s: sum(row["sync_s"] for row in p.state.pipeline_stages) for s, p in plans.items()}
    assert sync[1] > sync[None]
    assert plans[1].plan.pipeline["predicted_step_s"] > plans[None].plan.pipeline["predicted_step_s"]


def test_zero3_stages_keep_no_gathered_parameter_from_forward_to_backward():
    prog, inputs = _plan("gpt2", 3)

    def forward_then_backward(module):
        loss = module.run_microbatch(module.local_microbatches(*inputs)[0])[0]
        alive = module.gathered_memory.live  # saved for backward as shards: the gathered copies are gone
        with use_communicator(module.comm):
            loss.backward()  # re-gathers each saved parameter once
        return alive, module.gathered_memory.peak

    alive, peak = run_ranks(InnerRanks(prog), forward_then_backward)[0]
    assert alive == 0 < peak


def test_zero2_stages_without_the_sharded_optimizer_say_how_to_train():
    prog, inputs = _plan("gpt2", 2)
    with pytest.raises(RuntimeError, match=r"UserInputError: this program shards gradients \(ZeRO-2 on 'dp'\): wrap the "
                                           r"optimizer .*ZeroOptimizer.* then module.train_step\(\*batch\), opt.step"):
        run_ranks(InnerRanks(prog), lambda module: simulated_rank_step(module, inputs))
