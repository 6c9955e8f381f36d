"""Long fuzzing runs, separate from the test suite: `python tests/long_fuzz.py [--scale N] [pytest args]`.

Runs every hypothesis test (random models and pipelines against the single device, plan/hint loaders
under random bytes, placement/redistribution/reshape algebra) with N times the suite's examples
(default 50), freshly random each run instead of the suite's fixed examples. A failure prints the shrunk
case (for random models, the smallest model that still differs) and the `@reproduce_failure` line that
replays it. On 2 cores scale 3 took 2 min 10 s (103 tests); scale 50 takes about 35 minutes.
"""
import os
import subprocess
import sys
from pathlib import Path

TESTS = ["tests/properties", "tests/test_fuzz_loaders.py", "tests/test_placement.py", "tests/test_redistribute.py",
         "tests/test_mesh.py", "tests/strategies/test_reshape_algebra.py"]


def main(argv: list[str]) -> int:
    scale = "50"
    if "--scale" in argv:
        at = argv.index("--scale")
        scale = argv[at + 1]
        argv = argv[:at] + argv[at + 2:]
    if not scale.isdigit() or int(scale) < 1:
        raise SystemExit(f"--scale takes a positive integer (times the suite's examples), got {scale!r}")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, AUTOSHARD_FUZZ_SCALE=scale)
    print(f"[long_fuzz] {scale}x the suite's examples, fresh random examples: {' '.join(TESTS)}", flush=True)
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS, *argv],
                           cwd=root, env=env)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
