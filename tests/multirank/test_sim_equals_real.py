"""The simulator and real gloo ranks agree bit for bit (float64): same local losses, gradients, params."""
import pytest
import torch

from autoshard.api import parallelize
from autoshard.ir.mesh import Mesh
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
