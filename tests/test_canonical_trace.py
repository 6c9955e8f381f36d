"""The traced graph is a function of the model, inputs and options alone (issue 34, item 2).

transformers' Beam builds its attention masks in `for layer_type in set(config.layer_types)`: the order of its ops
follows the process's string hash seed, so the launcher and the ranks traced different graphs and a plan made by one
did not apply to the others (PlanMismatchError on every rank of `verify`). autoshard/frontend/canonical.py puts
every trace in canonical order with canonical names; these tests plan Beam in fresh processes under different
hash seeds, apply one process's plan in another (what verify's ranks and ParallelModule's ranks do), and check the
orders the canonical form must keep (in-place writes between their reads, random ops as drawn).
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from autoshard.frontend.canonical import canonical_order
from autoshard.frontend.trace import trace

# Seeds 0 and 1 trace Beam's two attention masks in opposite orders (checked in the test: its raw exports differ).
SCRIPT = textwrap.dedent("""
    import json, sys, warnings
    warnings.simplefilter("ignore")
    import torch
    import autoshard
    from autoshard.zoo.transformers_families import beam
    model, inputs, loss_fn = beam()
    exported = torch.export.export(model, inputs, strict=False).graph_module
    raw = [n.name for n in exported.graph.nodes]
    prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",))
    again = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",))  # a used process
    out = {"raw": raw, "fingerprint": prog.plan.fingerprint, "again": again.plan.fingerprint}
    if len(sys.argv) > 1:  # apply another process's plan, as verify's ranks and ParallelModule's do
        applied = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",), plan=sys.argv[1])
        out["applied"] = applied.plan.fingerprint
    else:
        prog.plan.save(sys.argv[0].replace(".py", ".plan.json"))
    print(json.dumps(out))
""")


def _run(script, seed: int, *args) -> dict:
    env = dict(os.environ, PYTHONHASHSEED=str(seed), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(os.environ.get("AUTOSHARD_FULL_MATRIX") != "1",
                    reason="two planning processes (28 s); tests/properties/test_solver_reproducible.py plans the zoo "
                           "under two hash seeds by default; AUTOSHARD_FULL_MATRIX=1 runs it")
def test_beam_plans_alike_under_every_hash_seed(tmp_path):
    script = tmp_path / "plan_beam.py"
    script.write_text(SCRIPT)
    first = _run(script, 0)
    second = _run(script, 1, str(tmp_path / "plan_beam.plan.json"))
    assert first["raw"] != second["raw"], "these seeds no longer trace Beam's masks in different orders"
    assert first["fingerprint"] == first["again"] == second["fingerprint"] == second["again"] == second["applied"]


class _Branches(torch.nn.Module):
    """Independent branches run in the order given (as a set of strings would order them)."""

    def __init__(self, order):
        super().__init__()
        self.order = order

    def forward(self, x):
        out = {kind: (x.sin() if kind == "a" else x.cos() * 2) for kind in self.order}
        return out["a"] + out["b"]


def test_independent_branches_trace_to_one_graph():
    x = torch.randn(4, 4)
    graphs = [trace(_Branches(order), (x,)).gm for order in ("ab", "ba")]
    assert graphs[0].code == graphs[1].code


class _InPlace(torch.nn.Module):
    """A buffer read, updated in place, read again; the output takes the second read first (a walk from it by data
    flow alone would update the buffer before the first read)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(4))

    def forward(self, x):
        before = x * self.count
        self.count.add_(1.0)
        after = x + self.count
        return after + before


def test_an_in_place_write_stays_between_its_reads():
    x = torch.randn(4)
    gm = trace(_InPlace(), (x,)).gm
    nodes = list(gm.graph.nodes)
    write = next(n for n in nodes if n.target is torch.ops.aten.add_.Tensor)
    read_before = next(n for n in nodes if n.target is torch.ops.aten.mul.Tensor)
    read_after = next(n for n in nodes if n.target is torch.ops.aten.add.Tensor and write in n.args)
    assert nodes.index(read_before) < nodes.index(write) < nodes.index(read_after)
    assert torch.equal(gm(torch.zeros(4), x)[0], _InPlace()(x).mean())


class _Dropouts(torch.nn.Module):
    """Two random ops on independent branches, drawn b first."""

    def forward(self, x):
        b = torch.nn.functional.dropout(x.cos(), 0.5)
        a = torch.nn.functional.dropout(x.sin(), 0.5)
        return a * b


def test_random_ops_keep_the_order_they_draw_in():
    gm = trace(_Dropouts(), (torch.randn(4),)).gm
    draws = [n for n in canonical_order(gm.graph) if n.target is torch.ops.aten.dropout.default]
    assert [d.args[0].target for d in draws] == [torch.ops.aten.cos.default, torch.ops.aten.sin.default]


class _Layer(torch.nn.Module):
    def forward(self, x, bias=None):
        if bias is None:  # the first layer makes the bias the others read (WavLM's position bias)
            bias = x.sin()
            return bias * 2 + x, bias
        return bias.cos() + x, bias  # the bias first: a walk from the output reaches it before the first layer's end


class _SharedBias(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layer(), _Layer()])

    def forward(self, x):
        h, bias = self.layers[0](x)
        return self.layers[1](h, bias)[0]


def test_every_module_call_stays_in_one_piece():
    gm = trace(_SharedBias(), (torch.randn(4),)).gm
    layers = [n.meta["autoshard.path"] for n in gm.graph.nodes if n.op == "call_function"]
    first = [i for i, path in enumerate(layers) if path == "layers.0"]
    assert first == list(range(first[0], first[0] + len(first))), layers
    assert layers.index("layers.1") > first[-1]
