"""Output is quiet: no third-party banner (HiGHS prints its copyright on stdout at its first solve in a
process, which corrupted `plan --json`), each warning once."""
import json
import subprocess
import sys


def test_plan_json_stdout_is_only_json_in_a_fresh_process():
    run = subprocess.run([sys.executable, "-m", "autoshard", "plan", "autoshard.zoo:mlp", "--mesh", "2",
                          "--axis-names", "dp", "--json"], capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    plan = json.loads(run.stdout)
    assert plan["mesh"] and "HiGHS" not in run.stdout + run.stderr


def test_plan_process_ends_with_its_exit_code_and_its_whole_message():
    """`plan` ends without the interpreter's teardown (autoshard/__main__.py exit_now): its exit code and its
    flushed error message must survive that."""
    run = subprocess.run([sys.executable, "-m", "autoshard", "plan", "autoshard.zoo:no_such_factory", "--mesh", "2"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 2, (run.returncode, run.stderr)
    assert "no_such_factory" in run.stderr


def test_an_unknown_op_warns_once_per_parallelize_call():
    """Each call tells its own warnings once (its candidate plans and repeated layers do not repeat them); a later
    call is told again: a process-wide "seen" set silenced it (issue 30)."""
    code = """
import warnings, torch, autoshard
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
    def forward(self, x):
        return torch.special.erfcx(self.fc(x))
for _ in range(3):
    autoshard.parallelize(M(), (2,), (torch.randn(4, 8),), axis_names=("dp",))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert run.stderr.count("no sharding rule for aten.special_erfcx") == 3, run.stderr
    assert run.stdout == ""
