"""`python -m autoshard calibrate` times each mesh axis on spawned gloo ranks and writes a profile that
parallelize loads (the CLI runs end to end; its docstring example cannot start processes)."""
import subprocess
import sys

import autoshard
from autoshard.cost.profiles import load_profile
from autoshard.zoo import mlp


def test_calibrate_writes_a_profile_parallelize_uses(tmp_path):
    out = tmp_path / "profile.json"
    run = subprocess.run([sys.executable, "-m", "autoshard", "calibrate", "--mesh", "2", "--sizes", "4096,65536",
                          "--output", str(out)], capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "axis a0 (size 2): alpha" in run.stdout
    profile = load_profile(str(out))
    (link,) = profile.axis_links
    assert link.alpha > 0 and link.bandwidth > 0
    model, inputs, loss_fn = mlp(n_layers=1)
    prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, profile=str(out), pipeline=False)
    assert prog.plan.predicted["step_time_s"] > 0
