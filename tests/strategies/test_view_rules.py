"""Exact candidate sets of the view family: reshape algebra, permute, expand, slice/select/split/cat, getitem."""
import pytest
import torch
from rule_graphs import (
    GETITEM,
    aten,
    candidate_set,
    candidates_of,
    export_graph,
    find_node,
    hand_node,
)

from autoshard.strategies.views import reshape_dim_map, reshape_groups

X = torch.randn(4, 6, 8)
VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def view_candidates(x, shape, axis_size=2):
    graph = export_graph(lambda a: a.reshape(shape), x)
    node = next(n for n in graph.nodes if n.op == "call_function" and n.target in VIEWS)
    return candidate_set(node, axis_size)


# --- reshape_groups / reshape_dim_map --------------------------------------------------------------

@pytest.mark.parametrize("in_shape, out_shape, groups", [
    ((2, 4, 12), (2, 4, 3, 4), [([0], [0]), ([1], [1]), ([2], [2, 3])]),  # [B, T, H*D] -> [B, T, H, D]
    ((2, 4, 3, 4), (2, 4, 12), [([0], [0]), ([1], [1]), ([2, 3], [2])]),
    ((2, 4, 8), (8, 8), [([0, 1], [0]), ([2], [1])]),
    ((4, 1, 8), (4, 8), [([0], [0]), ([1], []), ([2], [1])]),
    ((4, 8), (4, 1, 8), [([0], [0]), ([], [1]), ([1], [2])]),
    ((1, 6), (6, 1), [([0], []), ([1], [0]), ([], [1])]),
    ((6, 4), (4, 6), [([0, 1], [0, 1])]),
    ((2, 1, 3), (6,), [([0, 1, 2], [0])]),  # a size-1 dim inside a run stays in it
    ((), (1, 1), [([], [0]), ([], [1])]),
    ((5,), (5,), [([0], [0])]),
])
def test_reshape_groups(in_shape, out_shape, groups):
    assert reshape_groups(in_shape, out_shape) == groups


def test_reshape_dim_map_pairs_group_leaders():
    assert reshape_dim_map((2, 4, 12), (2, 4, 3, 4)) == {0: 0, 1: 1, 2: 2}
    assert reshape_dim_map((4, 1, 8), (4, 8)) == {0: 0, 2: 1}
    assert reshape_dim_map((6, 4), (4, 6)) == {0: 0}


# --- reshape candidates ----------------------------------------------------------------------------

def test_view_split_heads():
    assert view_candidates(torch.randn(2, 4, 8), (2, 4, 2, 4)) == {
        "(R) -> R", "(S(0)) -> S(0)", "(S(1)) -> S(1)", "(S(2)) -> S(2)", "(P) -> P"}


def test_view_split_heads_needs_heads_divisible():
    # H = 3 heads over an axis of 3: the fused dim 12 and H both divide; D = 4 is never sharded
    got = view_candidates(torch.randn(2, 4, 12), (2, 4, 3, 4), axis_size=3)
    assert got == {"(R) -> R", "(S(2)) -> S(2)", "(P) -> P"}


def test_view_merge_heads():
    assert view_candidates(torch.randn(2, 4, 2, 4), (2, 4, 8)) == {
        "(R) -> R", "(S(0)) -> S(0)", "(S(1)) -> S(1)", "(S(2)) -> S(2)", "(P) -> P"}


def test_view_merge_leading_dims():
    assert view_candidates(torch.randn(2, 4, 8), (8, 8)) == {"(R) -> R", "(S(0)) -> S(0)", "(S(2)) -> S(1)",
                                                            "(P) -> P"}


def test_view_split_leading_dim():
    assert view_candidates(torch.randn(8, 8), (2, 4, 8)) == {"(R) -> R", "(S(0)) -> S(0)", "(S(1)) -> S(2)",
                                                            "(P) -> P"}


def test_view_with_interleaved_groups_shards_only_divisible_leaders():
    # [6, 4] -> [3, 8]: one group whose output leader (3) does not split in 2
    assert view_candidates(torch.randn(6, 4), (3, 8)) == {"(R) -> R", "(P) -> P"}


def test_squeeze_and_unsqueeze_skip_size_one_dims():
    assert candidates_of(lambda a: a.squeeze(1), torch.randn(4, 1, 8), target=aten.squeeze.dim) == {
        "(R) -> R", "(S(0)) -> S(0)", "(S(2)) -> S(1)", "(P) -> P"}
    assert candidates_of(lambda a: a.unsqueeze(1), torch.randn(4, 8), target=aten.unsqueeze.default) == {
        "(R) -> R", "(S(0)) -> S(0)", "(S(1)) -> S(2)", "(P) -> P"}


def test_flatten_shards_only_the_leading_dim():
    assert candidates_of(lambda a: a.flatten(), X, target=aten.flatten.using_ints) == {
        "(R) -> R", "(S(0)) -> S(0)", "(P) -> P"}


def test_reshape_of_empty_tensor_is_replicated():
    node = hand_node(aten.view.default, [(0, 3)], [(0, 5, 3)], lambda xs: ((xs[0], [0, 5, 3]), {}))
    assert candidate_set(node) == {"(R) -> R"}


# --- permute / transpose / expand ----------------------------------------------------------------

def test_permute():
    assert candidates_of(lambda a: a.permute(2, 0, 1), X, target=aten.permute.default) == {
        "(R) -> R", "(S(2)) -> S(0)", "(S(0)) -> S(1)", "(S(1)) -> S(2)", "(P) -> P"}


