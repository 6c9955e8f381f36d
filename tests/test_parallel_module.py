"""ParallelModule (parallelize without example inputs) on a world of one rank in this process: what it does with
the process group, the loss, a meta model and its parameters; the errors a user meets. 8 real ranks:
tests/multirank/test_parallel_module_gloo.py and test_readme_quickstart.py."""
import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import autoshard
from autoshard.runtime.launch import free_port
from autoshard.zoo import gpt2
from autoshard.zoo.gpt2 import gpt2_loss


class WithLoss(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, ids):
        return gpt2_loss(self.inner(ids), ids)


@pytest.fixture
def world_of_one():
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1"}
    with mock.patch.dict(os.environ, env):
        yield  # the module starts the group itself (torchrun's environment is set)
        if dist.is_initialized():
            dist.destroy_process_group()


def test_without_a_process_group_the_error_says_how_to_launch():
    model, (ids,), loss_fn = gpt2()
    module = autoshard.parallelize(model, (2,), loss_fn=loss_fn)
    with mock.patch.dict(os.environ, {}, clear=True), pytest.raises(autoshard.UserInputError, match="torchrun"):
        module(ids)


def test_a_model_that_returns_no_loss_is_told_to_give_loss_fn(world_of_one):
    model, (ids,), _ = gpt2()
    with pytest.raises(autoshard.UserInputError, match="loss_fn"):
        autoshard.parallelize(model, (1,))(ids)


def test_one_rank_trains_the_models_own_parameters_like_one_device(world_of_one):
    model, (ids,), _ = gpt2()
    reference = WithLoss(gpt2()[0])
    module = autoshard.parallelize(WithLoss(model), (1,))
    params = list(module.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for batch in (ids, ids[:4]):  # the second batch: another shape, the same plan
        loss = module(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected = reference(batch)
        expected.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert torch.allclose(loss, expected)
    assert [p is q for p, q in zip(params, module.parameters())] == [True] * len(params)
    held = [p for _, p in module.rank_module.named_local_parameters()]
    assert held and all(any(p is q for q in model.parameters()) for p in held)  # the model's own, holding shards
    assert len(module._by_shape) == 2 and "2 input shapes planned" in repr(module)


def test_a_meta_model_is_initialised_on_its_first_batch(world_of_one):
    with torch.device("meta"):
        model = WithLoss(gpt2(device="meta")[0])
    ids = gpt2()[1][0]
    module = autoshard.parallelize(model, (1,))
    loss = module(ids)
    assert torch.isfinite(loss) and all(p.device.type == "cpu" for p in module.parameters())


def test_weights_and_plan_need_the_right_mode():
    model, inputs, loss_fn = gpt2()
    with pytest.raises(autoshard.UserInputError, match="weights= and init_fn="):
        autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, weights="init")
    with pytest.raises(autoshard.UserInputError, match="plan= needs example_inputs"):
        autoshard.parallelize(model, (2,), loss_fn=loss_fn, plan="plan.json")
