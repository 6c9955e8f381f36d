"""Training as people train (issue 15 items 2-5): clipping by the global gradient norm, gradient accumulation
over several passes with one gradient sync, dropout (p=0.1) with rng="exact", and the step's global loss --
each equal to the single device in float64 (verify's 1e-6): losses, outputs, gradients (after clipping) and
parameters after 2 SGD steps. The simulator is bitwise equal to gloo (test_sim_equals_real.py); one dropout
case and clipping in a pipeline whose tied weight lives on two pipeline ranks (the one case the simulator
cannot show) run on gloo, as do a pipeline's global loss and its ranks loading only their rows.
"""
import os

import pytest
import torch

import autoshard
from autoshard.ir.errors import UserInputError
from autoshard.runtime.simulator import run_ranks
from autoshard.verify.training import VerifyOptions
from autoshard.verify.verify import Training, build_case, reference_run, verify_factory
from autoshard.zoo.hints import plan_hints
from autoshard.zoo.transformers_hints import DATA_PARALLEL, HINTS

DP_TP = ((2, 2), ("dp", "tp"))
GPT2_DP_TP = plan_hints("gpt2", ("dp", "tp"), ("dp",), "tp")
LLAMA_DP_TP = plan_hints("llama", ("dp", "tp"), ("dp",), "tp")
CASES = {  # factory (the zoo's at dropout 0.1), mesh, names, hints, parallelize options
    "zoo-gpt2-dp2xtp2": ("autoshard.zoo:gpt2_dropout", *DP_TP, GPT2_DP_TP, {}),
    "zoo-llama-dp2xtp2": ("autoshard.zoo:llama_dropout", *DP_TP, LLAMA_DP_TP, {}),
    "transformers-gpt2-dp2xtp2": ("autoshard.zoo.transformers_families:gpt2_dropout", *DP_TP, HINTS["gpt2"], {}),
    "transformers-llama-dp2xtp2": ("autoshard.zoo.transformers_families:llama", *DP_TP, HINTS["llama"], {}),
    "zoo-llama-zero3-dp4": ("autoshard.zoo:llama_dropout", (4,), ("dp",), plan_hints("llama", ("dp",), ("dp",)),
                            {"zero": 3}),
    "zoo-gpt2-zero3-dp4": ("autoshard.zoo:gpt2_dropout", (4,), ("dp",), plan_hints("gpt2", ("dp",), ("dp",)),
                           {"zero": 3}),
    # (the family's batch of 4 is one row per rank: one pass per step)
    "transformers-gpt2-zero3-dp4": ("autoshard.zoo.transformers_families:gpt2_dropout", (4,), ("dp",), DATA_PARALLEL,
                                    {"zero": 3, "accumulate": 1}),
    "zoo-gpt2-zero2-dp2xtp2": ("autoshard.zoo:gpt2_dropout", *DP_TP, GPT2_DP_TP, {"zero": 2}),
}

FULL = os.environ.get("AUTOSHARD_FULL_MATRIX") == "1"


def _clip_below_the_norm(factory) -> float:
    """A max_norm a tenth of the first step's gradient norm on one device: clipping is active."""
    model, inputs, loss_fn = build_case(factory)
    grads = reference_run(model, Training(accumulate=2).passes(inputs)[0], loss_fn, VerifyOptions(steps=1, lr=0.1))["grads"]
    return float(torch.nn.utils.get_total_norm(list(grads.values()))) / 10


@pytest.mark.parametrize("case", list(CASES))
def test_clipping_and_accumulation_equal_the_single_device(case):
    factory, mesh, names, hints, options = CASES[case]
    clip = _clip_below_the_norm(factory)
    options = {"accumulate": 2, **options}
    report, program = verify_factory(factory, mesh, names, hints=hints, simulate=True, clip_grad_norm=clip, **options)
    assert report.ok, f"{case}:\n{report}"
    assert report.training == Training(accumulate=options["accumulate"], clip_grad_norm=clip, rng="exact")
    assert len(program.random_ops) >= (6 if "dropout" in factory else 0)
    assert "clipped to norm" in str(report)
    assert not program.random_ops or f"{len(program.random_ops)} random ops drawn rng=exact" in str(report)
    assert options["accumulate"] == 1 or "2 passes per step" in str(report)


@pytest.mark.parametrize("norm_type", [1.0, float("inf")])
def test_other_norms(norm_type):
    model, inputs, loss_fn = build_case("autoshard.zoo:gpt2")
    prog = autoshard.parallelize(model, DP_TP[0], inputs, loss_fn=loss_fn, axis_names=DP_TP[1],
                                 hints=CASES["zoo-gpt2-dp2xtp2"][3])

    def norm(module):
        module(*module.local_inputs(*inputs))[0].backward()
        module.sync_grads()
        return module.clip_grad_norm_(1e-3, norm_type)

    norms = run_ranks(prog, norm)
    model.zero_grad()
    loss_fn(model(*inputs), *inputs).backward()
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3, norm_type)
    assert all(torch.allclose(n, expected, rtol=1e-9, atol=0) for n in norms.values()), (norms, expected)


