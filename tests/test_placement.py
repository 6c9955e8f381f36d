"""Placements and specs: parsing, printing, describe_type, local shapes, shard/unshard round trips."""
import itertools
import math

import pytest
import torch
from fuzzing import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from autoshard.ir.placement import (
    P,
    Partial,
    R,
    Replicate,
    S,
    Shard,
    Spec,
    describe_type,
    local_shape,
    parse_placement,
    shard_index,
    shard_tensor,
    unshard_tensors,
)

# --- placements and specs ------------------------------------------------------------------------

def test_placements_print_and_compare():
    assert (repr(S(1)), repr(R), repr(P)) == ("S(1)", "R", "P")
    assert S(0) == Shard(0) and S(0) != S(1) and R == Replicate() and P == Partial()
    assert len({S(0), Shard(0), R, Replicate(), P}) == 3


@pytest.mark.parametrize("text, spec", [
    ("[S(0), R]", Spec([S(0), R])),
    ("[ S( 1 ) ,P, R ]", Spec([S(1), P, R])),
    ("[R]", Spec([R])),
    ("[]", Spec()),
    ("[S(-1)]", Spec([S(-1)])),
])
def test_spec_parse(text, spec):
    assert Spec.parse(text) == spec


@pytest.mark.parametrize("spec", [Spec([S(0), R]), Spec([P, S(2), R]), Spec([R]), Spec()])
def test_spec_repr_round_trip(spec):
    assert Spec.parse(repr(spec)) == spec


def test_spec_repr():
    assert repr(Spec([S(0), R, P])) == "[S(0), R, P]"
    assert repr(Spec()) == "[]"


@pytest.mark.parametrize("text", ["S(0), R", "[S0]", "[S(0), Q]", "[S(x)]", "[Shard(0)]", "(R, R)"])
def test_malformed_spec(text):
    with pytest.raises(ValueError, match="malformed"):
        Spec.parse(text)


def test_malformed_placement_says_where():
    with pytest.raises(ValueError, match=r"malformed placement 'X' in hints\['w'\].*S\(<dim>\)"):
        parse_placement("X", "hints['w']")
    with pytest.raises(ValueError, match="malformed"):
        parse_placement(3)


def test_spec_is_an_immutable_hashable_tuple():
    spec = Spec([S(0), R])
    assert spec == (S(0), R) and hash(spec) == hash(Spec.parse("[S(0), R]"))
    assert {spec: 1}[Spec([S(0), R])] == 1
    changed = spec.with_axis(1, S(1))
    assert changed == Spec([S(0), S(1)]) and spec == Spec([S(0), R]) and isinstance(changed, Spec)


def test_spec_queries():
    spec = Spec([S(0), P, S(0), R, P])
    assert spec.axes_sharding(0) == (0, 2)
    assert spec.axes_sharding(1) == ()
    assert spec.partial_axes() == (1, 4)
    assert not spec.is_replicated()
    assert Spec.replicated(3) == Spec([R, R, R]) and Spec.replicated(3).is_replicated()


# --- describe_type -------------------------------------------------------------------------------

@pytest.mark.parametrize("shape, spec, dtype, text", [
    ((8, 512), Spec([S(0), R]), "f32", "f32[8@dp, 512]"),
    ((8, 512), Spec([S(0), S(1)]), "f32", "f32[8@dp, 512@tp]"),
    ((8, 512), Spec([S(0), S(0)]), "f32", "f32[8@dp@tp, 512]"),
    ((8, 512), Spec([P, S(1)]), "f32", "f32[8, 512@tp]{P@dp}"),
    ((8, 512), Spec([P, P]), "f32", "f32[8, 512]{P@dp,tp}"),
    ((8, 512), None, "f32", "f32[8, 512]"),
    ((8,), Spec([R, R]), torch.bfloat16, "bf16[8]"),
    ((4, 2), Spec([R, S(1)]), torch.int64, "i64[4, 2@tp]"),
    ((), Spec([P, R]), torch.float64, "f64[]{P@dp}"),
    ((3,), None, torch.complex64, "complex64[3]"),
])
def test_describe_type(shape, spec, dtype, text):
    assert describe_type(shape, spec, ("dp", "tp"), dtype) == text


