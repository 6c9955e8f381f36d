"""Collect the bad-input catalogue (docs/error_catalogue.md) from the tests that assert error messages.

`python -m pytest -p catalogue_plugin <tests>` with AUTOSHARD_CATALOGUE_OUT=<file> appends one JSON line
per exception caught by `pytest.raises` that is an autoshard error: the test's id, the exception's type
and `str(exc)`. `python tests/catalogue_plugin.py <file>` prints them as catalogue rows (case = the test,
duplicates dropped), with temporary paths, ports and fingerprints shortened as the catalogue does.
"""
import json
import os
import re
import sys

import pytest

_current = {"test": ""}


def pytest_runtest_setup(item):
    _current["test"] = item.nodeid


def pytest_configure(config):
    out = os.environ.get("AUTOSHARD_CATALOGUE_OUT")
    if not out:
        return
    original = pytest.raises

    class Recording:
        def __init__(self, ctx):
            self.ctx = ctx

        def __enter__(self):
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            handled = self.ctx.__exit__(*exc)
            error = exc[1]
            from autoshard.ir.errors import AutoshardError
            if handled and isinstance(error, AutoshardError):
                with open(out, "a") as f:
                    f.write(json.dumps({"test": _current["test"], "type": type(error).__name__,
                                        "message": str(error)}) + "\n")
            return handled

    def raises(*args, **kwargs):
        ctx = original(*args, **kwargs)
        return Recording(ctx) if hasattr(ctx, "__exit__") else ctx

    pytest.raises = raises


def _shorten(message: str) -> str:
    message = re.sub(r"/tmp/(?:[^\s'\"/]+/)*", "<tmp>/", message)
    message = re.sub(r"\b[0-9a-f]{16,64}\b", "<fingerprint>", message)
    message = re.sub(r"\]:\d+", "]:<port>", message)
    message = re.sub(r"searched \d+\.\d s", "searched <seconds> s", message)  # how long a refused search took
    return message.replace("\n", " ⏎ ").replace("|", "\\|")


def rows(path: str) -> list[str]:
    """Markdown rows `| case | error | message |` of a file the plugin wrote."""
    seen, lines = set(), []
    with open(path, encoding="utf-8") as handle:
        records = [json.loads(line) for line in handle]
    for record in records:
        message = _shorten(record["message"])
        if message in seen:
            continue
        seen.add(message)
        case = record["test"].split("::")[-1].replace("test_", "", 1).replace("_", " ")
        lines.append(f"| {case} | `{record['type']}` | {message} |")
    return lines


if __name__ == "__main__":
    print("\n".join(rows(sys.argv[1])))
