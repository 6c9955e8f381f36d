"""The scale search (autoshard/search/scale_search.py): one export, tp inside a node, memory forces model
parallelism or ZeRO over dp, recomputation (selective or full) only to fit, and its figures are the project's
own predictions (equal to parallelize's where both apply)."""
import pytest
import torch

import autoshard
from autoshard.cost.profiles import H100_80GB, HardwareProfile, Link, load_profile
from autoshard.search import scale_search
from autoshard.search.pipeline_search import predicted_step
from autoshard.search.scale_search import ScaleSearch
from autoshard.search.scale_stages import ZERO_STAGES, Replica
from autoshard.zoo import gpt2, llama

TINY = {"batch": 2, "seq": 16, "dim": 64, "n_heads": 4, "vocab_size": 128, "device": "meta"}


def tiny_profile(memory_bytes=1e9, devices_per_node=4):
    return HardwareProfile(name="tiny", peak_flops=1e12, memory_bandwidth=1e11, memory_bytes=memory_bytes,
                           devices_per_node=devices_per_node, intra_node=Link(5e-6, 1e10),
                           inter_node=Link(1e-5, 1e9))


def test_model_is_exported_once_for_every_candidate(monkeypatch):
    calls = []
    export = torch.export.export

    def counting(*args, **kwargs):
        calls.append(1)
        return export(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counting)
    search = ScaleSearch(*gpt2(n_layers=3, **TINY), n_layers=8, devices=16, global_batch=32, profile=tiny_profile())
    result = search.search()
    assert len(calls) == 1 and result.exports == 1
    assert len([c for c in result.candidates if c.feasible]) > 5
    assert result.planned == 3  # one intra-op plan (ILP) per tensor-parallel degree: 1, 2, 4


def test_tensor_parallelism_stays_inside_a_node():
    search = ScaleSearch(*gpt2(n_layers=3, **TINY), n_layers=8, devices=16, global_batch=32,
                         profile=tiny_profile(devices_per_node=2))
    result = search.search()
    assert {c.tp for c in result.candidates} == {1, 2}
    assert result.best.tp <= 2 and result.best.dp * result.best.tp * result.best.pp == 16


def test_memory_bound_model_needs_model_parallelism_or_zero():
    search = ScaleSearch(*gpt2(n_layers=3, **TINY), n_layers=8, devices=8, global_batch=16, profile=tiny_profile())
    static = search.static_bytes()
    search.profile = tiny_profile(memory_bytes=static / 2.5)  # parameters and optimizer state need >= 3 devices
    assert not search.evaluate(8, 1, 1, zero=0).feasible  # replicated parameters do not fit
    result = search.search()
    assert result.best.tp * result.best.pp > 2 or result.best.zero > 0
    assert result.best.memory_bytes <= search.budget
    sharded = next(c for c in result.candidates if c.degrees == (8, 1, 1))
    assert sharded.feasible and sharded.zero > 0


def test_data_parallelism_alone_fits_only_with_zero3():
    """torchtitan's Llama 3 8B on 8 GPUs: FSDP (ZeRO-3 over dp) is the only way pure data parallelism fits."""
    search = ScaleSearch(*gpt2(n_layers=3, **TINY), n_layers=8, devices=8, global_batch=16, profile=tiny_profile())
    per_device = search.static_bytes() / 8
    search.profile = tiny_profile(memory_bytes=1.8 * per_device)  # ZeRO-2 holds 2 x (2 + 6) / 8 of it: too much
    for stage in (0, 1, 2):
        assert not search.evaluate(8, 1, 1, zero=stage).feasible
    best = search.search(degrees=[(8, 1, 1)]).best
    assert best.zero == 3 and best.memory_bytes <= search.budget
    # its price: parameters gathered forward and backward, gradients reduce-scattered, every micro-batch
    assert best.step_s > search.evaluate(8, 1, 1, zero=0, fit=False).step_s


def test_zero_collectives_per_stage():
    link = Link(0.0, 1e9)
    replicas = {z: Replica(dp=4, zero=z, link=link, factor=6.0) for z in ZERO_STAGES}
    step = {z: r.sync([1e9]) for z, r in replicas.items()}
    assert step[0] == pytest.approx(step[1])  # reduce-scatter + all-gather moves what an all-reduce moves
    assert step[2][1] > 0 and step[3][1] == pytest.approx(3 * step[2][1])
    held = [r.static_bytes(8e9, [1e9]) for r in replicas.values()]
    assert held == sorted(held, reverse=True) and held[3] == pytest.approx(2e9)


def test_h100_profile_links():
    assert H100_80GB.link((32, 8), 1) == H100_80GB.intra_node  # tp = 8: NVLink inside a node
    assert H100_80GB.link((32, 8), 0) == H100_80GB.inter_node  # FSDP across nodes: InfiniBand
    assert H100_80GB.link((1, 8, 1), 1) == H100_80GB.intra_node  # dp = 8 alone fits a node
    assert H100_80GB.inter_node.bandwidth == pytest.approx(40e9) and H100_80GB.peak_flops < 989e12
    assert load_profile("h100") is H100_80GB


