"""A rotating sample of the architectures sweep (issue 33; benchmarks/architectures.py runs every family).

Each run takes SAMPLE families that passed every cell in benchmarks/architectures.json, chosen by a seed shown in
the test ids (``test_family_sample[seed=1234-llama]``); `AUTOSHARD_ARCH_SEED=1234` repeats a run's choice and
`AUTOSHARD_ARCH_FAMILIES=a,b` names the families. Each goes through the sweep's build, export, verify on dp=2 and
plan on an unnamed (2, 2, 2) cells, in this process; the (2, 2) cell under a memory budget (its two plans take
40-90 s per family here) stays in the sweep.
"""
import json
import os
import random

import pytest
from run_seed import SEED

from autoshard.zoo import architectures
from benchmarks import architectures as sweep

SAMPLE = 2
CELLS = ("build", "export", "dp2", "plan222")


def _passing() -> list[str]:
    """Families the sweep recorded as passing every cell (fast ones first in line), else its quick set."""
    if sweep.JSON.exists():
        records = json.loads(sweep.JSON.read_text())["families"]
        known = architectures.families()
        good = [name for name, record in records.items() if name in known
                and all(sweep.status(record, cell) == "ok" for cell in sweep.CELLS)
                and sum(record["cells"][c]["seconds"] for c in CELLS) < 8]
        if len(good) >= SAMPLE:
            return sorted(good)
    return list(sweep.QUICK)


CHOSEN = (os.environ["AUTOSHARD_ARCH_FAMILIES"].split(",") if os.environ.get("AUTOSHARD_ARCH_FAMILIES")
          else random.Random(SEED).sample(_passing(), SAMPLE))
print(f"[architecture sample] seed {SEED}: {', '.join(CHOSEN)} (AUTOSHARD_ARCH_SEED={SEED} repeats it)")


@pytest.mark.parametrize("family", CHOSEN, ids=[f"seed={SEED}-{f}" for f in CHOSEN])
def test_family_sample(family):
    record = sweep.run_family(family, cells=CELLS)
    failed = {c: sweep.status(record, c) for c in CELLS if sweep.status(record, c) != "ok"}
    assert not failed, (f"{family} ({record['head']}, seed {SEED}): {failed}\n"
                        + "\n".join(record["notes"].get("tracebacks", {}).values()))


def test_every_family_has_a_head_and_a_model_class():
    """The sweep's list: every family maps to one head and a transformers class of that head."""
    fams = architectures.families()
    assert len(fams) > 300
    assert architectures.model_class_name("wav2vec2") == "Wav2Vec2ForCTC"


def test_tiny_config_shrinks_sub_configs_and_token_ids():
    import transformers
    small = architectures.tiny_config(transformers.CLIPConfig())
    assert small["text_config"].hidden_size == 32 and small["vision_config"].num_hidden_layers == 2
    assert small["text_config"].eos_token_id < small["text_config"].vocab_size