def test_accumulation_syncs_gradients_once_per_step():
    factory, mesh, names, hints, _ = CASES["zoo-gpt2-dp2xtp2"]
    once, _ = verify_factory(factory, mesh, names, hints=hints, simulate=True, steps=1)
    twice, _ = verify_factory(factory, mesh, names, hints=hints, simulate=True, steps=1, accumulate=2)
    assert once.ok and twice.ok
    sync = {axis: sum(c["sync"] for c in kinds.values()) for axis, kinds in once.collectives.items()}
    assert sync["dp"] >= 1
    assert sync == {axis: sum(c["sync"] for c in kinds.values()) for axis, kinds in twice.collectives.items()}
    def fwd(report):
        return sum(c["fwd"] for kinds in report.collectives.values() for c in kinds.values())
    assert fwd(twice) == 2 * fwd(once)  # the passes' own collectives run per pass


def test_global_loss_is_the_single_device_loss_on_every_rank():
    _, mesh, names, hints, _ = CASES["zoo-gpt2-dp2xtp2"]
    model, inputs, loss_fn = build_case("autoshard.zoo:gpt2")
    prog = autoshard.parallelize(model, mesh, inputs, loss_fn=loss_fn, axis_names=names, hints=hints)
    assert prog.output_specs[0].partial_axes()  # each rank's loss is a partial sum
    losses = run_ranks(prog, lambda module: module.global_loss(module(*module.local_inputs(*inputs))[0]))
    expected = loss_fn(model(*inputs), *inputs)
    assert all(torch.allclose(v, expected, rtol=1e-12, atol=0) for v in losses.values())


PIPELINE = {"pipeline": {"microbatches": 2}}


@pytest.mark.parametrize("factory,hints,accumulate", [
    ("autoshard.zoo:llama_dropout", LLAMA_DP_TP, 2), ("autoshard.zoo:gpt2_dropout", GPT2_DP_TP, 2),
    ("autoshard.zoo.transformers_families:gpt2_dropout", HINTS["gpt2"], 1),  # batch 4: one row per rank and pass
], ids=["zoo-llama", "zoo-gpt2", "transformers-gpt2"])
def test_pipelines_accumulate_clip_and_drop_out_like_the_single_device(factory, hints, accumulate):
    """pp x dp x tp: each micro-batch's masks are its rows of the whole batch's (rng="exact"); two passes
    of the whole schedule per step, one gradient sync."""
    report, program = verify_factory(factory, (2, 2, 2), ("pp", "dp", "tp"), hints=hints, simulate=True,
                                     clip_grad_norm=_clip_below_the_norm(factory), accumulate=accumulate, **PIPELINE)
    assert report.ok, str(report)
    assert program.random_ops and report.training.rng == "exact" and report.training.accumulate == accumulate


@pytest.mark.skipif(not FULL, reason="AUTOSHARD_FULL_MATRIX=1 runs it (suite time; the simulated pipelines above "
                                      "accumulate, and test_sim_equals_real.py counts collectives as gloo does)")
def test_gloo_pipeline_accumulates_with_one_sync_per_step(pool_runner):
    """torch.distributed.pipelining's schedules on real ranks: two passes per step, gradients synced as
    often as in one pass (the simulator counts collectives as gloo does: test_sim_equals_real.py)."""
    factory = "autoshard.zoo:llama_dropout"
    once, _ = verify_factory(factory, (2, 2, 2), ("pp", "dp", "tp"), hints=LLAMA_DP_TP, simulate=True, steps=1,
                             **PIPELINE)
    twice, _ = verify_factory(factory, (2, 2, 2), ("pp", "dp", "tp"), hints=LLAMA_DP_TP, runner=pool_runner, steps=1,
                              accumulate=2, **PIPELINE)
    assert once.ok and twice.ok, (once, twice)
    syncs = [sum(c["sync"] for c in report.collectives["dp"].values()) for report in (once, twice)]
    assert syncs[0] == syncs[1] >= 1


def test_gloo_dropout_clipping_and_accumulation_equal_the_single_device(pool_runner):
    """The transformers GPT-2 at its dropout 0.1 on real gloo ranks, dp x tp with Megatron hints."""
    factory = "autoshard.zoo.transformers_families:gpt2_dropout"
    report, _ = verify_factory(factory, *DP_TP, hints=HINTS["gpt2"], runner=pool_runner, accumulate=2,
                               clip_grad_norm=_clip_below_the_norm(factory))
    assert report.ok, str(report)


