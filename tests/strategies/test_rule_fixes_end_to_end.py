"""End-to-end regressions for rule bugs: each model trains exactly like the single device when a hint
shards the dim the rule once misread (split/chunk dims, var keepdim, norm dims, sort, 3-D sdpa)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoshard.verify.verify import verify_simulated


class Fn(nn.Module):
    """`fn` after a linear layer (or, with `first`, on the input and then the linear layer)."""

    def __init__(self, fn, d, first=False):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.fn = fn
        self.first = first

    def forward(self, x):
        return self.fc(self.fn(x)) if self.first else self.fn(self.fc(x))


def _chunk_mix(h):
    a, b, c = h.chunk(3, dim=1)  # aten.chunk(h, 3, 1): the 3 once read as the dim (3 % 3 = 0)
    return a * b + c


def _split_mix(h):
    a, b = torch.split(h, 6, dim=1)  # aten.split(h, 6, 1): 6 % 3 = 0 once read as the dim
    return a * torch.tanh(b)


def _var_over_batch(h):
    # var.dim(h, [0], False, True): unbiased=False once read as keepdim, mapping S(2) to S(1)
    return h.var(0, unbiased=False, keepdim=True) * h


def _attention_3d(h):
    return F.scaled_dot_product_attention(h, h, h)  # [B, L, E]: L must stay whole for the keys


# Odd batch and feature sizes leave the hinted dim as the only one that splits over 2, so a rule that
# wrongly allows it is also the cheapest plan.
CASES = {
    "chunk along the sharded dim": (_chunk_mix, (3, 12, 3), {"input:0": {"dp": "S(1)"}}),
    "split along the sharded dim": (_split_mix, (3, 12, 3), {"input:0": {"dp": "S(1)"}}),
    "var.dim reads keepdim after unbiased": (_var_over_batch, (3, 4, 4), {"input:0": {"dp": "S(2)"}}),
    "vector_norm reads dims after the order": (lambda h: torch.linalg.vector_norm(h, 2, 1)[:, None] * h,
                                               (3, 4, 2), {"input:0": {"dp": "S(1)"}}),
    "sort without a dim": (lambda h: h.sort()[0], (4, 6, 4), {"input:0": {"dp": "S(0)"}}),
    "sdpa on 3-D inputs": (_attention_3d, (3, 4, 3), {"input:0": {"dp": "S(1)"}}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_fix_end_to_end(name):
    fn, shape, hints = CASES[name]
    torch.manual_seed(0)
    model = Fn(fn, shape[-1], first=name.startswith("var"))
    x = torch.randn(shape)
    report, program = verify_simulated(model, (x,), mesh=(2,), axis_names=("dp",), hints=hints)
    assert report.ok, f"{name}\n{report!r}\n{program.plan.summary()}"
