"""Sharded checkpoints (DCP): save on a (2, 2) mesh, load on the same plan, on another plan, on one device.

Equality is exact (float64): loading only moves bytes. Ranks run through the shared gloo pool.
"""
import os
import pickle
from pathlib import Path

import pytest
import torch

import autoshard
from autoshard.ir.mesh import Mesh
from autoshard.ir.placement import Spec, shard_tensor, unshard_tensors
from autoshard.weights.training_checkpoint import (
    CheckpointError,
    load_checkpoint,
    read_metadata,
    save_checkpoint,
)
from autoshard.zoo import mlp

PLAN_A = ((2, 2), ("dp", "tp"), {"input:0": {"dp": "S(0)"}, "layers.0.weight": {"tp": "S(0)"},
                                 "layers.1.weight": {"tp": "S(1)"}})
PLAN_B = ((2,), ("tp",), {"layers.0.weight": {"tp": "S(1)"}, "layers.1.weight": {"tp": "S(0)"}})


def _case(hidden=16, n_layers=2):
    model, inputs, loss_fn = mlp(batch=8, in_dim=8, hidden=hidden, out_dim=8, n_layers=n_layers)
    return model.double(), tuple(x.double() for x in inputs), loss_fn


def _rank_module(rank, plan):
    from autoshard.runtime.launch import communicator_for
    mesh, names, hints = plan
    comm = communicator_for(Mesh(mesh, names), strict_world=False)
    if comm is None:
        return None, None, None
    model, inputs, loss_fn = _case()
    prog = autoshard.parallelize(model, mesh, inputs, loss_fn=loss_fn, axis_names=names, hints=hints)
    module = prog.module(rank, comm)
    return prog, module, inputs


def _state(prog, module, opt):
    params = dict(module.named_local_parameters())
    return {"specs": {f: repr(prog.param_spec(f)) for f in params},
            "params": {f: p.detach().clone() for f, p in params.items()},
            "momentum": {f: opt.state[p]["momentum_buffer"].clone() for f, p in params.items() if p in opt.state}}


def _train_and_save_task(rank, world, path, plan):
    prog, module, inputs = _rank_module(rank, plan)
    if module is None:
        return None
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    local = module.local_inputs(*inputs)
    for _ in range(2):
        opt.zero_grad()
        loss, _ = module(*local)
        loss.backward()
        module.sync_grads()
        opt.step()
    save_checkpoint(path, module, opt)
    return _state(prog, module, opt)


def _load_task(rank, world, path, plan):
    prog, module, _ = _rank_module(rank, plan)
    if module is None:
        return None
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    load_checkpoint(path, module, opt)
    return _state(prog, module, opt)


def _global(results, mesh_shape, kind):
    """{fqn: global tensor} assembled from every rank's blocks."""
    mesh = Mesh(mesh_shape)
    first = next(iter(results.values()))
    return {f: unshard_tensors({mesh.coord(r): res[kind][f] for r, res in results.items()},
                               Spec.parse(first["specs"][f]), mesh_shape) for f in first[kind]}


@pytest.fixture(scope="module")
def saved(pool, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "step2")
    results = {r: v for r, v in pool.run(_train_and_save_task, path, PLAN_A).items() if v is not None}
    return path, results


def test_load_on_the_same_plan_restores_every_shard(pool, saved):
    path, before = saved
    after = {r: v for r, v in pool.run(_load_task, path, PLAN_A).items() if v is not None}
    assert sorted(after) == [0, 1, 2, 3]
    for rank, res in after.items():
        for kind in ("params", "momentum"):
            assert res[kind].keys() == before[rank][kind].keys()
            for fqn, tensor in res[kind].items():
                assert torch.equal(tensor, before[rank][kind][fqn]), (rank, kind, fqn)


def test_load_on_another_mesh_and_sharding_reshards(pool, saved):
    path, before = saved
    after = {r: v for r, v in pool.run(_load_task, path, PLAN_B).items() if v is not None}
    assert after[0]["specs"]["layers.0.weight"] == "[S(1)]"  # really another sharding than [R, S(0)]
    for kind in ("params", "momentum"):
        expected = _global(before, PLAN_A[0], kind)
        for rank, res in after.items():
            for fqn, tensor in res[kind].items():
                block = shard_tensor(expected[fqn], Spec.parse(res["specs"][fqn]), Mesh(PLAN_B[0]).coord(rank),
                                     PLAN_B[0])
                assert torch.equal(tensor, block), (rank, kind, fqn)


def test_load_into_the_single_device_model(saved):
    path, before = saved
    model = _case()[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    load_checkpoint(path, model, opt)
    params, momentum = _global(before, PLAN_A[0], "params"), _global(before, PLAN_A[0], "momentum")
    for fqn, p in model.named_parameters():
        assert torch.equal(p.detach(), params[fqn]), fqn
        assert torch.equal(opt.state[p]["momentum_buffer"], momentum[fqn]), fqn


def test_checkpoint_of_another_model_is_a_clear_error(saved):
    path, _ = saved
    with pytest.raises(CheckpointError, match=r"'layers.0.weight' has shape \(16, 8\) in the checkpoint but "
                                              r"\(32, 8\) in the model"):
        load_checkpoint(path, _case(hidden=32)[0])
    with pytest.raises(CheckpointError, match="has no 'layers.2.bias'.*saved from another model"):
        load_checkpoint(path, _case(n_layers=3)[0])
    with pytest.raises(CheckpointError, match="'layers.0.weight' is torch.float64 in the checkpoint but "
                                              "torch.float32"):
        load_checkpoint(path, _case()[0].float())
    with pytest.raises(CheckpointError, match="not a checkpoint written by"):
        load_checkpoint(os.path.dirname(path), _case()[0])


class _Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned > boom.txt",))


def test_the_index_is_never_unpickled_freely(saved, tmp_path):
    path, _ = saved
    assert "layers.0.weight" in read_metadata(path).state_dict_metadata
    hostile = tmp_path / "hostile"
    hostile.mkdir()
    for name in os.listdir(path):
        (hostile / name).write_bytes(Path(path, name).read_bytes())
    (hostile / ".metadata").write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(CheckpointError, match="posix.system is not part of a checkpoint index|system is not part"):
        load_checkpoint(str(hostile), _case()[0])
    assert not (tmp_path / "boom.txt").exists() and not os.path.exists("boom.txt")


def test_saving_needs_real_ranks_and_parameter_shaped_optimizer_state():
    from autoshard.runtime.thread_communicator import ThreadCommunicator, ThreadHub
    from autoshard.weights.training_checkpoint import _param_state
    mesh, names, hints = PLAN_B
    model, inputs, loss_fn = _case()
    prog = autoshard.parallelize(model, mesh, inputs, loss_fn=loss_fn, axis_names=names, hints=hints)
    module = prog.module(0, ThreadCommunicator(ThreadHub(prog.mesh), 0))
    with pytest.raises(autoshard.UserInputError, match="in-process simulator"):
        save_checkpoint("unused", module)
    param = next(module.parameters())
    flat_shard = torch.zeros(param.numel() // 2)  # what a ZeRO optimizer keeps: not shaped like the parameter
    with pytest.raises(autoshard.UserInputError, match="not ZeRO's sharded optimizer state"):
        _param_state(type("Opt", (), {"state": {param: {"exp_avg": flat_shard}}})(), param, "layers.0.weight")
