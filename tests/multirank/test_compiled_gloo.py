"""parallelize(..., compile=True) on real gloo ranks equals the single device (float64; bf16 within verify's
noise-based float32 tolerance): ZeRO-3, a 1F1B pipeline, mixed precision, gradient accumulation with clipping,
all with dropout (rng="exact"). Every rank compiles its program (tens of seconds on 2 cores), so these run
with `AUTOSHARD_FULL_MATRIX=1` only; by default one small tensor-parallel net with dropout in a recomputed
block runs (ranks must be processes: the simulator's threads run compile=True eagerly)."""
import os

import pytest
from test_compiled import NET_HINTS, has_cpp_compiler

from autoshard.verify.verify import verify_factory
from autoshard.zoo.hints import megatron

FULL = os.environ.get("AUTOSHARD_FULL_MATRIX") == "1"

GLOO_CASES = {
    "zero3": {"mesh": (2,), "axis_names": ("dp",), "hints": {"input:0": {"dp": "S(0)"}}, "zero": 3,
              "optimizer": "adam"},
    "pipeline-1f1b": {"mesh": (2,), "axis_names": ("pp",), "pipeline": {"microbatches": 2, "schedule": "1F1B"}},
    "bf16": {"mesh": (2,), "axis_names": ("tp",), "hints": megatron("gpt2"), "mixed_precision": "bf16",
             "dtype": "float32"},
    "accumulate": {"mesh": (2, 2), "axis_names": ("dp", "tp"), "hints": {**megatron("gpt2"), "input:0": {"dp": "S(0)"}},
                   "accumulate": 2, "clip_grad_norm": 0.5},
}


@pytest.mark.skipif(not has_cpp_compiler(), reason="compile=True needs a C++ compiler for inductor (g++ or $CXX)")
def test_compiled_net_with_dropout_and_recompute_equals_single_device(pool_runner):
    report, program = verify_factory("test_compiled:net_factory", (2,), ("tp",), runner=pool_runner, compile=True,
                                     hints=NET_HINTS, checkpoint=["block"])
    assert report.ok, report
    assert report.random_ops == 1 and report.collectives["tp"]["all_reduce"]["fwd"] == 1
    assert program.state.options.compile


@pytest.mark.skipif(not FULL, reason="compiles on every rank (tens of seconds); AUTOSHARD_FULL_MATRIX=1 runs it")
@pytest.mark.parametrize("case", list(GLOO_CASES))
def test_compiled_on_gloo_equals_single_device(pool_runner, case):
    options = dict(GLOO_CASES[case])
    report, _ = verify_factory("autoshard.zoo:gpt2_dropout", options.pop("mesh"), options.pop("axis_names"),
                               runner=pool_runner, compile=True, **options)
    assert report.ok, report
