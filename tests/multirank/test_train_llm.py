"""examples/train_llm.py under torchrun at a tiny size on gloo: a transformers Llama loaded from safetensors
on a meta model, AdamW with a schedule, bf16 mixed precision, clipping, accumulation and dropout; the run
saved at step 2 and resumed from there logs the same losses as the uninterrupted run, and the loss falls."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _train(out, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / "train_llm.py"), "--mesh", "2", "--axis-names", "dp", "--steps", "4", "--layers", "1",
           "--out", str(out), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_resumed_run_logs_the_uninterrupted_losses(tmp_path):
    first = _train(tmp_path, "--save-at", "2")
    assert "step 3: loss" in first.stdout and "tokens/s" in first.stdout
    _train(tmp_path, "--resume")
    whole = json.loads((tmp_path / "losses.json").read_text())
    resumed = json.loads((tmp_path / "losses_resumed.json").read_text())
    assert sorted(resumed) == ["2", "3"]
    assert all(resumed[k] == whole[k] for k in resumed), (whole, resumed)
    assert whole["3"] < whole["0"]
