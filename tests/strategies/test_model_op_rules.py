"""Rules for the ops transformers models emit (issue 13): each candidate set is exact, and every candidate
runs on 2 (and, where the shapes allow, 4) ranks and equals the single device (`check_candidates`)."""
import pytest
import torch
import torch.nn.functional as F
from rule_graphs import aten, check_candidates

X = torch.randn(4, 6, 8, dtype=torch.float64)
SHARDS3 = {"(S(0)) -> S(0)", "(S(1)) -> S(1)", "(S(2)) -> S(2)"}


# --- transformers' mask building (Llama, Mistral, Qwen, Gemma, Phi-3, GPT-NeoX, GPT-2) -------------------

def test_diff_with_prepend_shards_the_other_dims_and_passes_partials():
    """Packed-sequence detection: position_ids.diff(dim=-1, prepend=position_ids[:, :1] - 1)."""
    got = check_candidates(lambda a: torch.diff(a, dim=-1, prepend=a[:, :1] - 1), X[:, :, 0],
                           target=aten.diff.default)
    assert got == {"(R, R) -> R", "(S(0), S(0)) -> S(0)", "(P, P) -> P"}


def test_diff_twice_along_a_middle_dim():
    got = check_candidates(lambda a: torch.diff(a, n=2, dim=1), X, target=aten.diff.default)
    assert got == {"(R) -> R", "(S(0)) -> S(0)", "(S(2)) -> S(2)", "(P) -> P"}


def test_diff_of_integers_has_no_partial_shares_to_lose():
    got = check_candidates(lambda a: torch.diff(a, dim=0), torch.arange(24).view(4, 6), target=aten.diff.default)
    assert got == {"(R) -> R", "(S(1)) -> S(1)", "(P) -> P"}


@pytest.mark.parametrize("make, target, values", [
    (lambda a: a.new_ones((4, 6)), aten.new_ones.default, True),
    (lambda a: a.new_zeros((2, 4, 6)), aten.new_zeros.default, True),
    (lambda a: a.new_full((4, 6), 3.0), aten.new_full.default, True),
    (lambda a: a.new_empty((4, 6)), aten.new_empty.default, False),  # uninitialized: shapes only
])
def test_new_tensor_reads_only_dtype_so_any_placement_works(make, target, values):
    got = check_candidates(make, X[:, :, 0], target=target, compare_values=values)
    ins = ["R", "P", "S(0)", "S(1)"]
    outs = ["R"] + [f"S({d})" for d in range(len(make(X).shape))]
    assert got == {f"({i}) -> {o}" for i in ins for o in outs}


def test_new_ones_as_a_scalar_mask():
    """transformers' `cache_position.new_ones((), dtype=torch.bool)`: a 0-d output, replicated."""
    got = check_candidates(lambda a: a.new_ones((), dtype=torch.bool) & (a > 0), X[:, :, 0],
                           target=aten.new_ones.default)
    assert got == {"(R) -> R", "(P) -> R", "(S(0)) -> R", "(S(1)) -> R"}


def test_bitwise_and_of_masks():
    a, b = X > 0, X[0, :, :1] < 0.5  # b [6, 1] broadcasts over dims 0 and 2
    got = check_candidates(lambda a, b: a & b, a, b, target=aten.__and__.Tensor)
    assert got == {"(R, R) -> R", "(S(0), R) -> S(0)", "(S(1), S(0)) -> S(1)", "(S(2), R) -> S(2)"}


@pytest.mark.parametrize("dtype, partial", [(torch.float32, True), (torch.int64, False), (torch.bool, False)])
def test_to_device_passes_partials_only_into_a_floating_type(dtype, partial):
    got = check_candidates(lambda a: a.to("cpu", dtype) * 1, X, target=aten.to.device)
    assert got == {"(R) -> R", *SHARDS3} | ({"(P) -> P"} if partial else set())


@pytest.mark.parametrize("fn, target", [
    (lambda a: a.to(torch.int32), aten.to.dtype),
    (lambda a: a.cumsum(0, dtype=torch.int64), aten.cumsum.default),
    (lambda a: a.sum(1, dtype=torch.int64), aten.sum.dim_IntList),
])
def test_float_to_int_casts_keep_partials_out(fn, target):
    """trunc(a) + trunc(b) != trunc(a + b): a partial float cast to an integer type is not a partial sum."""
    got = check_candidates(fn, X * 10, target=target)
    assert "(P) -> P" not in got and "(R) -> R" in got


