"""docs/tutorial.md: every ```python block runs, in order, in one namespace (the torchrun script on 2 ranks)."""
import doctest
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import matplotlib
import pytest
import torch

from autoshard.apidoc import documented_modules
from autoshard.zoo import mlp

matplotlib.use("Agg")
TUTORIAL = Path(__file__).resolve().parents[1] / "docs" / "tutorial.md"
COUNT_THREADS = Path(__file__).with_name("multirank") / "run_and_count_gloo_threads.py"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


def test_tutorial_code_runs(tmp_path, monkeypatch):
    blocks = python_blocks(TUTORIAL.read_text())
    assert len(blocks) >= 10
    scripts = [b for b in blocks if 'if __name__ == "__main__":' in b]
    assert len(scripts) == 1, "the tutorial has one torchrun script"
    (tmp_path / "save_sharded.py").write_text(scripts[0])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # Through the wrapper that counts the gloo threads alive as each rank's interpreter exits: the script leaves
    # its process group to init_distributed's exit handler, and a thread left to finalisation can abort the run.
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(COUNT_THREADS),
                          "save_sharded.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.findall(r"gloo threads at exit: (\d+)", run.stdout) == ["0", "0"], run.stdout[-3000:]
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "tutorial"}  # the script's main() is for torchrun, done above
    for i, block in enumerate(blocks):
        exec(compile(block, f"{TUTORIAL.name} python block {i}", "exec"), namespace)  # noqa: S102 (the tutorial's code)
    # The last block loaded the trained, sharded checkpoint into the single-device model.
    fresh = mlp()[0]
    trained = namespace["single"]
    assert not torch.equal(trained.layers[0].weight, fresh.layers[0].weight)
    assert namespace["optimizer"].state[trained.layers[0].weight]["momentum_buffer"].shape == (128, 32)


# Every module of the package (found from its files); docs/api.md covers the same modules.
DOCUMENTED = documented_modules()


@pytest.mark.parametrize("module_name", DOCUMENTED)
def test_docstring_examples_run(module_name):
    """Every public function and class has an example, and the examples run. The module docstring's
    examples run first; the names they define (e.g. `plan`) are visible to the others."""
    module = importlib.import_module(module_name)
    finder = doctest.DocTestFinder()
    tests = [t for t in finder.find(module) if t.examples]
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    shared = dict(vars(module))
    for test in sorted(tests, key=lambda t: t.name != module_name):
        test.globs = shared if test.name == module_name else {**shared}
        runner.run(test, clear_globs=False)
    assert runner.failures == 0, f"{runner.failures} failing examples in {module_name} (run it with -s to see them)"
    public = [obj for name, obj in vars(module).items() if not name.startswith("_") and callable(obj)
              and getattr(obj, "__module__", None) == module_name]
    for obj in public:
        members = {obj.__qualname__: obj}
        for name, raw in (vars(obj).items() if isinstance(obj, type) else ()):
            raw = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
            if not name.startswith("_") and (callable(raw) or isinstance(raw, property)):
                members[f"{obj.__qualname__}.{name}"] = raw
        for qualname, member in members.items():
            assert _has_example(member.__doc__), f"{module_name}.{qualname} has no example in its docstring"


def _has_example(doc) -> bool:
    """At least one `>>>` line that is code, not a comment (a commented-out call shows nothing)."""
    lines = [line.strip() for line in (doc or "").splitlines()]
    return any(line.startswith(">>> ") and not line.startswith(">>> #") for line in lines)
