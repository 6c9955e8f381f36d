"""How far the hypothesis tests explore: one knob for the default suite and for long fuzzing runs.

The default suite (AUTOSHARD_FUZZ_SCALE unset) runs each property test's own small, derandomized
example count: the same examples every run, so CI is reproducible and stays under its time limit.
`python tests/long_fuzz.py` sets AUTOSHARD_FUZZ_SCALE=N: N times the examples, freshly random each run
(a failure prints the shrunk case and the `@reproduce_failure` blob that replays it).
"""
import os

from hypothesis import HealthCheck, settings

SCALE = max(1, int(os.environ.get("AUTOSHARD_FUZZ_SCALE", "1")))


def fuzz_settings(examples: int, **overrides) -> settings:
    """Hypothesis settings for a property test that runs `examples` cases in the default suite."""
    options = {"max_examples": examples * SCALE, "derandomize": SCALE == 1, "deadline": None, "database": None,
               "print_blob": True, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}
    options.update(overrides)
    return settings(**options)