# --- Falcon: x @ W.T; eager attention's masking -------------------------------------------------------

def test_numpy_t_reverses_the_dims():
    got = check_candidates(lambda w: w.T * 1, X[0], target=aten.numpy_T.default)
    assert got == {"(R) -> R", "(S(0)) -> S(1)", "(S(1)) -> S(0)", "(P) -> P"}


def test_where_with_a_scalar_other():
    got = check_candidates(lambda a: torch.where(a > 0, a, -1e9), X, target=aten.where.ScalarOther)
    assert got == {"(R, R) -> R", "(S(0), S(0)) -> S(0)", "(S(1), S(1)) -> S(1)", "(S(2), S(2)) -> S(2)"}


def test_minimum_with_other():
    """T5's relative buckets: torch.min(large, torch.full_like(large, num_buckets - 1))."""
    got = check_candidates(lambda a, b: torch.min(a, b), X, X[0, 0] * 0, target=aten.min.other)
    assert got == {"(R, R) -> R", "(S(0), R) -> S(0)", "(S(1), R) -> S(1)", "(S(2), S(0)) -> S(2)"}


def test_in_place_div_shards_like_its_operand():
    got = check_candidates(lambda a: a.clone().div_(a.sum(-1, keepdim=True)), X, target=aten.div_.Tensor)
    assert got == {"(R, R) -> R", "(S(0), S(0)) -> S(0)", "(S(1), S(1)) -> S(1)", "(S(2), R) -> S(2)"}


def test_cat_onto_an_empty_cache_skips_it():
    """transformers' DynamicCache.update on its first call: torch.cat([tensor([]), key], dim=-2)."""
    got = check_candidates(lambda a: torch.cat([torch.tensor([], dtype=a.dtype), a], dim=-2), X,
                           target=aten.cat.default)
    assert got == {"(R, R) -> R", "(R, S(0)) -> S(0)", "(R, S(2)) -> S(2)", "(R, P) -> P"}


# --- padding ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, partial", [({}, True), ({"value": 1.5}, False), ({"mode": "reflect"}, True),
                                             ({"mode": "replicate"}, True)])
def test_pad_keeps_padded_dims_whole(kwargs, partial):
    got = check_candidates(lambda a: F.pad(a, (1, 2), **kwargs), X, target=aten.pad.default)
    assert got == {"(R) -> R", "(S(0)) -> S(0)", "(S(1)) -> S(1)"} | ({"(P) -> P"} if partial else set())


@pytest.mark.parametrize("value, partial", [(0.0, True), (-1.0, False)])
def test_constant_pad_nd_of_two_dims(value, partial):
    got = check_candidates(lambda a: torch.constant_pad_nd(a, (0, 0, 1, 1), value), X,
                           target=aten.constant_pad_nd.default)
    assert got == {"(R) -> R", "(S(0)) -> S(0)", "(S(2)) -> S(2)"} | ({"(P) -> P"} if partial else set())


# --- Mixtral's router and experts ---------------------------------------------------------------------

def test_topk_keeps_its_dim_whole():
    got = check_candidates(lambda a: torch.topk(a, 2, dim=1), X, target=aten.topk.default)
    assert got == {"(R) -> R", "(S(0)) -> S(0)", "(S(2)) -> S(2)"}


def test_topk_on_the_last_dim_by_default():
    got = check_candidates(lambda a: a.topk(3), X, target=aten.topk.default, axis_size=4)
    assert got == {"(R) -> R", "(S(0)) -> S(0)"}  # 6 rows do not split in 4


def test_histc_counts_add_up_over_shards():
    ids = torch.randint(0, 4, (16,)).double()
    got = check_candidates(lambda a: torch.histc(a, bins=4, min=0, max=3), ids, target=aten.histc.default,
                           axis_size=4)
    assert got == {"(R) -> R", "(S(0)) -> P"}


def test_histc_without_a_range_stays_whole():
    got = check_candidates(lambda a: torch.histc(a, bins=4), X.flatten(), target=aten.histc.default)
    assert got == {"(R) -> R"}