def test_permute_negative_dims():
    assert candidates_of(lambda a: a.permute(0, -1, -2), X, target=aten.permute.default) == {
        "(R) -> R", "(S(0)) -> S(0)", "(S(2)) -> S(1)", "(S(1)) -> S(2)", "(P) -> P"}


def test_transpose():
    assert candidates_of(lambda a: a.transpose(0, 1), X, target=aten.transpose.int) == {
        "(R) -> R", "(S(1)) -> S(0)", "(S(0)) -> S(1)", "(S(2)) -> S(2)", "(P) -> P"}


def test_t():
    assert candidates_of(lambda a: a.t(), torch.randn(4, 6), target=aten.t.default) == {
        "(R) -> R", "(S(1)) -> S(0)", "(S(0)) -> S(1)", "(P) -> P"}


def test_expand_size_one_dims_shard_from_replicated():
    assert candidates_of(lambda a: a.expand(4, 6, 8), torch.randn(4, 1, 8), target=aten.expand.default) == {
        "(R) -> R", "(S(0)) -> S(0)", "(R) -> S(1)", "(S(2)) -> S(2)", "(P) -> P"}


def test_expand_new_leading_dims():
    # [8] -> [2, 3, 8]: new dims 2 (shardable from R) and 3 (does not divide)
    assert candidates_of(lambda a: a.expand(2, 3, 8), torch.randn(8), target=aten.expand.default) == {
        "(R) -> R", "(R) -> S(0)", "(S(0)) -> S(2)", "(P) -> P"}


# --- slice / select / split / cat / stack / index_select -----------------------------------------

def test_slice_keeps_the_sliced_dim_whole():
    assert candidates_of(lambda a: a[1:3], X, target=aten.slice.Tensor) == {
        "(R) -> R", "(S(1)) -> S(1)", "(S(2)) -> S(2)", "(P) -> P"}


def test_narrow():
    assert candidates_of(lambda a: a.narrow(1, 0, 4), X, target=aten.narrow.default) == {
        "(R) -> R", "(S(0)) -> S(0)", "(S(2)) -> S(2)", "(P) -> P"}


def test_select_removes_the_dim():
    assert candidates_of(lambda a: a[:, 0], X, target=aten.select.int) == {
        "(R) -> R", "(S(0)) -> S(0)", "(S(2)) -> S(1)", "(P) -> P"}


def test_unbind():
    assert candidates_of(lambda a: a.unbind(1)[0], X, target=aten.unbind.int) == {
        "(R) -> R", "(S(0)) -> S(0)", "(S(2)) -> S(1)", "(P) -> P"}


@pytest.mark.parametrize("fn, target", [
    (lambda a: torch.split(a, 3, dim=1)[0], aten.split.Tensor),  # split size 3 must not read as a dim
    (lambda a: torch.split(a, [2, 4], dim=1)[0], aten.split_with_sizes.default),
    (lambda a: a.chunk(2, 1)[0], aten.chunk.default),
])
def test_split_keeps_the_split_dim_whole(fn, target):
    assert candidates_of(fn, X, target=target) == {"(R) -> R", "(S(0)) -> S(0)", "(S(2)) -> S(2)", "(P) -> P"}


def test_split_on_last_dim():
    assert candidates_of(lambda a: torch.split(a, 4, dim=-1)[1], X, target=aten.split.Tensor) == {
        "(R) -> R", "(S(0)) -> S(0)", "(S(1)) -> S(1)", "(P) -> P"}


def test_cat_keeps_the_cat_dim_whole():
    got = candidates_of(lambda a, b: torch.cat([a, b], 1), X, torch.randn(4, 2, 8), target=aten.cat.default)
    assert got == {"(R, R) -> R", "(S(0), S(0)) -> S(0)", "(S(2), S(2)) -> S(2)", "(P, P) -> P"}


def test_cat_negative_dim():
    got = candidates_of(lambda a, b: torch.cat([a, b], -1), X, torch.randn(4, 6, 2), target=aten.cat.default)
    assert got == {"(R, R) -> R", "(S(0), S(0)) -> S(0)", "(S(1), S(1)) -> S(1)", "(P, P) -> P"}


def test_stack_moves_shards_past_the_new_dim():
    got = candidates_of(lambda a, b: torch.stack([a, b], 1), torch.randn(4, 6), torch.randn(4, 6),
                        target=aten.stack.default)
    assert got == {"(R, R) -> R", "(S(0), S(0)) -> S(0)", "(S(1), S(1)) -> S(2)", "(P, P) -> P"}


def test_index_select():
    got = candidates_of(lambda a, i: a.index_select(1, i), X, torch.tensor([0, 2]), target=aten.index_select.default)
    assert got == {"(R, R) -> R", "(S(0), R) -> S(0)", "(S(2), R) -> S(2)", "(P, R) -> P"}


# --- getitem -------------------------------------------------------------------------------------

def test_getitem_follows_the_producer():
    graph = export_graph(lambda a: torch.split(a, 3, dim=1)[1], X)
    assert candidate_set(find_node(graph, GETITEM)) == {"(R) -> R", "(S(0)) -> S(0)", "(S(2)) -> S(2)", "(P) -> P"}


def test_getitem_of_max_values():
    graph = export_graph(lambda a: a.max(1)[0], X)
    assert candidate_set(find_node(graph, GETITEM)) == {"(R) -> R", "(S(0)) -> S(0)", "(S(1)) -> S(1)", "(P) -> P"}
