"""`python -m autoshard plan` plans the model in its own dtype and never copies its tensors (issue 14 item
5): bfloat16 halves every predicted byte of float32, and planning a model with 1 GiB of real float32
weights in a fresh process peaks at about its size, not at the 3 GiB a float64 copy would take.

The factories are loaded by name (`test_cli_plan_dtype:<name>`; tests/ is on sys.path, see conftest.py).
"""
import json
import os
import subprocess
import sys

import torch
from torch import nn

from autoshard.__main__ import OK, main

GIB = 2**30


def _mlp(dtype, device, dim=64):
    with torch.device(device):
        model = nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim)).to(dtype)
    return model, (torch.ones(8, dim, dtype=dtype, device=device),), lambda out, x: out.pow(2).mean()


def bf16_on_meta():
    return _mlp(torch.bfloat16, "meta")


def f32_on_meta():
    return _mlp(torch.float32, "meta")


def one_gib_float32():
    """Two 16384 x 8192 float32 layers (1 GiB) with every page written (filled, not random: fast)."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16384, 8192, bias=False), nn.ReLU(), nn.Linear(8192, 16384, bias=False))
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1e-3)
    return model, (torch.ones(4, 16384),), lambda out, x: out.pow(2).mean()


def _plan_json(factory, capsys) -> dict:
    assert main(["plan", f"test_cli_plan_dtype:{factory}", "--mesh", "2", "--axis-names", "dp", "--json"]) == OK
    return json.loads(capsys.readouterr().out)


def test_bfloat16_is_planned_in_bfloat16(capsys):
    half, full = _plan_json("bf16_on_meta", capsys), _plan_json("f32_on_meta", capsys)
    assert half["predicted"]["memory_bytes_per_rank"] * 2 == full["predicted"]["memory_bytes_per_rank"] > 0
    assert {r["path"]: r["type"] for r in half["nodes"] if r["kind"] == "param"}["0.weight"].startswith("bf16[")


def test_planning_a_real_model_does_not_copy_its_weights(tmp_path):
    hints = tmp_path / "replicated.json"  # data parallel: each rank holds the whole 1 GiB
    hints.write_text(json.dumps({"input:0": {"dp": "S(0)"}, "0.weight": {"dp": "R"}, "2.weight": {"dp": "R"}}))
    # main() as `python -m autoshard plan` runs it (whose process then ends without teardown: no line after it)
    code = ("import resource, sys; from autoshard.__main__ import main\n"
            "assert main(['plan', 'test_cli_plan_dtype:one_gib_float32', '--mesh', '2', '--axis-names', 'dp', "
            f"'--hints', {str(hints)!r}, '--json']) == 0\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, file=sys.stderr)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, check=False)
    assert run.returncode == 0, run.stderr
    plan = json.loads(run.stdout)
    peak = int(run.stderr.strip().splitlines()[-1])
    baseline = _import_rss(env)
    assert peak - baseline < 1.4 * GIB, (peak - baseline) / GIB  # the 1 GiB model, no float64 copy (+2 GiB)
    per_rank = plan["predicted"]["memory_bytes_per_rank"]
    assert 4 * GIB <= per_rank < 4.01 * GIB  # float32: parameters, gradients and Adam's two states of 1 GiB


def _import_rss(env) -> int:
    """Peak RSS of a process that imports autoshard and builds nothing."""
    code = "import resource, autoshard.__main__; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                              check=True).stdout)


def test_plan_prints_its_memory_breakdown_under_the_headroom_in_mixed_precision(capsys):
    assert main(["plan", "test_cli_plan_dtype:f32_on_meta", "--mesh", "2", "--axis-names", "dp",
                 "--mixed-precision", "bf16", "--memory-headroom", "0.5"]) == OK
    out = capsys.readouterr().out
    assert "memory budget 37.25 GiB per device (the device memory less 50% headroom)" in out  # 80 GB less 50%
    assert "memory per rank" in out and "optimizer state" in out and "saved activations" in out and "bf16[" in out
