"""Tests for autoshard.zoo: every factory builds, trains one step, exports, and runs on meta."""
import pytest
import torch

from autoshard.zoo import FACTORIES


def _double(inputs):
    return tuple(t.double() if t.is_floating_point() else t for t in inputs)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_forward_backward_float64(name):
    model, inputs, loss_fn = FACTORIES[name]()
    assert isinstance(inputs, tuple)
    model = model.double()
    inputs = _double(inputs)
    out = model(*inputs)
    loss = loss_fn(out, *inputs)
    assert loss.dim() == 0
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_export_matches_eager(name):
    model, inputs, loss_fn = FACTORIES[name]()
    with torch.no_grad():
        expected = model(*inputs)
        ep = torch.export.export(model, inputs)
        actual = ep.module()(*inputs)
    torch.testing.assert_close(actual, expected)
    # The loss is traceable as a function of (output, *inputs).
    torch.testing.assert_close(loss_fn(actual, *inputs), loss_fn(expected, *inputs))


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_meta_device(name):
    model, inputs, loss_fn = FACTORIES[name](device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    assert all(t.device.type == "meta" for t in inputs)
    out = model(*inputs)
    assert out.device.type == "meta"
    assert loss_fn(out, *inputs).dim() == 0


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_gpt2_weight_tying(device):
    model, _, _ = FACTORIES["gpt2"](device=device)
    assert model.lm_head.weight is model.wte.weight


def test_llama_gqa_shapes():
    model, _, _ = FACTORIES["llama"]()
    cfg = model.cfg
    assert cfg.n_kv_heads < cfg.n_heads
    for layer in model.layers:
        assert layer.attn.q.out_features == cfg.n_heads * cfg.head_dim
        assert layer.attn.k.out_features == cfg.n_kv_heads * cfg.head_dim
        assert layer.attn.v.out_features == cfg.n_kv_heads * cfg.head_dim
    assert "rope_cos" not in model.state_dict()


def test_factories_reproducible():
    for name, factory in FACTORIES.items():
        (m1, i1, _), (m2, i2, _) = factory(), factory()
        for a, b in zip(i1, i2):
            assert torch.equal(a, b), name
        for a, b in zip(m1.parameters(), m2.parameters()):
            assert torch.equal(a, b), name


def test_custom_sizes():
    model, (ids,), _ = FACTORIES["gpt2"](batch=2, seq=32, dim=64, n_heads=8, vocab_size=128)
    assert model(ids).shape == (2, 32, 128)
