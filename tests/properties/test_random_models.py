"""Tier 2: random small models x random meshes x random hints -> the simulated parallel program trains
exactly like the single device (loss, outputs, gradients, parameters after SGD, float64).

A model is a chain of ops on a [B, T, D] activation (linear, residual, activations, layer_norm,
softmax, reshape/transpose, sums/means, matmul, attention-like head split, branches joined by add or
cat). Every size divides by every mesh axis, so each hint is feasible. On failure hypothesis shrinks
the case and the assertion prints the model's op list, the mesh, the hints and the report.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from fuzzing import fuzz_settings
from hypothesis import given, reject
from hypothesis import strategies as st
from torch import nn

from autoshard.ir.errors import HintError
from autoshard.verify.verify import verify_simulated

ACTS = {"gelu": F.gelu, "relu": torch.relu, "tanh": torch.tanh}


# --- ops: each maps a (B, T, D) shape to a new one; repr says what it does -----------------------

class Linear(nn.Module):
    def __init__(self, d_in, d_out, bias):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out, bias=bias)

    def forward(self, h):
        return self.fc(h)

    def __repr__(self):
        return f"linear({self.fc.in_features}->{self.fc.out_features}, bias={self.fc.bias is not None})"


class Act(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.name = name

    def forward(self, h):
        return ACTS[self.name](h)

    def __repr__(self):
        return self.name


class Residual(nn.Module):
    def __init__(self, d, act):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.act = act

    def forward(self, h):
        return h + ACTS[self.act](self.fc(h))

    def __repr__(self):
        return f"h + {self.act}(linear({self.fc.in_features}->{self.fc.out_features})(h))"


class LayerNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)

    def forward(self, h):
        return self.ln(h)

    def __repr__(self):
        return f"layer_norm({self.ln.normalized_shape[0]})"


class Softmax(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, h):
        return h.softmax(self.dim)

    def __repr__(self):
        return f"softmax(dim={self.dim})"


class Transpose(nn.Module):
    def forward(self, h):
        return h.transpose(1, 2)

    def __repr__(self):
        return "transpose(1, 2)"


class FoldIntoSeq(nn.Module):
    """[B, T, D] -> [B, 2T, D/2]: a reshape whose groups merge and split dims."""

    def forward(self, h):
        b, t, d = h.shape
        return h.reshape(b, 2 * t, d // 2)

    def __repr__(self):
        return "reshape(B, 2T, D/2)"


class Center(nn.Module):
    def forward(self, h):
        return h - h.mean(-1, keepdim=True)

    def __repr__(self):
        return "h - mean(h, -1)"


class SeqSum(nn.Module):
    def forward(self, h):
        return h * torch.tanh(h.sum(1, keepdim=True))

    def __repr__(self):
        return "h * tanh(sum(h, 1))"


class MatMulParam(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d_in, d_out) / math.sqrt(d_in))

    def forward(self, h):
        return torch.matmul(h, self.w)

    def __repr__(self):
        return f"matmul(h, w[{self.w.shape[0]}, {self.w.shape[1]}])"


class Heads(nn.Module):
    """Attention without projections: split D into heads, softmax(q k^T) v, merge heads."""

    def __init__(self, heads):
        super().__init__()
        self.heads = heads

    def forward(self, h):
        b, t, d = h.shape
        a = h.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        scores = torch.matmul(a, a.transpose(-1, -2)).softmax(-1)
        return torch.matmul(scores, a).transpose(1, 2).reshape(b, t, d)

    def __repr__(self):
        return f"attention(heads={self.heads})"


class Branch(nn.Module):
    def __init__(self, d, d_a, d_b, join):
        super().__init__()
        self.a = nn.Linear(d, d_a)
        self.b = nn.Linear(d, d_b, bias=False)
        self.join = join

    def forward(self, h):
        left, right = torch.relu(self.a(h)), self.b(h)
        return left + right if self.join == "add" else torch.cat([left, right], -1)

    def __repr__(self):
        return f"{self.join}(relu(linear->{self.a.out_features}), linear->{self.b.out_features})"


class Chain(nn.Module):
    def __init__(self, layers, pool):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.pool = pool

    def forward(self, x):
        h = x
        for layer in self.layers:
            h = layer(h)
        # Pools square first: layer_norm or centring make rows sum to round-off, which compares badly.
        if self.pool == "mean":
            h = (h * h).mean(1)
        elif self.pool == "sum":
            h = (h * h).sum(-1)
        return h

    def __repr__(self):
        pool = {"mean": ["mean(h*h, 1)"], "sum": ["sum(h*h, -1)"], None: []}[self.pool]
        return " -> ".join(["x", *map(repr, self.layers), *pool])


# --- random cases --------------------------------------------------------------------------------

MESHES = [(2,), (4,), (8,), (3,), (2, 2), (2, 4), (4, 2), (2, 3), (1, 2), (2, 1, 2), (2, 2, 2), (2, 2, 2)]  # 3 axes drawn twice as often
NAMES = ("dp", "tp", "sp")
KINDS = ["linear", "act", "residual", "layer_norm", "softmax", "transpose", "fold", "center", "seq_sum", "matmul",
         "heads", "branch"]


@dataclass
class Case:
    model: Chain
    shape: tuple
    mesh: tuple
    hints: dict | None
    loss: str

    def __repr__(self):
        return (f"model: {self.model!r}\ninput: {self.shape}  mesh: {self.mesh} axes {NAMES[:len(self.mesh)]}\n"
                f"hints: {self.hints}\nloss: {self.loss}")


@st.composite
def cases(draw):
    mesh = draw(st.sampled_from(MESHES))
    unit = math.prod(mesh)  # every dim divides over every axis, also nested over several
    b, t = unit * draw(st.integers(1, 2)), unit * draw(st.integers(1, 2))
    d = 2 * unit * draw(st.integers(1, 2))
    shape = (b, t, d)
    layers, linear_paths = [], []  # weights of nn.Linear layers
    for step in range(draw(st.integers(1, 4))):
        i = len(layers)  # the index in the ModuleList, for parameter paths
        kind = "linear" if step == 0 else draw(st.sampled_from(KINDS))
        if kind == "linear":
            d_out = 2 * unit * draw(st.integers(1, 2))
            layers.append(Linear(d, d_out, draw(st.booleans())))
            linear_paths.append(f"layers.{i}.fc.weight")
            d = d_out
        elif kind == "act":
            layers.append(Act(draw(st.sampled_from(sorted(ACTS)))))
        elif kind == "residual":
            layers.append(Residual(d, draw(st.sampled_from(sorted(ACTS)))))
            linear_paths.append(f"layers.{i}.fc.weight")
        elif kind == "layer_norm":
            layers.append(LayerNorm(d))
        elif kind == "softmax":
            layers.append(Softmax(draw(st.sampled_from([-1, 1]))))
        elif kind == "transpose":
            layers.append(Transpose())
            t, d = d, t
        elif kind == "fold":
            if d % (2 * unit):
                continue
            layers.append(FoldIntoSeq())
            t, d = 2 * t, d // 2
        elif kind == "center":
            layers.append(Center())
        elif kind == "seq_sum":
            layers.append(SeqSum())
        elif kind == "matmul":
            d_out = 2 * unit
            layers.append(MatMulParam(d, d_out))
            d = d_out
        elif kind == "heads":
            heads = unit if d % (2 * unit) == 0 else 1
            layers.append(Heads(draw(st.sampled_from(sorted({heads, 2} if d % 2 == 0 else {heads})))))
        elif kind == "branch":
            join = draw(st.sampled_from(["add", "cat"]))
            d_a = 2 * unit * draw(st.integers(1, 2))
            d_b = d_a if join == "add" else 2 * unit
            layers.append(Branch(d, d_a, d_b, join))
            linear_paths += [f"layers.{i}.a.weight", f"layers.{i}.b.weight"]
            d = d_a if join == "add" else d_a + d_b
    pool = draw(st.sampled_from([None, "mean", "sum"]))
    torch.manual_seed(draw(st.integers(0, 3)))
    model = Chain(layers, pool)

    # Every dim of every parameter and activation is a multiple of `unit`, so any shard hint divides.
    params = {name: p.dim() for name, p in model.named_parameters()}
    hints = {}
    for name in NAMES[: len(mesh)]:
        role = draw(st.sampled_from(["free", "batch", "seq", "column/row", "any param", "activation"]))
        if role == "batch":
            hints.setdefault("input:0", {})[name] = "S(0)"
        elif role == "seq":
            hints.setdefault("input:0", {})[name] = "S(1)"
        elif role == "column/row" and linear_paths:
            for path in draw(st.lists(st.sampled_from(linear_paths), min_size=1, max_size=2, unique=True)):
                hints.setdefault(path, {})[name] = draw(st.sampled_from(["S(0)", "S(1)"]))
        elif role == "any param":
            path = draw(st.sampled_from(sorted(params)))
            hints.setdefault(path, {})[name] = f"S({draw(st.integers(0, params[path] - 1))})"
        elif role == "activation":
            key = f"layers.{draw(st.integers(0, len(layers) - 1))}:output"
            hints.setdefault(key, {})[name] = f"S({draw(st.integers(0, 2))})"
    loss = draw(st.sampled_from(["mean", "square"]))
    return Case(model, shape, mesh, hints or None, loss)


def square_loss(out, x):
    return (out * out).mean()


@fuzz_settings(12)  # 60 took a quarter of the suite's property time, 40 about 36 s; long_fuzz.py runs more
@given(cases())
def test_random_model_matches_single_device(case):
    report, program = run_case(case)
    assert report.ok, f"{case!r}\n{report!r}\n{program.plan.summary()}"


def run_case(case):
    x = torch.randn(case.shape, generator=torch.Generator().manual_seed(1))
    try:
        return verify_simulated(case.model, (x,), square_loss if case.loss == "square" else None,
                                mesh=case.mesh, axis_names=NAMES[: len(case.mesh)], hints=case.hints)
    except HintError as exc:
        # An op's output hint constrains that op (no resharding after it): layer_norm cannot make S(2).
        if "cannot be met" in str(exc) and any(k.endswith(":output") for k in case.hints or {}):
            reject()
        raise AssertionError(f"{case!r}\nraised {exc}") from exc
    except Exception as exc:
        raise AssertionError(f"{case!r}\nraised {type(exc).__name__}: {exc}") from exc
