"""Every compile in the test suite runs the pass verifier between passes (DESIGN: tests and debug mode)."""
import os
import sys

import pytest

os.environ.setdefault("AUTOSHARD_DEBUG", "1")
sys.path.insert(0, os.path.dirname(__file__))  # tests/fuzzing.py: the property tests' shared settings


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist the multi-rank tests run in one worker, one after another: they share one pool of
    gloo ranks (tests/multirank/conftest.py), which takes ~15 s to start, and two pools would oversubscribe
    the cores the ranks already fill."""
    for item in items:
        if "multirank" in item.path.parts:
            item.add_marker(pytest.mark.xdist_group("multirank"))
