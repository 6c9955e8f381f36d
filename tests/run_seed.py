"""One seed per test run for the suite's rotating samples (tests/test_architecture_sample.py, the transformers
families' default run): the same in every pytest-xdist worker, printed in the test ids, and repeatable with
AUTOSHARD_ARCH_SEED=<seed>."""
import os
import time

# The workers collect separately and must collect the same tests: a seed from each worker's clock made them
# disagree when they started in different seconds; xdist gives every worker of one run the same id.
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")
SEED = int(os.environ.get("AUTOSHARD_ARCH_SEED") or (int(_RUN, 16) if _RUN else int(time.time())) % 100_000)
