"""Real process groups: a mesh that does not match the world is a clear error, on every rank."""
import pytest

from autoshard.ir.errors import AutoshardError
from autoshard.ir.mesh import Mesh


def _communicator_task(rank, world, mesh_json):
    from autoshard.runtime.launch import communicator_for
    communicator_for(Mesh.from_json(mesh_json))
    return "no error"


def _too_big_task(rank, world):
    from autoshard.runtime.launch import device_mesh
    device_mesh(Mesh((4, 4), ("dp", "tp")))


def test_mesh_size_must_equal_world_size(pool):
    with pytest.raises(AutoshardError, match=r"mesh Mesh\(dp=2, tp=2\) has 4 devices but the world size is 8"):
        pool.run(_communicator_task, Mesh((2, 2), ("dp", "tp")).to_json())


def test_mesh_larger_than_world_says_how_many_ranks_to_launch(pool):
    with pytest.raises(AutoshardError, match=r"needs 16 ranks but the process group has 8"):
        pool.run(_too_big_task)
