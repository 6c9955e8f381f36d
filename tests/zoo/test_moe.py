"""The mixture-of-experts LLaMA (autoshard/zoo/moe.py): its routing against a per-token loop, dropped and
uneven routing, routing per group (so micro-batches route as the whole batch), and the strategies that
make expert parallelism a placement (no op without a rule; the expert einsums shard the expert dim)."""
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import autoshard
from autoshard.ir.placement import P, R, Shard
from autoshard.strategies import AxisStrategy, candidates_for
from autoshard.strategies.base import output_shapes, tensor_inputs
from autoshard.zoo.moe import (
    MoE,
    MoEConfig,
    moe_llama,
    moe_llama_dropped,
    moe_llama_uneven,
)


def loop_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer token by token: choice j of every token queues after all choices < j of its group, in token
    order; a choice finding its expert's C slots taken is dropped."""
    B, T, D = x.shape
    S = moe.group_size
    C = moe.capacity(S)
    tokens = x.reshape(-1, S, D)
    out = torch.zeros_like(tokens)
    for g, group in enumerate(tokens):
        logits = group @ moe.router.weight.T
        if moe.skew is not None:
            logits = logits + moe.router_bias
        gate, choice = logits.softmax(-1).topk(moe.top_k, dim=-1)
        gate = gate / gate.sum(-1, keepdim=True)
        taken = [0] * moe.n_experts
        for j in range(moe.top_k):
            for s in range(S):
                e = int(choice[s, j])
                if taken[e] == C:
                    continue
                taken[e] += 1
                hidden = F.silu(group[s] @ moe.w1[e]) * (group[s] @ moe.w3[e])
                out[g, s] += gate[s, j] * (hidden @ moe.w2[e])
    return out.reshape(B, T, D)


@pytest.mark.parametrize("factory", [moe_llama, moe_llama_dropped, moe_llama_uneven])
def test_the_einsum_routing_equals_a_loop_over_tokens(factory):
    moe = factory()[0].layers[0].moe.double()
    x = torch.randn(4, 16, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(moe(x)[0], loop_moe(moe, x), rtol=1e-12, atol=1e-12)


def test_a_small_capacity_drops_choices_and_a_dropped_token_passes_unchanged():
    moe = MoE(MoEConfig(capacity_factor=0.25))  # C = 2 of 16 tokens x 2 choices per expert
    x = torch.randn(1, 16, 32)
    dispatch, combine, _ = moe.route(x.reshape(1, 16, 32))
    per_expert = dispatch.sum((0, 1, 3))
    assert moe.capacity(16) == 2 and per_expert.tolist() == [2.0] * 4  # every slot of every expert taken
    assert dispatch.sum((2, 3)).max() <= 2 and (dispatch.sum((2, 3)) == 0).any()  # some tokens got no expert
    lost = dispatch.sum((2, 3))[0] == 0
    y, _ = moe(x)
    assert torch.equal(y[0][lost], torch.zeros_like(y[0][lost]))  # the residual alone carries those tokens
    assert torch.allclose(combine.sum((2, 3))[0][dispatch.sum((2, 3))[0] == 2], torch.ones(1))


def test_a_skewed_router_loads_its_favourite_expert_most():
    model, (ids,), _ = moe_llama_uneven()
    moe = model.layers[0].moe
    x = model.tok_embeddings(ids)
    dispatch, _, _ = moe.route(x.reshape(-1, 16, 32))
    load = dispatch.sum((0, 1, 3))
    assert load[0] == load.max() and load[0] > 1.5 * load[2:].max(), load.tolist()
    assert dispatch.sum() == 2 * ids.numel()  # capacity factor 2: nothing dropped


def test_a_group_routes_alone_so_slices_of_the_batch_route_as_the_whole():
    """Fixed group size: what a pipeline's micro-batches and gradient accumulation rely on."""
    model, (ids,), _ = moe_llama_dropped()
    with torch.no_grad():
        whole = model(ids)[0]
        halves = torch.cat([model(ids[:4])[0], model(ids[4:])[0]])
    torch.testing.assert_close(halves, whole)


def test_capacity_and_shapes():
    cfg = MoEConfig(n_experts=8, top_k=2, group_size=64, capacity_factor=1.25)
    assert MoE(cfg).capacity(64) == math.ceil(1.25 * 64 * 2 / 8) == 20
    with pytest.raises(ValueError, match="one per expert"):
        MoE(MoEConfig(router_bias=(1.0,)))
    with pytest.raises(ValueError, match="groups of 16"):
        MoE(MoEConfig())(torch.randn(1, 8, 32))


def test_every_op_has_a_rule_and_the_expert_einsums_can_shard_experts():
    model, inputs, loss_fn = moe_llama()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("ep",))
    assert not [w for w in caught if "no sharding rule" in str(w.message)]
    experts = [n for n in prog.state.gm.graph.nodes
               if n.target is torch.ops.aten.einsum.default and n.args[0] == "gecd,edf->gecf"]
    assert len(experts) == 4  # w1 and w3 in each of the two layers
    node = experts[0]
    ins = [output_shapes(n)[0] for n in tensor_inputs(node)]
    found = candidates_for(node, ins, output_shapes(node), axis_size=2)
    expert_parallel = AxisStrategy((Shard(1), Shard(0)), Shard(1))  # tokens and weights split by expert
    data_parallel = AxisStrategy((Shard(0), R), Shard(0))            # groups split, weights whole
    tensor_parallel = AxisStrategy((R, Shard(2)), Shard(3))          # the expert FFN dim split
    contracted = AxisStrategy((Shard(3), Shard(1)), P)               # the model dim contracted: partial sums
    assert {expert_parallel, data_parallel, tensor_parallel, contracted} <= set(found)


@pytest.mark.parametrize("joint", [True, False], ids=["joint", "sequential"])
def test_an_expert_hint_on_the_inner_axis_is_met(monkeypatch, joint):
    """Two experts on a (2, 2) mesh, hinted S(0) on a1: the outer axis must not take the expert dim first (it
    would leave a1 nothing to split), whether the axes are solved together or one after the other."""
    from autoshard.passes import solve
    if not joint:
        monkeypatch.setattr(solve, "JOINT_MAX_VARIABLES", 0)
    model, inputs, loss_fn = moe_llama(n_experts=2)
    hints = {f"layers.*.moe.w{j}": {"a1": "S(0)"} for j in (1, 2, 3)}
    prog = autoshard.parallelize(model, (2, 2), inputs, loss_fn=loss_fn, hints=hints, pipeline=False)
    specs = prog.rank_program.param_specs
    assert all(specs[f"layers.{i}.moe.w{j}"][1] == Shard(0) != specs[f"layers.{i}.moe.w{j}"][0]
               for i in (0, 1) for j in (1, 2, 3))
