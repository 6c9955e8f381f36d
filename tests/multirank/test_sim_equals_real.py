"""The simulator and real gloo ranks agree bit for bit (float64): same local losses, gradients, params."""
import pytest
import torch

from autoshard.api import parallelize
from autoshard.ir.mesh import Mesh
from autoshard.runtime.communicator import Communicator
from autoshard.runtime.launch import communicator_for
from autoshard.runtime.simulator import run_ranks
from autoshard.verify.training import VerifyOptions
from autoshard.verify.verify import VerifyTask, build_case, rank_run, verify_rank_task
from autoshard.zoo.hints import plan_hints


@pytest.mark.parametrize("model,mesh,names,batch,tp", [
    ("gpt2", (2, 2), ("dp", "tp"), ("dp",), "tp"),
    ("llama", (2, 2, 2), ("dp", "sp", "tp"), ("dp", "sp"), "tp"),
    ("resnet", (4,), ("dp",), ("dp",), None),
])
def test_simulator_is_bitwise_equal_to_gloo(pool, model, mesh, names, batch, tp):
    hints = plan_hints(model, names, batch, tp)
    mesh = Mesh(mesh, names)
    options = VerifyOptions(steps=2, lr=0.1)
    real = pool.run(verify_rank_task, VerifyTask(f"autoshard.zoo:{model}", mesh.to_json(), hints, options))
    m, inputs, loss_fn = build_case(f"autoshard.zoo:{model}")
    program = parallelize(m, mesh, inputs, hints=hints, loss_fn=loss_fn)
    simulated = run_ranks(program, lambda module: rank_run(module, inputs, options))
    for rank in range(mesh.size):
        a, b = real[rank], simulated[rank]
        for key in ("loss", "outputs"):
            for x, y in zip(a[key], b[key]):
                assert torch.equal(x, y), (rank, key)
        for key in ("grads", "params"):
            assert a[key].keys() == b[key].keys()
            for name in a[key]:
                assert torch.equal(a[key][name], b[key][name]), (rank, key, name)
        assert a["counts"] == b["counts"]


def _all_to_all_task(rank, world, mesh_json):
    """Each axis's all-to-all as the backend runs it and as the gathered parts give it, on this rank's tensor."""
    comm = communicator_for(Mesh.from_json(mesh_json))
    x = torch.randn(4, 8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    out = {}
    for axis in comm.mesh.names:
        for gather_dim, scatter_dim in ((0, 1), (1, 0), (2, 1)):
            native = comm.all_to_all(x, axis, gather_dim, scatter_dim)
            gathered = Communicator.all_to_all(comm, x, axis, gather_dim, scatter_dim)
            out[(axis, gather_dim, scatter_dim)] = (tuple(native.shape), torch.equal(native, gathered))
    return out


def test_the_backends_all_to_all_equals_the_gathered_one(pool):
    mesh = Mesh((2, 4), ("dp", "tp"))
    results = pool.run(_all_to_all_task, mesh.to_json())
    for rank, per in results.items():
        assert all(equal for _, equal in per.values()), (rank, per)
        assert per[("tp", 0, 1)][0] == (16, 2, 6) and per[("dp", 1, 0)][0] == (2, 16, 6), per
