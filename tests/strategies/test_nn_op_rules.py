"""Exact candidate sets of the special ops: norms, batch norm, attention, nll_loss, creation, gathers."""
import pytest
import torch
import torch.nn.functional as F
from rule_graphs import (
    aten,
    candidate_set,
    candidates_of,
    export_graph,
    find_node,
    hand_node,
)
from torch import nn

X = torch.randn(4, 6, 8)


def test_layer_norm_shards_leading_dims_only():
    got = candidates_of(lambda m, a: m["ln"](a), X, target=aten.layer_norm.default, modules={"ln": nn.LayerNorm(8)})
    assert got == {"(R, R, R) -> R", "(S(0), R, R) -> S(0)", "(S(1), R, R) -> S(1)"}


def test_layer_norm_over_two_dims():
    got = candidates_of(lambda a: F.layer_norm(a, (6, 8)), X, target=aten.layer_norm.default)
    assert got == {"(R) -> R", "(S(0)) -> S(0)"}


def test_rms_norm():
    got = candidates_of(lambda a, w: F.rms_norm(a, (8,), w), X, torch.ones(8), target=aten.rms_norm.default)
    assert got == {"(R, R) -> R", "(S(0), R) -> S(0)", "(S(1), R) -> S(1)"}


def _batch_norm_candidates(training):
    bn = nn.BatchNorm2d(4).train(training)
    graph = export_graph(lambda m, a: m["bn"](a), torch.randn(2, 4, 4, 4), modules={"bn": bn})
    return candidate_set(find_node(graph, aten.batch_norm.default))


def test_batch_norm_eval_shards_batch_or_channels():
    assert _batch_norm_candidates(False) == {
        "(R, R, R, R, R) -> R",
        "(S(1), S(0), S(0), S(0), S(0)) -> S(1)",  # channels with their weight, bias and statistics
        "(S(0), R, R, R, R) -> S(0)",
    }


def test_batch_norm_training_shards_channels_only():
    assert _batch_norm_candidates(True) == {"(R, R, R, R, R) -> R", "(S(1), S(0), S(0), S(0), S(0)) -> S(1)"}


# --- attention -----------------------------------------------------------------------------------

Q = torch.randn(2, 4, 6, 8)  # [B, H, L, E]


def test_sdpa_batch_and_heads():
    got = candidates_of(F.scaled_dot_product_attention, Q, Q, Q, target=aten.scaled_dot_product_attention.default)
    assert got == {"(R, R, R) -> R", "(S(0), S(0), S(0)) -> S(0)", "(S(1), S(1), S(1)) -> S(1)",
                   # context parallel: query rows against gathered keys, or a ring of key/value blocks
                   "(S(2), R, R) -> S(2) allgather", "(S(2), S(2), S(2)) -> S(2) ring"}


def test_sdpa_causal():
    got = candidates_of(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), Q, Q, Q,
                        target=aten.scaled_dot_product_attention.default)
    # no causal ring: its zigzag order cuts L = 6 into 2 x 2 chunks, which do not divide it
    assert got == {"(R, R, R) -> R", "(S(0), S(0), S(0)) -> S(0)", "(S(1), S(1), S(1)) -> S(1)",
                   "(S(2), R, R) -> S(2) allgather"}


def test_sdpa_causal_ring_when_chunks_divide():
    q = torch.randn(2, 4, 8, 8)
    got = candidates_of(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, q, q,
                        target=aten.scaled_dot_product_attention.default)
    assert "(S(2), S(2), S(2)) -> S(2) ring" in got


def test_sdpa_no_ring_with_attention_dropout():
    got = candidates_of(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1), Q, Q, Q,
                        target=aten.scaled_dot_product_attention.default)
    assert not any(c.endswith("ring") for c in got) and "(S(2), R, R) -> S(2) allgather" in got


def test_sdpa_with_2d_mask():
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    got = candidates_of(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), Q, Q, Q, mask,
                        target=aten.scaled_dot_product_attention.default)
    assert got == {"(R, R, R, R) -> R", "(S(0), S(0), S(0), R) -> S(0)", "(S(1), S(1), S(1), R) -> S(1)",
                   "(S(2), R, R, S(0)) -> S(2) allgather", "(S(2), S(2), S(2), S(0)) -> S(2) ring"}  # mask rows


