"""Tier 3: pipelines on real gloo ranks — (2,2,2) pp x dp x tp, every schedule, every way to cut.

The default suite runs each schedule and each cut notation at least once (a diagonal through the
matrix, both zoo transformers); `AUTOSHARD_FULL_MATRIX=1` runs the full product (models x
schedules x cuts, ~3 minutes on the pool): `AUTOSHARD_FULL_MATRIX=1 python -m pytest
tests/multirank/test_pipeline.py`.
"""
import os

import pytest

from autoshard.verify.verify import verify_factory
from autoshard.zoo.hints import plan_hints

NAMES = ("pp", "dp", "tp")
MULTI = {"interleaved1f1b", "interleavedzerobubble", "zbv"}
SCHEDULES = ["gpipe", "1f1b", "interleaved1f1b", "interleavedzerobubble", "zbv"]
CUTS = ["auto", "balance", "split_points", "hints", "attributes"]

# Each notation spelled for 2 stages (one per pp rank) and 4 (two virtual stages per rank).
BALANCE = {("gpt2", 2): [4, 3], ("gpt2", 4): [3, 1, 1, 2], ("llama", 2): [2, 3], ("llama", 4): [1, 1, 1, 2]}
SPLITS = {("gpt2", 2): ["layers.1"], ("gpt2", 4): ["layers.0", "layers.1", "ln_f"],
          ("llama", 2): ["layers.1"], ("llama", 4): ["layers.0", "layers.1", "norm"]}
STAGE_HINTS = {
    ("gpt2", 2): {"w*": 0, "drop": 0, "layers.0": 0, "layers.1": 1, "ln_f": 1, "lm_head": 1},
    ("gpt2", 4): {"w*": 0, "drop": 0, "layers.0": 1, "layers.1": 2, "ln_f": 3, "lm_head": 3},
    ("llama", 2): {"tok_embeddings": 0, "layers.0": 0, "layers.1": 1, "norm": 1, "output": 1},
    ("llama", 4): {"tok_embeddings": 0, "layers.0": 1, "layers.1": 2, "norm": 3, "output": 3},
}


def case(model: str, schedule: str, cut: str):
    """(factory, hints, pipeline options) for one cell of the matrix."""
    stages = 4 if schedule in MULTI else 2
    hints = plan_hints(model, ("dp", "tp"), ("dp",), "tp")
    options = {"schedule": schedule, "microbatches": 2}
    factory = f"autoshard.zoo:{model}"
    if cut == "balance":
        options["balance"] = BALANCE[model, stages]
    elif cut == "split_points":
        options["split_points"] = SPLITS[model, stages]
    elif cut == "hints":
        hints.update({f"{k}:stage": v for k, v in STAGE_HINTS[model, stages].items()})
    elif cut == "attributes":  # gpt2: autoshard.stage(); llama: MindSpore's pipeline_stage attribute
        factory = f"autoshard.zoo.staged:{model}_staged" + ("4" if stages == 4 else "")
    return factory, hints, options


DIAGONAL = [("gpt2", "1f1b", "auto"), ("llama", "gpipe", "balance"), ("gpt2", "interleaved1f1b", "split_points"),
            ("llama", "interleavedzerobubble", "hints"), ("gpt2", "zbv", "attributes")]  # every cut notation once
MATRIX = [(m, s, c) for m in ("gpt2", "llama") for s in SCHEDULES for c in CUTS]
CASES = MATRIX if os.environ.get("AUTOSHARD_FULL_MATRIX") == "1" else DIAGONAL


@pytest.mark.parametrize("model, schedule, cut", CASES)
def test_pipeline_matches_single_device(pool_runner, model, schedule, cut):
    factory, hints, options = case(model, schedule, cut)
    report, program = verify_factory(factory, (2, 2, 2), NAMES, hints=hints, steps=2, runner=pool_runner,
                                     pipeline=options)
    assert report.ok, report
    assert program.config.num_stages == (4 if schedule in MULTI else 2)
    assert program.plan.pipeline["cut"] == ("automatic" if cut == "auto" else program.plan.pipeline["cut"])
    assert "dp" in report.collectives  # rank 0's stages synced their gradients over dp


def test_unnamed_mesh_chooses_axis_roles_and_says_why(pool_runner):
    report, program = verify_factory("autoshard.zoo:gpt2", (2, 2, 2), steps=2, runner=pool_runner)
    assert report.ok, report
    search = program.plan.search
    assert search["why"].startswith(("pipelined over axis", "no axis pipelined"))
    assert [c["axis"] for c in search["candidates"]] == [None, "a0", "a1", "a2"]
    if search["chosen_pipeline_axis"] is not None:
        assert program.config.axis == search["chosen_pipeline_axis"]


def test_bubble_benchmark_smallest_and_1f1b_keeps_fewer_activations(pool):
    """benchmarks/pipeline_bubbles.py's task on 2 pool ranks (kept from rotting); GPipe holds every
    micro-batch's activations at stage 0, 1F1B at most p of them."""
    from benchmarks.pipeline_bubbles import bubble_task
    peaks = {}
    for schedule in ("GPipe", "1F1B"):
        results = {r: v for r, v in pool.run(bubble_task, 2, 4, schedule, 0.002, 1).items() if v is not None}
        assert set(results) == {0, 1}
        (start, end, busy), = results[0]["steps"]
        assert 0 < busy < end - start
        peaks[schedule] = results[0]["peak_saved_bytes"]
    assert 0 < peaks["1F1B"] < peaks["GPipe"]
