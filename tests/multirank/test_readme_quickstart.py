"""The README's first example runs as written under `torchrun --nproc-per-node 8` on gloo: every rank prints the
losses one device prints for the same loop (the same script with `parallelize` left out), through the smaller last
batch, which reuses the plan (no "planning again" warning)."""
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import autoshard

ROOT = Path(__file__).resolve().parents[2]


def _first_example() -> str:
    text = (ROOT / "README.md").read_text()
    return re.search(r"```python\n(.*?)```", text, re.DOTALL).group(1)


def _single_device_losses(script: Path, monkeypatch, capsys) -> list[float]:
    monkeypatch.setattr(autoshard, "parallelize", lambda model, **options: model)
    runpy.run_path(str(script))
    return [float(x) for x in re.findall(r"loss ([0-9.]+)", capsys.readouterr().out)]


def test_the_readme_example_trains_like_one_device(tmp_path, monkeypatch, capsys):
    script = tmp_path / "train.py"
    script.write_text(_first_example())
    assert "autoshard.parallelize(model, mesh=(2, 2, 2))" in script.read_text()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8", str(script)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=tmp_path, env=env, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "planning again" not in done.stderr, done.stderr[-4000:]
    printed = re.findall(r"step (\d+): loss ([0-9.]+)", done.stdout)
    single = _single_device_losses(script, monkeypatch, capsys)
    assert len(single) == 3 and len(printed) == 8 * 3, done.stdout
    for step, loss in printed:
        expected = single[int(step)]
        assert abs(float(loss) - expected) <= 2e-6 * expected, (step, loss, expected)
