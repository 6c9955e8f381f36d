"""Tier 3: models built on the meta device on every rank, their weights read from a safetensors file
(only each rank's slices) or replayed from the model's initialisation, train on real gloo ranks exactly
like the single device loaded from the same file (float64, verify's 1e-6): losses, gradients and
parameters after 2 steps. The launcher writes the file from its seeded model (verify_factory(weights=)).
The zoo's GPT-2 read from safetensors trains on gloo in test_train_then_save.py; a pipeline's ranks
reading only their stages' tensors is tests/test_weights.py::test_pipeline_stages_read_only_their_tensors
(simulated; `AUTOSHARD_FULL_MATRIX=1` adds pp x dp x tp on gloo here).
"""
import os

import pytest

from autoshard.verify.verify import verify_factory
from autoshard.zoo.hints import plan_hints
from autoshard.zoo.transformers_hints import HINTS

LLAMA = "autoshard.zoo.transformers_families:llama"
DP_ONLY = {"input:0": {"dp": "S(0)"}, "input:1": {"dp": "S(0)"}}
CASES = {
    "transformers-llama-dp2xtp2": (LLAMA, (2, 2), ("dp", "tp"), HINTS["llama"], {}),
    "transformers-llama-zero3-dp4": (LLAMA, (4,), ("dp",), DP_ONLY, {"zero": 3}),
}
if os.environ.get("AUTOSHARD_FULL_MATRIX") == "1":  # by default the simulator covers the stages' reads
    CASES["transformers-llama-pp2xdp2xtp2"] = (LLAMA, (2, 2, 2), ("pp", "dp", "tp"), HINTS["llama"],
                                               {"pipeline": {"microbatches": 2}})


@pytest.mark.parametrize("case", list(CASES))
def test_meta_model_loaded_from_safetensors_trains_like_the_single_device(pool_runner, case):
    factory, mesh, names, hints, options = CASES[case]
    report, program = verify_factory(factory, mesh, names, hints=hints, runner=pool_runner, weights="safetensors",
                                     **options)
    assert report.ok, f"{case}:\n{report}"


def test_init_on_every_rank_equals_the_single_device_initialisation(pool_runner):
    report, _ = verify_factory("autoshard.zoo:llama", (2, 2), ("dp", "tp"), hints=plan_hints("llama", ("dp", "tp"),
                               ("dp",), "tp"), runner=pool_runner, weights="init")
    assert report.ok, str(report)
