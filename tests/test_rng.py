"""Random ops on ranks (autoshard/runtime/rng.py): masks follow placements by default, rng="exact" gives each
rank its block of the single device's masks, recomputation replays them, bad inputs get clear errors.
(verify with dropout on gloo and on pipelines: tests/multirank/test_training_features.py.)"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoshard
from autoshard.ir.errors import UserInputError
from autoshard.runtime.simulator import run_ranks
from autoshard.verify.verify import verify_simulated
from autoshard.zoo import transformers_families as families
from autoshard.zoo.transformers_hints import DATA_PARALLEL, HINTS


class Dropped(nn.Module):
    """A linear layer, dropout on an activation pinned to S(0) on dp and R on tp, and dropout again
    on one pinned to S(1) on tp."""

    def forward(self, x):
        replicated, sharded = {"dp": "S(0)", "tp": "R"}, {"dp": "S(0)", "tp": "S(1)"}
        a = autoshard.constrain(F.dropout(autoshard.constrain(x, replicated), 0.5, True), replicated)
        b = autoshard.constrain(F.dropout(autoshard.constrain(x * 1.0, sharded), 0.5, True), sharded)
        return a, b


def _masks(prog, x, steps=1):
    """Each rank's local outputs (x is ones: an output is its mask scaled by 2) after `steps` forwards."""
    def run(module):
        for _ in range(steps):
            _, outs = module(*module.local_inputs(x))
        return [o.clone() for o in outs]
    return run_ranks(prog, run)


def test_placement_masks_equal_on_copies_and_independent_on_shards():
    x = torch.ones(8, 64)
    prog = autoshard.parallelize(Dropped(), (2, 2), (x,), axis_names=("dp", "tp"), loss_fn=lambda out, x: out[0].sum())
    assert [str(op.spec) for op in prog.random_ops] == ["[S(0), R]", "[S(0), S(1)]"]
    masks = _masks(prog, x)  # ranks (dp, tp): 0 = (0, 0), 1 = (0, 1), 2 = (1, 0), 3 = (1, 1)
    replicated, sharded = 0, 1
    assert torch.equal(masks[0][replicated], masks[1][replicated])  # copies on tp: the same mask
    assert torch.equal(masks[2][replicated], masks[3][replicated])
    assert not torch.equal(masks[0][replicated], masks[2][replicated])  # shards on dp: independent masks
    assert not torch.equal(masks[0][sharded], masks[1][sharded])  # shards on tp too
    for rank in range(4):
        kept = (masks[rank][replicated] != 0).float().mean().item()
        assert 0.3 < kept < 0.7 and set(masks[rank][replicated].unique().tolist()) <= {0.0, 2.0}
    # One seed, one stream: a new module draws the same masks; the next step and another seed others.
    again = _masks(prog, x)
    assert all(torch.equal(masks[r][i], again[r][i]) for r in range(4) for i in range(2))
    assert not torch.equal(_masks(prog, x, steps=2)[0][0], masks[0][0])
    reseeded = autoshard.parallelize(Dropped(), (2, 2), (x,), axis_names=("dp", "tp"),
                                     loss_fn=lambda out, x: out[0].sum(), seed=7)
    assert not torch.equal(_masks(reseeded, x)[0][0], masks[0][0])
    autoshard.manual_seed(7)  # the default seed of programs planned without seed=
    try:
        assert torch.equal(_masks(prog, x)[0][0], _masks(reseeded, x)[0][0])
    finally:
        autoshard.manual_seed(0)


def test_exact_masks_are_blocks_of_the_single_device_masks():
    x = torch.ones(8, 64)
    prog = autoshard.parallelize(Dropped(), (2, 2), (x,), axis_names=("dp", "tp"), loss_fn=lambda out, x: out[0].sum(),
                                 rng="exact", seed=3)
    masks = _masks(prog, x)
    torch.manual_seed(3)
    expected = Dropped()(x)
    for rank in range(4):
        dp, tp = divmod(rank, 2)
        assert torch.equal(masks[rank][0], expected[0][4 * dp:4 * dp + 4])
        assert torch.equal(masks[rank][1], expected[1][4 * dp:4 * dp + 4, 32 * tp:32 * tp + 32])


