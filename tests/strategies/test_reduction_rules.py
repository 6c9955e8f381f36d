"""Exact candidate sets of reductions: sums go partial, max/var/softmax keep the reduced dim whole."""
import pytest
import torch
from rule_graphs import aten, candidate_set, candidates_of, hand_node

from autoshard.strategies.base import RuleContext

X = torch.randn(4, 6, 8)


@pytest.mark.parametrize("fn, expected", [
    (lambda a: a.sum(-1), {"(S(0)) -> S(0)", "(S(1)) -> S(1)", "(S(2)) -> P"}),
    (lambda a: a.sum(1, keepdim=True), {"(S(0)) -> S(0)", "(S(1)) -> P", "(S(2)) -> S(2)"}),
    (lambda a: a.sum(0), {"(S(0)) -> P", "(S(1)) -> S(0)", "(S(2)) -> S(1)"}),
    (lambda a: a.sum((0, 2)), {"(S(0)) -> P", "(S(1)) -> S(0)", "(S(2)) -> P"}),
])
def test_sum_over_dims(fn, expected):
    assert candidates_of(fn, X, target=aten.sum.dim_IntList) == {"(R) -> R", "(P) -> P", *expected}


def test_sum_of_everything():
    assert candidates_of(lambda a: a.sum(), X, target=aten.sum.default) == {
        "(R) -> R", "(S(0)) -> P", "(S(1)) -> P", "(S(2)) -> P", "(P) -> P"}


@pytest.mark.parametrize("fn, target, expected", [
    (lambda a: a.amax(-1), aten.amax.default, {"(S(0)) -> S(0)", "(S(1)) -> S(1)"}),
    (lambda a: a.amax(0, keepdim=True), aten.amax.default, {"(S(1)) -> S(1)", "(S(2)) -> S(2)"}),
    (lambda a: a.amin(1), aten.amin.default, {"(S(0)) -> S(0)", "(S(2)) -> S(1)"}),
    (lambda a: a.logsumexp(0), aten.logsumexp.default, {"(S(1)) -> S(0)", "(S(2)) -> S(1)"}),
    (lambda a: a.argmax(), aten.argmax.default, set()),
    (lambda a: a.argmax(1), aten.argmax.default, {"(S(0)) -> S(0)", "(S(2)) -> S(1)"}),
    (lambda a: a.max(0)[0], aten.max.dim, {"(S(1)) -> S(0)", "(S(2)) -> S(1)"}),
])
def test_max_like_reductions_keep_the_reduced_dim_whole(fn, target, expected):
    assert candidates_of(fn, X, target=target) == {"(R) -> R", *expected}


@pytest.mark.parametrize("fn, target, expected", [
    (lambda a: a.var(0), aten.var.dim, {"(S(1)) -> S(0)", "(S(2)) -> S(1)"}),
    (lambda a: a.std(0, unbiased=False, keepdim=True), aten.std.dim, {"(S(1)) -> S(1)", "(S(2)) -> S(2)"}),
    (lambda a: a.std(0, unbiased=True, keepdim=True), aten.std.dim, {"(S(1)) -> S(1)", "(S(2)) -> S(2)"}),
    (lambda a: a.std(1, unbiased=False), aten.std.dim, {"(S(0)) -> S(0)", "(S(2)) -> S(1)"}),
    (lambda a: torch.var_mean(a, 0)[0], aten.var_mean.dim, {"(S(1)) -> S(0)", "(S(2)) -> S(1)"}),
])
def test_variance_keeps_the_reduced_dim_whole(fn, target, expected):
    assert candidates_of(fn, X, target=target) == {"(R) -> R", *expected}


@pytest.mark.parametrize("fn, target", [
    (lambda a: torch.linalg.vector_norm(a, 2, 0), aten.linalg_vector_norm.default),
    (lambda a: a.norm(2, 0), aten.linalg_vector_norm.default),
])
def test_norm_reads_dims_after_the_order(fn, target):
    # norm(x, p=2, dim=0): the reduced dim is 0, not the order 2
    assert candidates_of(fn, X, target=target) == {"(R) -> R", "(S(1)) -> S(0)", "(S(2)) -> S(1)"}


@pytest.mark.parametrize("fn, target", [
    (lambda a: a.softmax(-1), aten.softmax.int),
    (lambda a: a.log_softmax(-1), aten.log_softmax.int),
    (lambda a: a.sort()[0], aten.sort.default),  # dim omitted: -1
    (lambda a: a.sort(2)[0], aten.sort.default),
])
def test_along_last_dim_keeps_it_whole(fn, target):
    assert candidates_of(fn, X, target=target) == {"(R) -> R", "(S(0)) -> S(0)", "(S(1)) -> S(1)"}


def test_softmax_middle_dim():
    assert candidates_of(lambda a: a.softmax(1), X, target=aten.softmax.int) == {
        "(R) -> R", "(S(0)) -> S(0)", "(S(2)) -> S(2)"}


def test_cumsum_is_linear():
    assert candidates_of(lambda a: a.cumsum(0), X, target=aten.cumsum.default) == {
        "(R) -> R", "(S(1)) -> S(1)", "(S(2)) -> S(2)", "(P) -> P"}


@pytest.mark.parametrize("unbiased, keepdim, expected", [
    (True, False, {"(S(1)) -> S(0)", "(S(2)) -> S(1)"}),
    (False, True, {"(S(1)) -> S(1)", "(S(2)) -> S(2)"}),
])
def test_var_dim_reads_keepdim_after_unbiased(unbiased, keepdim, expected):
    # var.dim(x, dim, unbiased, keepdim): `unbiased` sits where sum keeps `keepdim`
    out = (1, 6, 8) if keepdim else (6, 8)
    node = hand_node(aten.var.dim, [(4, 6, 8)], [out], lambda xs: ((xs[0], [0], unbiased, keepdim), {}))
    assert candidate_set(node) == {"(R) -> R", *expected}


def test_arguments_passed_by_keyword_read_as_positional_ones():
    """A pass may build a node with keywords: rules ask for arguments by their schema names, not positions."""
    positional = hand_node(aten.sum.dim_IntList, [(4, 6, 8)], [(4, 1, 8)], lambda xs: ((xs[0], [1], True), {}))
    keyword = hand_node(aten.sum.dim_IntList, [(4, 6, 8)], [(4, 1, 8)],
                        lambda xs: ((xs[0],), {"dim": [1], "keepdim": True}))
    assert candidate_set(keyword) == candidate_set(positional) == {
        "(R) -> R", "(P) -> P", "(S(0)) -> S(0)", "(S(1)) -> P", "(S(2)) -> S(2)"}


def test_asking_for_an_argument_the_op_has_not_names_its_arguments():
    node = hand_node(aten.sum.dim_IntList, [(4, 6, 8)], [(4, 8)], lambda xs: ((xs[0], [1]), {}))
    ctx = RuleContext(node, [(4, 6, 8)], [(4, 8)], axis_size=2)
    assert ctx.arg("keepdim") is False  # the schema's default
    with pytest.raises(TypeError, match=r"aten.sum.dim_IntList has no argument 'dims' \(its arguments: self, dim, "):
        ctx.arg("dims")
