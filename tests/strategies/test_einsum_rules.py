"""Exact candidate sets of the einsum-like rules (linear, mm, bmm, matmul, einsum, embedding, conv)."""
import pytest
import torch
import torch.nn.functional as F
from rule_graphs import aten, candidate_set, candidates_of, hand_node
from torch import nn

from autoshard.strategies import candidates_for
from autoshard.strategies.einsum import einsum_strategies, matmul_subscripts

REPL2 = "(R, R) -> R"
PARTIALS2 = {"(P, R) -> P", "(R, P) -> P"}


def test_linear_3d_input_without_bias():
    got = candidates_of(lambda m, x: m["fc"](x), torch.randn(4, 6, 8), target=aten.linear.default,
                        modules={"fc": nn.Linear(8, 16, bias=False)})
    assert got == {
        REPL2,
        "(S(0), R) -> S(0)",  # batch
        "(S(1), R) -> S(1)",  # sequence
        "(R, S(0)) -> S(2)",  # column parallel: weight rows are output features
        "(S(2), S(1)) -> P",  # row parallel: contracted dim gives a partial sum
        *PARTIALS2,  # linear in each operand
    }


def test_linear_with_bias_has_no_partial_output():
    # The bias would be added once per rank; normalize splits it off, but the rule must stay exact.
    got = candidates_of(lambda m, x: m["fc"](x), torch.randn(4, 6, 8), target=aten.linear.default,
                        modules={"fc": nn.Linear(8, 16)})
    assert got == {"(R, R, R) -> R", "(S(0), R, R) -> S(0)", "(S(1), R, R) -> S(1)", "(R, S(0), S(0)) -> S(2)"}


def test_linear_drops_candidates_that_do_not_divide():
    got = candidates_of(lambda m, x: m["fc"](x), torch.randn(4, 6, 8), target=aten.linear.default,
                        modules={"fc": nn.Linear(8, 16, bias=False)}, axis_size=3)
    assert got == {REPL2, "(S(1), R) -> S(1)", *PARTIALS2}


def test_mm():
    got = candidates_of(torch.mm, torch.randn(4, 8), torch.randn(8, 6), target=aten.mm.default)
    assert got == {REPL2, "(S(0), R) -> S(0)", "(R, S(1)) -> S(1)", "(S(1), S(0)) -> P", *PARTIALS2}


def test_bmm():
    got = candidates_of(torch.bmm, torch.randn(2, 4, 8), torch.randn(2, 8, 6), target=aten.bmm.default)
    assert got == {REPL2, "(S(0), S(0)) -> S(0)", "(S(1), R) -> S(1)", "(R, S(2)) -> S(2)", "(S(2), S(1)) -> P",
                   *PARTIALS2}


def test_matmul_broadcast_batch_dims():
    # a [2, 1, 4, 8] @ b [4, 8, 6] -> [2, 4, 4, 6]: a's size-1 batch dim broadcasts, b lacks the first.
    got = candidates_of(torch.matmul, torch.randn(2, 1, 4, 8), torch.randn(4, 8, 6), target=aten.matmul.default)
    assert got == {
        REPL2,
        "(S(0), R) -> S(0)",  # only a has the outer batch dim
        "(R, S(0)) -> S(1)",  # a broadcasts the inner batch dim: replicated
        "(S(2), R) -> S(2)",
        "(R, S(2)) -> S(3)",
        "(S(3), S(1)) -> P",
        *PARTIALS2,
    }


def test_matmul_subscripts():
    assert matmul_subscripts((2, 1, 4, 8), (4, 8, 6)) == (["A1mk", "Bkn"], "ABmn")
    assert matmul_subscripts((8,), (2, 8, 6)) == (["k", "Akn"], "An")
    assert matmul_subscripts((3, 4, 8), (8,)) == (["Amk", "k"], "Am")
    assert matmul_subscripts((8,), (8,)) == (["k", "k"], "")
    # a batch dim of 1 on both sides stays a real (size-1, never sharded) dim
    assert matmul_subscripts((1, 4, 8), (1, 8, 6)) == (["Amk", "Akn"], "Amn")


def test_matmul_vector_times_batched_matrix():
    got = candidates_of(torch.matmul, torch.randn(8), torch.randn(2, 8, 6), target=aten.matmul.default)
    assert got == {REPL2, "(R, S(0)) -> S(0)", "(S(0), S(1)) -> P", "(R, S(2)) -> S(1)", *PARTIALS2}


def test_einsum_equation():
    got = candidates_of(lambda a, b: torch.einsum("bij,bjk->bik", a, b), torch.randn(2, 4, 6), torch.randn(2, 6, 8),
                        target=aten.einsum.default)
    assert got == {REPL2, "(S(0), S(0)) -> S(0)", "(S(1), R) -> S(1)", "(S(2), S(1)) -> P", "(R, S(2)) -> S(2)",
                   *PARTIALS2}


def test_einsum_with_ellipsis_is_replicated():
    got = candidates_of(lambda a, b: torch.einsum("...ij,...jk->...ik", a, b), torch.randn(2, 4, 6),
                        torch.randn(2, 6, 8), target=aten.einsum.default)
    assert got == {REPL2}