@pytest.mark.parametrize("mesh,names,hints", [
    ((2, 2), ("dp", "tp"), HINTS["gpt2"]),
    ((4,), ("dp",), DATA_PARALLEL),
], ids=["dp2xtp2-megatron", "dp4"])
def test_transformers_gpt2_with_its_dropout_verifies_exactly(mesh, names, hints):
    """GPT-2 at its default dropout 0.1 (embeddings, residuals, and the attention weights' dropout inside
    scaled_dot_product_attention), float64: equal to the single device with rng="exact"; in the
    default mode the masks are drawn per shard, so the comparison fails (by design)."""
    model, inputs, loss_fn = families.gpt2_dropout()
    report, program = verify_simulated(model, inputs, loss_fn, mesh=mesh, axis_names=names, hints=hints)
    assert report.ok, str(report)
    assert report.training.rng == "exact" and len(program.random_ops) == 7
    if len(mesh) == 2:  # (one mesh is enough to see it)
        drawn_differently, _ = verify_simulated(model, inputs, loss_fn, mesh=mesh, axis_names=names, hints=hints,
                                                rng="placement")
        assert not drawn_differently.ok


def test_recomputed_regions_replay_their_masks():
    """Activation checkpointing re-runs each layer in backward: its dropout masks are the forward's
    (exact: the gradients equal the single device's), in both modes (placement: equal to the same
    program without recomputation)."""
    from autoshard.zoo import gpt2_dropout
    from autoshard.zoo.hints import plan_hints
    model, inputs, loss_fn = gpt2_dropout()
    hints = plan_hints("gpt2", ("dp", "tp"), ("dp",), "tp")
    report, _ = verify_simulated(model, inputs, loss_fn, mesh=(2, 2), axis_names=("dp", "tp"), hints=hints,
                                 checkpoint=["layers.*"])
    assert report.ok, str(report)

    def grads(checkpoint):
        prog = autoshard.parallelize(model, (2, 2), inputs, loss_fn=loss_fn, axis_names=("dp", "tp"), hints=hints,
                                     checkpoint=checkpoint)

        def step(module):
            module(*module.local_inputs(*inputs))[0].backward()
            return {k: p.grad.clone() for k, p in module.named_local_parameters()}
        return run_ranks(prog, step)
    plain, recomputed = grads(None), grads(["layers.*"])
    assert all(torch.equal(plain[r][k], recomputed[r][k]) for r in plain for k in plain[r])


class NoisyRouter(nn.Module):
    """A router that adds exponential noise drawn in place (PhiMoE's sparse mixer): the exported graph holds the
    functional sampler aten.exponential."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(4, 8)

    def forward(self, x):
        scores = self.gate(x)
        noise = torch.empty_like(scores).exponential_().log()
        return (scores.softmax(-1) * (scores - noise).softmax(-1)).sum()


@pytest.mark.parametrize("names", [("dp",), ("tp",)])
def test_exact_rng_reproduces_in_place_samplers(names):
    """rng="exact" draws an in-place sampler's whole tensor as the single device does, so the step verifies."""
    x = torch.randn(8, 4)
    hints = {"input:0": {"dp": "S(0)"}} if names == ("dp",) else {"gate.weight": {"tp": "S(0)"}}
    report, program = verify_simulated(NoisyRouter(), (x,), lambda out, *_: out, mesh=(2,), axis_names=names,
                                       hints=hints)
    assert report.ok, str(report)
    assert [op.target for op in program.random_ops] == [torch.ops.aten.exponential.default]


