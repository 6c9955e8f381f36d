"""Every compile in the test suite runs the pass verifier between passes (DESIGN: tests and debug mode)."""
import os
import sys

os.environ.setdefault("AUTOSHARD_DEBUG", "1")
sys.path.insert(0, os.path.dirname(__file__))  # tests/fuzzing.py: the property tests' shared settings

