"""End-to-end regressions for rule bugs: each model trains exactly like the single device when a hint
shards the dim the rule once misread (split/chunk dims, var/std keepdim, norm dims, sort, 3-D sdpa)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autoshard.verify import verify_simulated


class Fn(nn.Module):
    def __init__(self, fn, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.fc(x))


def _chunk_mix(h):
    a, b, c = h.chunk(3, dim=1)  # aten.chunk(h, 3, 1): 3 once read as the dim (3 % 3 = 0)
    return a * b + c


def _split_mix(h):
    a, b = torch.split(h, 3, dim=1)
    return a * torch.tanh(b)


def _attention_3d(h):
    return F.scaled_dot_product_attention(h, h, h)  # [B, L, E]: L must stay whole for the keys


CASES = {
    "chunk along the sharded dim": (_chunk_mix, (4, 6, 4), {"input:0": {"dp": "S(1)"}}),
    "split along the sharded dim": (_split_mix, (4, 6, 4), {"input:0": {"dp": "S(1)"}}),
    "var keepdim after unbiased": (lambda h: h.var(1, unbiased=False, keepdim=True) * h, (4, 6, 4),
                                   {"input:0": {"dp": "S(2)"}}),
    "std over a sharded dim": (lambda h: h.std(2, unbiased=True, keepdim=True) + h, (4, 6, 4),
                               {"input:0": {"dp": "S(2)"}}),
    "vector_norm dims after the order": (lambda h: torch.linalg.vector_norm(h, 2, 1)[:, None] * h, (4, 6, 4),
                                         {"input:0": {"dp": "S(1)"}}),
    "sort without a dim": (lambda h: h.sort()[0], (4, 6, 4), {"input:0": {"dp": "S(0)"}}),
    "sdpa on 3-D inputs": (_attention_3d, (4, 6, 4), {"input:0": {"dp": "S(1)"}}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_fix_end_to_end(name):
    fn, shape, hints = CASES[name]
    torch.manual_seed(0)
    model = Fn(fn, shape[-1])
    x = torch.randn(shape)
    report, program = verify_simulated(model, (x,), mesh=(2,), axis_names=("dp",), hints=hints)
    assert report.ok, f"{name}\n{report!r}\n{program.plan.summary()}"
