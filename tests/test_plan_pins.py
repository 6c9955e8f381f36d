"""Plans stay byte-identical across refactoring (issue 16): the fingerprint and the md5 of `plan.dumps()` of
each pinned case equal the values in tests/data/plan_pins.json, written before the code moved. Two cases
run by default; `AUTOSHARD_FULL_MATRIX=1` runs all 30 (every zoo model automatic on (2,), (2,2), (2,2,2),
hinted dp x tp, and pipelined pp x dp; about a minute). A deliberate change of plans rewrites the file with
`PYTHONPATH=tests python tests/plan_pins.py > tests/data/plan_pins.json` and says why in its commit."""
import json
import os
from pathlib import Path

import pytest
from plan_pins import DEFAULT_CASES, cases, pin

PINNED = json.loads((Path(__file__).parent / "data" / "plan_pins.json").read_text())
RUN = cases() if os.environ.get("AUTOSHARD_FULL_MATRIX") == "1" else DEFAULT_CASES


def test_the_pin_file_covers_every_case():
    assert sorted(PINNED) == sorted(cases())


@pytest.mark.parametrize("case", RUN)
def test_plan_is_byte_identical_to_the_pinned_one(case):
    assert pin(case) == PINNED[case], f"{case}: the plan changed (see this file's docstring)"