def test_sdpa_with_per_batch_mask_broadcast_over_heads():
    mask = torch.zeros(2, 1, 6, 6)
    got = candidates_of(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), Q, Q, Q, mask,
                        target=aten.scaled_dot_product_attention.default)
    assert got == {"(R, R, R, R) -> R", "(S(0), S(0), S(0), S(0)) -> S(0)", "(S(1), S(1), S(1), R) -> S(1)",
                   "(S(2), R, R, S(2)) -> S(2) allgather", "(S(2), S(2), S(2), S(2)) -> S(2) ring"}


def test_sdpa_3d_inputs_shard_the_sequence_only_by_context_parallelism():
    q = torch.randn(2, 6, 8)  # [B, L, E]: dim 1 is L, which k and v need whole unless they travel in a ring
    got = candidates_of(F.scaled_dot_product_attention, q, q, q, target=aten.scaled_dot_product_attention.default)
    assert got == {"(R, R, R) -> R", "(S(0), S(0), S(0)) -> S(0)", "(S(1), R, R) -> S(1) allgather",
                   "(S(1), S(1), S(1)) -> S(1) ring"}


def test_sdpa_grouped_query_heads():
    q, kv = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8)
    got = candidates_of(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), q, kv, kv,
                        target=aten.scaled_dot_product_attention.default)
    assert got == {"(R, R, R) -> R", "(S(0), S(0), S(0)) -> S(0)", "(S(1), S(1), S(1)) -> S(1)",
                   "(S(2), R, R) -> S(2) allgather", "(S(2), S(2), S(2)) -> S(2) ring"}


# --- nll_loss ------------------------------------------------------------------------------------

LOGP = torch.randn(4, 10).log_softmax(-1)
TARGET = torch.tensor([1, 0, 3, 9])


def _nll(reduction, logp=LOGP, target=TARGET, weight=None):
    args = (logp, target) if weight is None else (logp, target, weight)
    return candidates_of(lambda a, t, *w: F.nll_loss(a, t, *w, reduction=reduction), *args,
                         target=aten.nll_loss_nd.default)


def test_nll_loss_sum_batch_gives_partial():
    assert _nll("sum") == {"(R, R) -> R", "(S(0), S(0)) -> P", "(P, R) -> P"}


def test_nll_loss_none_keeps_batch_sharded():
    assert _nll("none") == {"(R, R) -> R", "(S(0), S(0)) -> S(0)", "(P, R) -> P"}


def test_nll_loss_mean_is_replicated_until_normalize_splits_it():
    assert _nll("mean") == {"(R, R) -> R"}


def test_nll_loss_with_class_weights():
    assert _nll("sum", weight=torch.rand(10)) == {"(R, R, R) -> R", "(S(0), S(0), R) -> P", "(P, R, R) -> P"}


def test_nll_loss_spatial():
    logp, target = torch.randn(2, 5, 4, 6).log_softmax(1), torch.randint(0, 5, (2, 4, 6))
    assert _nll("sum", logp, target) == {
        "(R, R) -> R", "(S(0), S(0)) -> P", "(S(2), S(1)) -> P", "(S(3), S(2)) -> P", "(P, R) -> P"}


def test_nll_loss_unbatched_never_shards_classes():
    assert _nll("sum", torch.randn(10).log_softmax(0), torch.tensor(3)) == {"(R, R) -> R", "(P, R) -> P"}


# --- replicated-only ops -------------------------------------------------------------------------

@pytest.mark.parametrize("fn, args, target", [
    (lambda a: a + torch.arange(8), (X,), aten.arange.default),
    (lambda a: a + torch.zeros(8), (X,), aten.zeros.default),
    (lambda a, i: a[i, :, i], (X, torch.tensor([0, 2])), aten.index.Tensor),  # two index tensors
    (lambda a, t: F.cross_entropy(a, t), (torch.randn(4, 10), TARGET), aten.cross_entropy_loss.default),
])
def test_replicated_only(fn, args, target):
    got = candidates_of(fn, *args, target=target)
    assert len(got) == 1 and "S(" not in next(iter(got)) and "P" not in next(iter(got))


def test_in_place_copy_follows_the_buffer():
    node = hand_node(aten.copy_.default, [(4, 8), (4, 8)], [(4, 8)])
    assert candidate_set(node) == {"(R, R) -> R", "(S(0), S(0)) -> S(0)", "(S(1), S(1)) -> S(1)"}
