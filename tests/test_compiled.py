"""parallelize(..., compile=True): rank programs compiled by torch.compile (inductor), collectives and random
ops eager. One simulated run (tensor parallel, dropout drawn with rng="exact", a recomputed region) against
the single device in float64, plus the refusals; real gloo ranks: tests/multirank/test_compiled_gloo.py.
Compiling takes seconds per rank, so the default run is one tiny model."""
import os

import pytest
import torch
from torch import nn

import autoshard
from autoshard import UserInputError
from autoshard.runtime.compiled import require_cpp_compiler
from autoshard.runtime.simulator import run_ranks
from autoshard.verify.verify import verify_simulated
from autoshard.zoo import mlp


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.drop = nn.Linear(8, 16), nn.Dropout(0.1)

    def forward(self, x):
        return self.drop(torch.relu(self.fc1(x)))


class _Net(nn.Module):  # Megatron's MLP with dropout: few graphs to compile (each takes seconds)
    def __init__(self):
        super().__init__()
        self.block, self.fc2 = _Block(), nn.Linear(16, 8)

    def forward(self, x):
        return self.fc2(self.block(x))


def has_cpp_compiler() -> bool:
    """Whether inductor can build kernels here (tests that compile skip, saying why, when it cannot)."""
    try:
        require_cpp_compiler()
    except UserInputError:
        return False
    return True


def net_factory():
    """The compiled-equality case (tests/multirank/test_compiled_gloo.py runs it on gloo ranks)."""
    torch.manual_seed(0)
    return _Net(), (torch.randn(4, 8),), None


NET_HINTS = {"block.fc1.weight": {"tp": "S(0)"}, "block.fc1.bias": {"tp": "S(0)"}, "fc2.weight": {"tp": "S(1)"}}


def test_simulated_ranks_run_eagerly_and_say_so():
    model, inputs, _ = net_factory()
    with pytest.warns(UserWarning, match="simulator runs its ranks as threads"):
        report, program = verify_simulated(model, inputs, mesh=(2,), axis_names=("tp",), hints=NET_HINTS,
                                           compile=True)
    assert report.ok, report
    assert program.state.options.compile


def test_graph_is_not_compiled_and_plan_unchanged():
    model, inputs, loss_fn = mlp(batch=4, in_dim=8, hidden=16, out_dim=8)
    eager = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
                                  hints={"input:0": {"dp": "S(0)"}})
    compiled = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
                                     hints={"input:0": {"dp": "S(0)"}}, compile=True)
    assert compiled.plan.fingerprint == eager.plan.fingerprint  # compiling is no planning decision
    assert compiled.graph(0).code == eager.graph(0).code  # prog.graph stays the inspectable eager graph
    keys = [run_ranks(p, lambda module: list(module.state_dict()))[0] for p in (eager, compiled)]
    assert keys[0] == keys[1]  # compiled in place: checkpoints keep their names (no "_orig_mod.")


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_compile_must_be_a_bool(value):
    model, inputs, loss_fn = mlp(batch=4, in_dim=8, hidden=16, out_dim=8)
    with pytest.raises(UserInputError, match=rf"compile={value!r}: give True \(torch.compile each rank's program\)"):
        autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, compile=value)


def test_missing_cpp_compiler_fails_before_planning(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-c++-compiler")
    model, inputs, loss_fn = mlp(batch=4, in_dim=8, hidden=16, out_dim=8)
    with pytest.raises(UserInputError, match=r"compile=True: torch.compile's inductor backend builds C\+\+ kernels "
                                             r"for the CPU with 'no-such-c\+\+-compiler' \(\$CXX, default 'g\+\+'\), "
                                             r"which is not on PATH; install a C\+\+ compiler .* or drop compile=True"):
        autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, compile=True)
    monkeypatch.delenv("CXX")
    assert os.path.basename(require_cpp_compiler()) == "g++"


def test_compiled_benchmark_report_on_synthetic_rows():
    from benchmarks import compiled

    sample = {"wall": {"eager": [0.002, 0.002], "compiled": [0.001, 0.003]},
              "cpu": {"eager": [0.002, 0.002], "compiled": [0.001, 0.001]},
              "diff": {"loss": 1e-7, "grads": 2e-7, "params": 1e-8}, "compile_s": 3.0}
    rows = [{"case": "gpt2", "ranks": [sample, sample], "slowest": sample["wall"], "load": (1.0, 1.0, 1.0)}]
    body, headers, csv_rows = compiled.report(rows)
    assert "| gpt2 (tp)" in body and "equal on every model" in body
    assert len(csv_rows) == 8 and len(headers) == len(csv_rows[0])
    assert torch.finfo(torch.float32).eps < compiled.EQUALITY_GOAL
