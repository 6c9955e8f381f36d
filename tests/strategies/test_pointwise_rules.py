"""Exact candidate sets of the elementwise rule: broadcasting (incl. size-1 dims) and partial sums."""
import pytest
import torch
import torch.nn.functional as F
from rule_graphs import aten, candidate_set, candidates_of, export_graph, find_node

X = torch.randn(4, 6, 8)
SAME_SHAPE_SHARDS = {"(S(0), S(0)) -> S(0)", "(S(1), S(1)) -> S(1)", "(S(2), S(2)) -> S(2)"}


def test_add_same_shape_passes_partials_when_both_partial():
    got = candidates_of(torch.add, X, torch.randn(4, 6, 8), target=aten.add.Tensor)
    assert got == {"(R, R) -> R", *SAME_SHAPE_SHARDS, "(P, P) -> P"}


def test_add_with_alpha_is_still_linear():
    got = candidates_of(lambda a, b: torch.add(a, b, alpha=2), X, torch.randn(4, 6, 8), target=aten.add.Tensor)
    assert "(P, P) -> P" in got


def test_sub_same_shape():
    got = candidates_of(torch.sub, X, torch.randn(4, 6, 8), target=aten.sub.Tensor)
    assert got == {"(R, R) -> R", *SAME_SHAPE_SHARDS, "(P, P) -> P"}


def test_add_broadcasting_size_one_and_missing_dims():
    # y [6, 1] aligns right: dim 0 of the output is missing in y, dim 2 is a size-1 broadcast.
    got = candidates_of(torch.add, X, torch.randn(6, 1), target=aten.add.Tensor)
    assert got == {"(R, R) -> R", "(S(0), R) -> S(0)", "(S(1), S(0)) -> S(1)", "(S(2), R) -> S(2)"}


def test_add_scalar_keeps_partials_out():
    # (x1 + 1) + (x2 + 1) != x + 1
    got = candidates_of(lambda a: a + 1.0, X, target=aten.add.Tensor)
    assert got == {"(R) -> R", "(S(0)) -> S(0)", "(S(1)) -> S(1)", "(S(2)) -> S(2)"}


def test_rsub_scalar_is_not_linear():
    got = candidates_of(lambda a: 1 - a, X, target=aten.rsub.Scalar)
    assert got == {"(R) -> R", "(S(0)) -> S(0)", "(S(1)) -> S(1)", "(S(2)) -> S(2)"}


def test_mul_is_linear_in_either_operand():
    got = candidates_of(torch.mul, X, torch.randn(4, 6, 8), target=aten.mul.Tensor)
    assert got == {"(R, R) -> R", *SAME_SHAPE_SHARDS, "(P, R) -> P", "(R, P) -> P"}


def test_mul_by_broadcast_operand_only_full_shape_operand_partial():
    got = candidates_of(torch.mul, X, torch.randn(1, 8), target=aten.mul.Tensor)
    assert got == {"(R, R) -> R", "(S(0), R) -> S(0)", "(S(1), R) -> S(1)", "(S(2), S(1)) -> S(2)", "(P, R) -> P"}


def test_mul_by_zero_dim_tensor():
    got = candidates_of(lambda a: a * torch.tensor(3.0), X, target=aten.mul.Tensor)
    assert got == {"(R, R) -> R", "(S(0), R) -> S(0)", "(S(1), R) -> S(1)", "(S(2), R) -> S(2)", "(P, R) -> P"}


def test_mul_by_python_scalar():
    got = candidates_of(lambda a: a * 2, X, target=aten.mul.Tensor)
    assert got == {"(R) -> R", "(S(0)) -> S(0)", "(S(1)) -> S(1)", "(S(2)) -> S(2)", "(P) -> P"}


def test_div_is_linear_in_the_numerator_only():
    got = candidates_of(torch.div, X, torch.randn(4, 6, 8), target=aten.div.Tensor)
    assert got == {"(R, R) -> R", *SAME_SHAPE_SHARDS, "(P, R) -> P"}


def test_type_as_is_linear_in_the_first_operand_only():
    # The second operand only lends its dtype: (R, P) -> P would make the output k times too big.
    got = candidates_of(lambda a, b: a.type_as(b), X, torch.randn(4, 6, 8).double(), target=aten.type_as.default)
    assert got == {"(R, R) -> R", *SAME_SHAPE_SHARDS, "(P, R) -> P"}


@pytest.mark.parametrize("fn, target", [
    (F.gelu, aten.gelu.default), (torch.relu, aten.relu.default), (torch.tanh, aten.tanh.default),
    (torch.exp, aten.exp.default), (F.silu, aten.silu.default), (lambda a: a.pow(2), aten.pow.Tensor_Scalar),
])
def test_nonlinear_unary_never_partial(fn, target):
    assert candidates_of(fn, X, target=target) == {"(R) -> R", "(S(0)) -> S(0)", "(S(1)) -> S(1)", "(S(2)) -> S(2)"}


@pytest.mark.parametrize("fn, target", [
    (lambda a: -a, aten.neg.default), (torch.clone, aten.clone.default), (lambda a: a.double(), aten.to.dtype),
])
def test_linear_unary_passes_partials(fn, target):
    assert candidates_of(fn, X, target=target) == {
        "(R) -> R", "(S(0)) -> S(0)", "(S(1)) -> S(1)", "(S(2)) -> S(2)", "(P) -> P"}


def test_where_broadcasts_condition():
    got = candidates_of(lambda c, a, b: torch.where(c, a, b), torch.rand(6, 8) > 0.5, X, torch.randn(4, 1, 8),
                        target=aten.where.self)
    assert got == {"(R, R, R) -> R", "(R, S(0), S(0)) -> S(0)", "(S(0), S(1), R) -> S(1)",
                   "(S(1), S(2), S(2)) -> S(2)"}


def test_tril_keeps_last_two_dims_whole():
    got = candidates_of(torch.tril, X, target=aten.tril.default)
    assert got == {"(R) -> R", "(S(0)) -> S(0)"}


def test_size_one_output_dim_is_never_sharded():
    got = candidates_of(torch.add, torch.randn(4, 1, 8), torch.randn(4, 1, 8), target=aten.add.Tensor)
    assert got == {"(R, R) -> R", "(S(0), S(0)) -> S(0)", "(S(2), S(2)) -> S(2)", "(P, P) -> P"}


def test_in_place_add_shards_like_elementwise():
    def fn(a, b):
        a = a.clone()
        a.add_(b)
        return a
    node = find_node(export_graph(fn, X, torch.randn(8)), aten.add_.Tensor)
    assert candidate_set(node) == {"(R, R) -> R", "(S(0), R) -> S(0)", "(S(1), R) -> S(1)", "(S(2), S(0)) -> S(2)"}


def test_gt_scalar_mask():
    node = find_node(export_graph(lambda a: torch.where(a > 0, a, 0.0), X), aten.gt.Scalar)
    assert candidate_set(node) == {"(R) -> R", "(S(0)) -> S(0)", "(S(1)) -> S(1)", "(S(2)) -> S(2)"}
