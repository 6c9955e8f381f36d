"""Properties of the dimension-mapping algebra (`reshape_groups`, `reshape_dim_map`) on random factorizations."""
import itertools
import math

import torch
from fuzzing import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from autoshard.ir.placement import R, S, Spec, local_shape, shard_tensor
from autoshard.strategies.views import reshape_dim_map, reshape_groups

SETTINGS = fuzz_settings(150)


@st.composite
def factorizations(draw):
    """Two shapes of equal product: one list of factors grouped two ways, with size-1 dims sprinkled in."""
    atoms = draw(st.lists(st.integers(2, 5), min_size=0, max_size=6))

    def group(values):
        cuts = sorted(draw(st.sets(st.integers(1, max(len(values) - 1, 1)), max_size=len(values))))
        cuts = [c for c in cuts if 0 < c < len(values)]
        bounds = [0, *cuts, len(values)]
        shape = [math.prod(values[a:b]) for a, b in itertools.pairwise(bounds) if b > a]
        for _ in range(draw(st.integers(0, 2))):
            shape.insert(draw(st.integers(0, len(shape))), 1)
        return tuple(shape)
    return group(atoms), group(atoms)


@SETTINGS
@given(factorizations())
def test_groups_cover_both_shapes_in_order(shapes):
    in_shape, out_shape = shapes
    groups = reshape_groups(in_shape, out_shape)
    assert [d for ins, _ in groups for d in ins] == list(range(len(in_shape))), groups
    assert [d for _, outs in groups for d in outs] == list(range(len(out_shape))), groups


@SETTINGS
@given(factorizations())
def test_group_products_match(shapes):
    in_shape, out_shape = shapes
    for ins, outs in reshape_groups(in_shape, out_shape):
        assert math.prod(in_shape[i] for i in ins) == math.prod(out_shape[o] for o in outs), (ins, outs)
        if not ins or not outs:  # a one-sided group is a lone size-1 dim
            assert len(ins) + len(outs) == 1
            assert [in_shape[i] for i in ins] + [out_shape[o] for o in outs] == [1]


@SETTINGS
@given(factorizations())
def test_groups_are_minimal(shapes):
    """No group splits into two consecutive groups of equal products (else a shard could map further)."""
    in_shape, out_shape = shapes
    for ins, outs in reshape_groups(in_shape, out_shape):
        if not ins or not outs:
            continue
        for a in range(1, len(ins)):
            for b in range(1, len(outs)):
                head_in = math.prod(in_shape[i] for i in ins[:a])
                head_out = math.prod(out_shape[o] for o in outs[:b])
                assert head_in != head_out or head_in == 1, (ins, outs, a, b)


@SETTINGS
@given(factorizations())
def test_dim_map_preserves_order(shapes):
    in_shape, out_shape = shapes
    pairs = sorted(reshape_dim_map(in_shape, out_shape).items())
    assert [o for _, o in pairs] == sorted(o for _, o in pairs)
    assert len({o for _, o in pairs}) == len(pairs)


@fuzz_settings(120)
@given(factorizations(), st.lists(st.integers(1, 3), min_size=1, max_size=2), st.data())
def test_mapped_shards_are_the_local_blocks_of_the_reshape(shapes, mesh_shape, data):
    """Sharding input dim i and reshaping each block locally equals sharding the reshaped tensor on the
    mapped dim, on one or two nested mesh axes (the solver checks divisibility on local shapes)."""
    in_shape, out_shape = shapes
    dim_map = sorted(reshape_dim_map(in_shape, out_shape).items())
    choices = [None] + dim_map
    picked = [data.draw(st.sampled_from(choices)) for _ in mesh_shape]
    in_spec = Spec(R if p is None else S(p[0]) for p in picked)
    out_spec = Spec(R if p is None else S(p[1]) for p in picked)
    try:
        local_in = local_shape(in_shape, in_spec, mesh_shape)
        local_out = local_shape(out_shape, out_spec, mesh_shape)
    except ValueError:
        return  # not feasible on this mesh: the solver drops it
    x = torch.arange(math.prod(in_shape)).reshape(in_shape)
    y = x.reshape(out_shape)
    for coord in itertools.product(*(range(k) for k in mesh_shape)):
        block = shard_tensor(x, in_spec, coord, mesh_shape)
        assert block.shape == local_in
        expected = shard_tensor(y, out_spec, coord, mesh_shape)
        assert torch.equal(block.reshape(local_out), expected), (in_shape, out_shape, in_spec, out_spec, coord)