def test_sequence_parallel_activations_are_sharded_over_tp():
    """The ILP shards a llama's norm activations over tp (Megatron-SP): a layer keeps about 1/tp of them."""
    search = ScaleSearch(*llama(batch=2, seq=512, dim=512, n_heads=8, n_kv_heads=4, ffn_dim=2048, n_layers=3,
                                vocab_size=128, device="meta"), n_layers=4, devices=4, global_batch=8,
                         profile=tiny_profile())  # wide enough for tensor parallelism to pay
    one, four = search.plan(1)[0][2], search.plan(4)[0][2]
    assert four.activation_bytes < 0.35 * one.activation_bytes
    assert 0 < four.selective_saves < four.checkpoint_saves


def test_recomputes_layers_only_to_fit():
    search = ScaleSearch(*gpt2(n_layers=3, **TINY), n_layers=8, devices=2, global_batch=16, profile=tiny_profile(),
                         microbatch_sizes=(4,), memory_headroom=0.0)  # one micro-batch size: memory vs recompute
    loose = search.evaluate(1, 1, 2, recompute="auto")
    assert loose.recomputed == (0, 0) and loose.selective == (0, 0)
    everything = search.evaluate(1, 1, 2, recompute="full")
    assert everything.recomputed == everything.stage_layers and everything.step_s > loose.step_s
    assert everything.hfu > everything.mfu
    selective = search.evaluate(1, 1, 2, recompute="selective")
    assert selective.selective == selective.stage_layers and loose.step_s < selective.step_s < everything.step_s
    assert everything.memory_bytes < selective.memory_bytes < loose.memory_bytes
    search.profile = tiny_profile(memory_bytes=(loose.memory_bytes + everything.memory_bytes) / 2)
    tight = search.evaluate(1, 1, 2, recompute="auto")
    assert tight.feasible and 0 < sum(tight.recomputed) + sum(tight.selective) < 2 * sum(tight.stage_layers)
    assert tight.memory_bytes <= search.profile.memory_bytes and tight.step_s < everything.step_s


def test_one_replica_one_stage_equals_parallelize():
    """With dp = pp = 1 and one micro-batch the search's figures are parallelize's own predictions."""
    model, inputs, loss_fn = gpt2(n_layers=3, **TINY)
    profile = tiny_profile()
    search = ScaleSearch(model, inputs, loss_fn, n_layers=3, devices=2, global_batch=1, profile=profile,
                         microbatch_sizes=(1,))
    mine = search.evaluate(1, 2, 1)
    prog = autoshard.parallelize(model, (2,), tuple(x[:1] for x in inputs), loss_fn=loss_fn, axis_names=("tp",),
                                 profile=profile, optimizer_state_factor=scale_search.MIXED_PRECISION_ADAM)
    predicted = prog.plan.predicted
    assert mine.step_s == pytest.approx(predicted["step_time_s"], rel=1e-9)
    assert mine.memory_bytes == pytest.approx(predicted["memory_bytes_per_rank"], rel=1e-9)


def test_depth_from_three_traced_layers_equals_tracing_them_all():
    profile = tiny_profile()
    scaled = ScaleSearch(*gpt2(n_layers=3, **TINY), n_layers=6, devices=8, global_batch=16, profile=profile)
    whole = ScaleSearch(*gpt2(n_layers=6, **TINY), n_layers=6, devices=8, global_batch=16, profile=profile)
    for degrees in [(8, 1, 1), (2, 2, 2), (1, 4, 2)]:
        a, b = scaled.evaluate(*degrees), whole.evaluate(*degrees)
        assert a.step_s == pytest.approx(b.step_s, rel=1e-9) and a.memory_bytes == pytest.approx(b.memory_bytes)
        assert a.mfu == pytest.approx(b.mfu, rel=1e-9)


def test_pipeline_stages_are_the_pipeline_planners_plus_sends():
    """Cut at the same layer, the stage times are those of parallelize's pipeline (cut_stages' stage table);
    the scale search adds the stage-to-stage sends of activations and gradients, which that formula omits."""
    profile = tiny_profile()
    model, inputs, loss_fn = gpt2(**{**TINY, "batch": 4}, n_layers=4)
    prog = autoshard.parallelize(model, (2, 2), inputs, loss_fn=loss_fn, axis_names=("pp", "tp"), profile=profile,
                                 optimizer_state_factor=scale_search.MIXED_PRECISION_ADAM,
                                 pipeline={"microbatches": 4, "split_points": ["layers.2"]})
    search = ScaleSearch(model, inputs, loss_fn, n_layers=4, devices=4, global_batch=4, profile=profile,
                         microbatch_sizes=(1,))
    mine = search.evaluate(1, 2, 2, split="even")
    units, _ = search.plan(2)
    link = profile.link((2, 1, 2), 0)
    send = 2 * link.alpha + units[3].in_bytes / link.bandwidth  # the boundary before layers.2
    stages = prog.plan.pipeline["stage_table"]
    assert mine.stage_layers == (2, 2) and stages[1]["seconds"] >= stages[0]["seconds"]
    assert mine.step_s == pytest.approx(predicted_step(stages, 4) + (4 + 1) * send, rel=1e-9)