class InPlaceDropout(nn.Module):
    """nn.Dropout(inplace=True) between two layers (MobileNet's classifier): the exported graph holds dropout_."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.drop = nn.Linear(4, 16), nn.Linear(16, 1), nn.Dropout(0.5, inplace=True)

    def forward(self, x):  # on a view (MobileNet's flattened pooling), export keeps the in-place op
        return self.b(self.drop(self.a(x).view(-1, 4, 4).flatten(1))).square().mean()


@pytest.mark.parametrize("names", [("dp",), ("tp",)])
def test_exact_rng_reproduces_in_place_dropout(names):
    """Its mask is the single device's (the same kernel's draw, written into its input), so the step verifies."""
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    hints = {"input:0": {"dp": "S(0)"}} if names == ("dp",) else {"a.weight": {"tp": "S(0)"}}
    report, program = verify_simulated(InPlaceDropout(), (x,), mesh=(2,), axis_names=names, hints=hints)
    assert report.ok, str(report)
    assert [op.target for op in program.random_ops] == [torch.ops.aten.dropout_.default]


def test_bad_random_number_options_are_named():
    x = torch.ones(8, 64)
    with pytest.raises(UserInputError, match=r"rng='bogus' is not a random-number mode"):
        autoshard.parallelize(Dropped(), (2, 1), (x,), axis_names=("dp", "tp"), rng="bogus")
    with pytest.raises(UserInputError, match=r"seed='1': give an int"):
        autoshard.parallelize(Dropped(), (2, 1), (x,), axis_names=("dp", "tp"), seed="1")
    with pytest.raises(UserInputError, match=r"autoshard.manual_seed takes an int"):
        autoshard.manual_seed(1.5)

    class Sampled(nn.Module):
        def forward(self, p):
            return torch.bernoulli(p)
    with pytest.raises(UserInputError, match=r"rng='exact' cannot honour aten.bernoulli.default .*probabilities"):
        autoshard.parallelize(Sampled(), (2,), (torch.rand(8, 4),), axis_names=("dp",), rng="exact")
    autoshard.parallelize(Sampled(), (2,), (torch.rand(8, 4),), axis_names=("dp",))  # placement mode draws it


def test_a_rank_graph_called_by_itself_names_the_random_op():
    x = torch.ones(8, 64)
    prog = autoshard.parallelize(Dropped(), (1, 1), (x,), axis_names=("dp", "tp"), loss_fn=lambda out, x: out[0].sum())
    from autoshard.runtime.collectives import use_communicator
    from autoshard.runtime.thread_communicator import ThreadCommunicator, ThreadHub
    comm = ThreadCommunicator(ThreadHub(prog.mesh, 5.0), 0)
    with use_communicator(comm), pytest.raises(RuntimeError, match=r"drew random op 0 \(aten.dropout.default\) "
                                                                   "outside its rank"):
        prog.graph(0)(x)  # collectives could run, draws cannot


class NoisyTwoStages(nn.Module):
    """Dropout on activations (batched) and one noise vector drawn per forward (not batched)."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)

    def forward(self, x):
        h = F.dropout(self.first(x), 0.2, True) + 0.1 * torch.rand(8, dtype=x.dtype)
        return self.second(h)


def test_pipeline_micro_batches_take_rows_of_batched_draws_and_share_the_others():
    torch.manual_seed(0)
    x = torch.randn(8, 8)
    report, program = verify_simulated(NoisyTwoStages(), (x,), mesh=(2,), axis_names=("pp",),
                                       pipeline={"split_points": ["second"], "microbatches": 2})
    assert report.ok, str(report)
    assert [op.batched for op in program.random_ops] == [True, False]


class SequenceFirstDropout(nn.Module):
    """Dropout on a (sequence, batch, hidden) activation, as Megatron's layouts keep it."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)

    def forward(self, x):
        h = F.dropout(self.first(x).transpose(0, 1), 0.2, True).transpose(0, 1)
        return self.second(h)


def test_exact_pipelines_refuse_sequence_first_draws():
    """Micro-batch m takes block m of dim 0 of the whole batch's mask; a draw whose dim 0 is the sequence
    would get another micro-batch's mask: an error, not a silent mismatch. Placement mode is free of it."""
    x = torch.randn(8, 6, 8)
    options = {"axis_names": ("pp",), "pipeline": {"split_points": ["second"], "microbatches": 2}}
    with pytest.raises(UserInputError, match=r"rng='exact' in a pipeline cannot honour aten.dropout.default .* "
                                             r"dim 0 is not a multiple of the micro-batch's 4 rows"):
        autoshard.parallelize(SequenceFirstDropout(), (2,), (x,), rng="exact", **options)
    assert autoshard.parallelize(SequenceFirstDropout(), (2,), (x,), rng="placement", **options).random_ops