def test_floor_divide_is_elementwise():
    got = check_candidates(lambda a: a // 2, torch.arange(24).view(4, 6), target=aten.floor_divide.default)
    assert got == {"(R) -> R", "(S(0)) -> S(0)", "(S(1)) -> S(1)"}


def test_index_put_in_place_runs_replicated():
    def inverse(order):
        out = torch.empty_like(order)
        out[order] = torch.arange(order.numel())
        return out
    got = check_candidates(inverse, torch.randperm(8), target=aten.index_put_.default)
    assert got == {"(R, R, R) -> R"}


def test_grouped_mm_shards_the_expert_features():
    """transformers' grouped matmul (x sorted by expert, offs = cumulative rows per expert)."""
    pytest.importorskip("transformers.integrations.moe")
    op = torch.ops.transformers.grouped_mm_fallback
    x, w, offs = torch.randn(10, 8, dtype=torch.float64), torch.randn(3, 8, 6, dtype=torch.float64), torch.tensor(
        [3, 3, 10])
    got = check_candidates(lambda x, w, o: op(x, w, o), x, w, offs, target=op.default)
    assert got == {"(R, R, R) -> R", "(R, S(2), R) -> S(1)", "(S(1), S(1), R) -> P", "(P, R, R) -> P",
                   "(R, P, R) -> P"}


def test_index_by_one_tensor_shards_the_other_dims_and_the_ids():
    """MoE dispatch `hidden[perm // top_k]` and batched_mm's `gate_up_proj[expert_ids]`."""
    ids = torch.tensor([[3, 0], [1, 1], [2, 3], [0, 2]])
    got = check_candidates(lambda a, i: a[i], X, ids, target=aten.index.Tensor)
    assert got == {"(R, R) -> R", "(S(1), R) -> S(2)", "(S(2), R) -> S(3)", "(R, S(0)) -> S(0)", "(R, S(1)) -> S(1)",
                   "(P, R) -> P"}


def test_index_on_a_later_dim():
    """Falcon's new decoder architecture picks each group's key and value: qkv[:, :, :, [-2]]."""
    got = check_candidates(lambda a, i: a[:, :, i], X, torch.tensor([[7], [0]]), target=aten.index.Tensor)
    assert got == {"(R, R) -> R", "(S(0), R) -> S(0)", "(S(1), R) -> S(1)", "(R, S(0)) -> S(2)", "(P, R) -> P"}


def test_index_with_several_index_tensors_runs_replicated():
    got = check_candidates(lambda a, i: a[i, i], X, torch.tensor([0, 2]), target=aten.index.Tensor)
    assert got == {"(R, R, R) -> R"}


def test_broadcast_to_shards_like_expand():
    """Falcon's new decoder architecture broadcasts its grouped key/value heads with broadcast_to."""
    got = check_candidates(lambda a: torch.broadcast_to(a[:, None], (4, 2, 6, 8)), X, target=aten.broadcast_to.default)
    assert got == {"(R) -> R", "(S(0)) -> S(0)", "(R) -> S(1)", "(S(2)) -> S(2)", "(S(3)) -> S(3)", "(P) -> P"}


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_repeat_interleave_keeps_blocks_on_every_dim(dim):
    """The batched_mm experts repeat each token top_k times in a row (dim 0)."""
    got = check_candidates(lambda a: a.repeat_interleave(2, dim=dim), X, target=aten.repeat_interleave.self_int)
    assert got == {"(R) -> R", *SHARDS3, "(P) -> P"}


def test_repeat_interleave_of_the_flattened_tensor_runs_replicated():
    got = check_candidates(lambda a: a.repeat_interleave(2), X, target=aten.repeat_interleave.self_int)
    assert got == {"(R) -> R"}


def test_repeat_tiles_dims_that_stay_whole():
    got = check_candidates(lambda a: a.repeat(3, 1, 2, 1), X, target=aten.repeat.default)
    assert got == {"(R) -> R", "(S(0)) -> S(1)", "(S(2)) -> S(3)", "(P) -> P"}


def test_gather_shards_the_dims_x_and_ids_both_hold_whole():
    """RoBERTa's position ids: buffered_token_type_ids.gather(1, position_ids)."""
    ids = torch.randint(0, 8, (4, 6, 5))
    got = check_candidates(lambda a, i: a.gather(2, i), X, ids, target=aten.gather.default)
    assert got == {"(R, R) -> R", "(S(0), S(0)) -> S(0)", "(S(1), S(1)) -> S(1)", "(P, R) -> P"}  # 5 ids: no S(2)


def test_gather_from_smaller_ids():
    ids = torch.randint(0, 6, (2, 6, 8))  # 2 of the 4 rows: dim 0 of x cannot shard with the ids
    got = check_candidates(lambda a, i: a.gather(1, i), X, ids, target=aten.gather.default)
    assert got == {"(R, R) -> R", "(R, S(1)) -> S(1)", "(S(2), S(2)) -> S(2)", "(P, R) -> P"}