def test_einsum_repeated_letter_keeps_diagonal_whole():
    # "ii->i" reads the diagonal: sharding only the first i would pair rows with the wrong columns.
    assert {repr(s) for s in einsum_strategies(["ii"], "i")} == {"(R) -> R", "(P) -> P"}
    assert {repr(s) for s in einsum_strategies(["iij", "jk"], "ik")} == {
        "(R, R) -> R", "(S(2), S(0)) -> P", "(R, S(1)) -> S(1)", *PARTIALS2}


def test_embedding():
    got = candidates_of(lambda m, ids: m["emb"](ids), torch.randint(0, 10, (2, 6)), target=aten.embedding.default,
                        modules={"emb": nn.Embedding(10, 8)})
    assert got == {
        REPL2,
        "(R, S(0)) -> S(0)",  # ids sharded: rows of the output
        "(R, S(1)) -> S(1)",
        "(S(1), R) -> S(2)",  # embedding dim sharded
        "(P, R) -> P",  # linear in the weight, not in the ids
    }


def test_embedding_vocab_dim_never_sharded():
    got = candidates_of(lambda m, ids: m["emb"](ids), torch.randint(0, 10, (3,)), target=aten.embedding.default,
                        modules={"emb": nn.Embedding(10, 8)})
    assert not any(c.startswith("(S(0)") for c in got)
    assert got == {REPL2, "(S(1), R) -> S(1)", "(P, R) -> P"}


def test_conv2d_without_bias():
    got = candidates_of(lambda m, x: m["conv"](x), torch.randn(2, 4, 8, 8), target=aten.conv2d.default,
                        modules={"conv": nn.Conv2d(4, 6, 3, bias=False)})
    assert got == {REPL2, "(S(0), R) -> S(0)", "(R, S(0)) -> S(1)", "(S(1), S(1)) -> P", *PARTIALS2}


def test_conv2d_with_bias_follows_output_channels():
    got = candidates_of(lambda m, x: m["conv"](x), torch.randn(2, 4, 8, 8), target=aten.conv2d.default,
                        modules={"conv": nn.Conv2d(4, 6, 3)})
    assert got == {"(R, R, R) -> R", "(S(0), R, R) -> S(0)", "(R, S(0), S(0)) -> S(1)"}


def test_grouped_conv_only_shards_batch():
    got = candidates_of(lambda m, x: m["conv"](x), torch.randn(2, 4, 8), target=aten.conv1d.default,
                        modules={"conv": nn.Conv1d(4, 6, 3, groups=2, bias=False)})
    assert got == {REPL2, "(S(0), R) -> S(0)"}


def _convolution(transposed):
    weight = (4, 6, 3, 3) if transposed else (6, 4, 3, 3)
    out = (2, 6, 10, 10) if transposed else (2, 6, 6, 6)

    def build(xs):
        return (xs[0], xs[1], None, [1, 1], [0, 0], [1, 1], transposed, [0, 0], 1), {}
    return hand_node(aten.convolution.default, [(2, 4, 8, 8), weight], [out], build)


def test_generic_convolution():
    assert candidate_set(_convolution(False)) == {
        REPL2, "(S(0), R) -> S(0)", "(R, S(0)) -> S(1)", "(S(1), S(1)) -> P", *PARTIALS2}


def test_transposed_convolution_swaps_weight_channel_dims():
    # conv_transpose weight is [C_in, C_out, kh, kw]
    assert candidate_set(_convolution(True)) == {
        REPL2, "(S(0), R) -> S(0)", "(R, S(1)) -> S(1)", "(S(1), S(0)) -> P", *PARTIALS2}


def test_op_without_rule_is_replicated_with_a_warning():
    node = hand_node(aten.conv_transpose2d.input, [(2, 4, 8, 8), (4, 6, 3, 3)], [(2, 6, 10, 10)])
    with pytest.warns(UserWarning, match="no sharding rule for aten.conv_transpose2d"):
        got = candidates_for(node, [(2, 4, 8, 8), (4, 6, 3, 3)], [(2, 6, 10, 10)], 2)
    assert [repr(s) for s in got] == [REPL2]


def test_replicated_candidate_is_always_first():
    got = candidates_for(hand_node(aten.mm.default, [(4, 8), (8, 6)], [(4, 6)]), [(4, 8), (8, 6)], [(4, 6)], 2)
    assert repr(got[0]) == REPL2
    assert len(got) == len(set(got))


def test_feasibility_needs_dim_at_least_axis_size():
    # on an axis of size 4 the contracted dim of size 2 cannot split; dims of size 4 and 8 can
    got = candidates_of(torch.mm, torch.randn(4, 2), torch.randn(2, 8), target=aten.mm.default, axis_size=4)
    assert got == {REPL2, "(S(0), R) -> S(0)", "(R, S(1)) -> S(1)", *PARTIALS2}


def test_functional_linear_matches_module():
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    got = candidates_of(F.linear, x, w, target=aten.linear.default)
    assert got == {REPL2, "(S(0), R) -> S(0)", "(R, S(0)) -> S(1)", "(S(1), S(1)) -> P", *PARTIALS2}
