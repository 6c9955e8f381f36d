"""The torchrun path: examples/train_torchrun.py trains on 2 ranks, logs the single-device loss and leaves no gloo
thread running when the interpreter exits (one that did aborted the job now and then)."""
import re
import subprocess
import sys
from pathlib import Path

from autoshard.zoo import gpt2

ROOT = Path(__file__).resolve().parents[2]


def test_torchrun_example_trains_with_the_single_device_loss():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(Path(__file__).with_name("run_and_count_gloo_threads.py")),
           str(ROOT / "examples" / "train_torchrun.py"), "--mesh", "2", "--axis-names", "dp", "--steps", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    logged = float(re.search(r"step 0: loss ([0-9.]+)", done.stdout).group(1))
    model, inputs, loss_fn = gpt2()
    assert abs(logged - loss_fn(model(*inputs), *inputs).item()) < 1e-4
    assert re.findall(r"gloo threads at exit: (\d+)", done.stdout) == ["0", "0"], done.stdout
