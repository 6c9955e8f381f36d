"""Mesh: validation errors, row-major coordinates, axis groups, JSON."""
import math

import pytest
from fuzzing import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from autoshard.ir.mesh import Mesh


def test_repr_coord_and_groups():
    mesh = Mesh((2, 4), ("dp", "tp"))
    assert repr(mesh) == "Mesh(dp=2, tp=4)"
    assert mesh.ndim == 2 and mesh.size == 8
    assert mesh.coord(5) == (1, 1)
    assert mesh.rank((1, 1)) == 5
    assert mesh.axis_group(5, "tp") == (4, 5, 6, 7)
    assert mesh.axis_group(5, "dp") == (1, 5)
    assert mesh.axis_group(5, 0) == (1, 5)
    assert mesh.axis_groups("dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert mesh.axis_groups("tp") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert mesh.coords()[:3] == [(0, 0), (0, 1), (0, 2)]


def test_three_axes_row_major():
    mesh = Mesh((2, 3, 2), ("pp", "dp", "tp"))
    assert [mesh.coord(r) for r in (0, 1, 2, 6, 11)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (1, 2, 1)]
    assert mesh.axis_group(7, "dp") == (7, 9, 11)
    assert mesh.axis_group(7, "pp") == (1, 7)


def test_unnamed_mesh_names_axes():
    mesh = Mesh((2, 2))
    assert mesh.names == ("a0", "a1") and not mesh.named
    assert Mesh((2,), ("dp",)).named


def test_int_shape():
    assert Mesh(4).shape == (4,)
    assert Mesh.of(4).shape == (4,)
    assert Mesh.of([2, 2], ("dp", "tp")).names == ("dp", "tp")


def test_of_keeps_a_mesh_and_checks_names():
    mesh = Mesh((2, 2), ("dp", "tp"))
    assert Mesh.of(mesh) is mesh
    assert Mesh.of(mesh, ("dp", "tp")) is mesh
    with pytest.raises(ValueError, match="disagree"):
        Mesh.of(mesh, ("tp", "dp"))


@pytest.mark.parametrize("shape, names, match", [
    ((0, 2), None, "positive integer size"),
    ((2, -1), None, "positive integer size"),
    ((2.0,), None, "positive integer size"),
    ((True, 2), None, "positive integer size"),
    ((), None, "non-empty"),
    ((2, 2), ("dp", "dp"), "repeat"),
    ((2, 2), ("dp",), r"2 axes but .*1"),
    ((2,), ("dp", "tp"), r"1 axes but .*2"),
    ((2,), ("1x",), "not an identifier"),
    ((2,), (3,), "not an identifier"),
    ((2,), "dp", None),  # a bare string is not a tuple of names
])
def test_invalid_meshes(shape, names, match):
    with pytest.raises(ValueError, match=match):
        Mesh(shape, names)


def test_unknown_axis_lists_the_names():
    mesh = Mesh((2, 2), ("dp", "tp"))
    with pytest.raises(ValueError, match=r"unknown mesh axis 'pp'.*\['dp', 'tp'\]"):
        mesh.axis("pp")
    with pytest.raises(ValueError, match="unknown mesh axis 2"):
        mesh.axis(2)


@pytest.mark.parametrize("mesh", [Mesh((2, 4), ("dp", "tp")), Mesh((2, 2, 2)), Mesh((3,), ("x",))])
def test_json_round_trip(mesh):
    back = Mesh.from_json(mesh.to_json())
    assert back == mesh and back.named == mesh.named and back.names == mesh.names


@fuzz_settings(60)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=3))
def test_coords_and_groups(shape):
    mesh = Mesh(tuple(shape))
    assert mesh.size == math.prod(shape)
    assert [mesh.coord(r) for r in range(mesh.size)] == mesh.coords()
    assert all(mesh.rank(mesh.coord(r)) == r for r in range(mesh.size))
    for axis in range(mesh.ndim):
        groups = mesh.axis_groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(mesh.size))  # a partition of the ranks
        for group in groups:
            assert len(group) == shape[axis]
            coords = [mesh.coord(r) for r in group]
            assert [c[axis] for c in coords] == list(range(shape[axis]))  # ordered by the axis coordinate
            assert len({c[:axis] + c[axis + 1:] for c in coords}) == 1  # every other coordinate shared
            assert all(mesh.axis_group(r, axis) == group for r in group)