# --- local shapes and blocks ---------------------------------------------------------------------

def test_local_shape_nested():
    assert local_shape((12, 8), Spec([S(0), S(0), S(1)]), (2, 3, 4)) == (2, 2)
    assert local_shape((12, 8), Spec([P, R, S(1)]), (2, 3, 4)) == (12, 2)


def test_local_shape_error_names_dim_and_axis():
    with pytest.raises(ValueError, match=r"dim 0 of size 6 does not split evenly over mesh axis 1 of size 4"):
        local_shape((6, 8), Spec([S(0), S(0)]), (2, 4))


def test_nested_shard_order_outer_axis_is_coarser():
    x = torch.arange(12)
    mesh = (2, 3)
    spec = Spec([S(0), S(0)])
    for a, b in itertools.product(range(2), range(3)):
        assert shard_index(spec, 0, (a, b), mesh) == (a * 3 + b, 6)
        assert shard_tensor(x, spec, (a, b), mesh).tolist() == [2 * (a * 3 + b), 2 * (a * 3 + b) + 1]


def test_shard_two_dims_on_two_axes():
    x = torch.arange(16).reshape(4, 4)
    block = shard_tensor(x, Spec([S(1), S(0)]), (1, 0), (2, 2))
    assert block.tolist() == [[2, 3], [6, 7]]


def test_partial_block_lives_on_axis_coordinate_zero():
    x = torch.ones(2, 2)
    assert torch.equal(shard_tensor(x, Spec([P]), (0,), (3,)), x)
    assert torch.equal(shard_tensor(x, Spec([P]), (2,), (3,)), torch.zeros(2, 2))


def test_shard_tensor_rejects_uneven_split():
    with pytest.raises(ValueError, match="does not split evenly"):
        shard_tensor(torch.zeros(5), Spec([S(0)]), (0,), (2,))


def test_unshard_sums_partials():
    blocks = {(0, 0): torch.tensor([1.0, 2.0]), (1, 0): torch.tensor([10.0, 20.0]),
              (0, 1): torch.tensor([3.0, 4.0]), (1, 1): torch.tensor([30.0, 40.0])}
    assert unshard_tensors(blocks, Spec([P, S(0)]), (2, 2)).tolist() == [11.0, 22.0, 33.0, 44.0]


@st.composite
def sharded_cases(draw):
    mesh_shape = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    ndim = draw(st.integers(0, 3))
    spec = Spec(draw(st.sampled_from([R, P] + [S(d) for d in range(ndim)])) for _ in mesh_shape)
    shape = tuple(math.prod(mesh_shape[a] for a in spec.axes_sharding(d)) * draw(st.integers(1, 3))
                  for d in range(ndim))
    return mesh_shape, spec, shape


@fuzz_settings(150)
@given(sharded_cases())
def test_shard_unshard_round_trip(case):
    mesh_shape, spec, shape = case
    x = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    coords = list(itertools.product(*(range(n) for n in mesh_shape)))
    blocks = {c: shard_tensor(x, spec, c, mesh_shape) for c in coords}
    expected_local = local_shape(shape, spec, mesh_shape)
    assert all(b.shape == expected_local for b in blocks.values())
    assert torch.equal(unshard_tensors(blocks, spec, mesh_shape), x), (mesh_shape, spec, shape)
    if not spec.partial_axes():  # every element lives on exactly prod(replicating axes) ranks
        copies = math.prod(n for n, p in zip(mesh_shape, spec) if isinstance(p, Replicate))
        seen = torch.cat([b.flatten() for b in blocks.values()]) if shape else torch.stack(list(blocks.values()))
        assert torch.equal(torch.bincount(seen.long(), minlength=x.numel()),
                           torch.full((x.numel(),), copies))