def test_gloo_pipeline_with_a_tied_weight_clips_like_the_single_device(pool_runner):
    """A transformers Llama whose embedding and head are tied across the two pipeline ranks: the head's
    gradient is held by both after their sum, and counted once in the norm. Mesh (2, 2) pp x tp: four ranks.
    1F1B: a V-shaped schedule (zero bubble) would put the first and last stage on one rank."""
    factory = "test_train_then_save:tied_llama"
    megatron = {k: v for k, v in HINTS["llama"].items() if "dp" not in v}
    report, program = verify_factory(factory, (2, 2), ("pp", "tp"), hints=megatron, runner=pool_runner,
                                     clip_grad_norm=_clip_below_the_norm(factory),
                                     pipeline={"microbatches": 2, "schedule": "1F1B"})
    assert report.ok, str(report)
    assert len({program.config.stage_rank(s) for s in program.tied_params["model.embed_tokens.weight"]}) == 2


def test_clipping_before_the_gradient_sync_is_an_error():
    model, inputs, loss_fn = build_case("autoshard.zoo:mlp")
    prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
                                 hints={"input:0": {"dp": "S(0)"}})

    def clip_unsynced(module):
        module(*module.local_inputs(*inputs))[0].backward()
        with pytest.raises(UserInputError, match=r"before module.sync_grads\(\)"):
            module.clip_grad_norm_(1.0)
        module.sync_grads()
        return module.clip_grad_norm_(1.0)

    assert all(torch.isfinite(n) for n in run_ranks(prog, clip_unsynced).values())


def test_bad_training_options_are_errors():
    with pytest.raises(UserInputError, match="does not split into 3 equal slices"):
        verify_factory("autoshard.zoo:mlp", (2,), ("dp",), simulate=True, accumulate=3)
    with pytest.raises(UserInputError, match="accumulate=0"):
        Training(accumulate=0)
    with pytest.raises(UserInputError, match="clip_grad_norm=-1"):
        Training(clip_grad_norm=-1.0)



def _pipeline_rows_task(rank, world):
    """A pp x dp rank of the zoo MLP: one step from only its rows of the batch, one from the whole batch;
    the global loss and the gradients of both."""
    from autoshard.ir.mesh import Mesh
    from autoshard.runtime.launch import communicator_for
    mesh = Mesh((2, 2), ("pp", "dp"))
    comm = communicator_for(mesh, strict_world=False)
    if comm is None:
        return None
    model, inputs, loss_fn = build_case("autoshard.zoo:mlp")
    prog = autoshard.parallelize(model, mesh, inputs, loss_fn=loss_fn, hints={"input:0": {"dp": "S(0)"}}, **PIPELINE)
    module = prog.module(rank, comm)
    rows = prog.local_batch(rank, inputs[0].shape[0])
    results = []
    for local_rows in (True, False):
        module.zero_grad()
        batch = tuple(torch.cat([x[s] for s in rows]) for x in inputs) if local_rows else inputs
        loss, _ = module.train_step(*batch, local_rows=local_rows)
        results.append((module.global_loss(loss), {k: p.grad.clone() for k, p in module.named_local_parameters()}))
    return results


def test_gloo_pipeline_ranks_load_their_rows_and_share_the_global_loss(pool):
    """Every rank -- the first stage's too, which holds no loss -- gets the single device's loss; loading only
    the rank's rows (prog.local_batch) trains exactly as handing it the whole batch."""
    model, inputs, loss_fn = build_case("autoshard.zoo:mlp")
    expected = loss_fn(model(*inputs), *inputs)
    results = {r: v for r, v in pool.run(_pipeline_rows_task).items() if v is not None}
    assert len(results) == 4
    for (rows_loss, rows_grads), (whole_loss, whole_grads) in results.values():
        assert torch.allclose(rows_loss, expected, rtol=1e-12, atol=0) and torch.equal(rows_loss, whole_loss)
        assert rows_grads.keys() == whole_grads.keys() and rows_grads
        assert all(torch.equal(rows_grads[k], whole_grads[k]) for k in rows_grads)


def test_pipeline_local_batch_is_each_micro_batch_s_block():
    model, inputs, loss_fn = build_case("autoshard.zoo:mlp")
    prog = autoshard.parallelize(model, (2, 2), inputs, loss_fn=loss_fn, axis_names=("pp", "dp"),
                                 hints={"input:0": {"dp": "S(0)"}}, **PIPELINE)
    n = inputs[0].shape[0]
    rows = {r: prog.local_batch(r, n) for r in range(4)}
    assert rows[0] == rows[2] and rows[1] == rows[3]  # the pp coordinate does not change the rows
    covered = sorted(i for r in (0, 1) for s in rows[r] for i in range(n)[s])
    assert covered == list(range(n))
    with pytest.raises(UserInputError, match="does not split into the plan's 2 micro-batches"):
        prog.local_batch(0, n + 1)
