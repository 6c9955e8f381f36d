"""Every compile in the test suite runs the pass verifier between passes (DESIGN: tests and debug mode)."""
import os

os.environ.setdefault("AUTOSHARD_DEBUG", "1")
