"""transformers' mixture-of-experts families (Mixtral, Qwen2-MoE; autoshard/zoo/transformers_moe.py) plan and
verify in float32 (their experts run `torch._grouped_mm`, which has no float64 kernel on the CPU) on a (2,)
mesh with whatever the planner picks, and a hint asking for expert parallelism on their stacked expert weights
is not silently dropped: the grouped matmul cannot keep the expert dim sharded (tokens reach an expert through
data-dependent counts), so the weights are gathered before it, correctly, with a warning naming the op.

Default run: Qwen2-MoE's expert-parallel hint, verified in float32 (Mixtral's automatic plan runs in
tests/test_transformers_families.py); `AUTOSHARD_FULL_MATRIX=1` adds both families' automatic plans and
Mixtral's hint.
"""
import os
import warnings

import pytest

from autoshard.cost.profiles import HardwareProfile
from autoshard.verify.verify import verify_simulated
from autoshard.zoo import transformers_moe

FULL = os.environ.get("AUTOSHARD_FULL_MATRIX") == "1"
FAMILIES = ["qwen2_moe", "mixtral"] if FULL else ["qwen2_moe"]
SLOW_DEVICE = HardwareProfile(name="slow-compute", peak_flops=1e9, memory_bandwidth=1e9)  # sharding pays


@pytest.mark.parametrize("family", FAMILIES if FULL else [])  # Mixtral's automatic plan runs by default elsewhere
def test_the_automatic_plan_verifies_in_float32(family):
    model, inputs, loss_fn = transformers_moe.FACTORIES[family]()
    report, program = verify_simulated(model, inputs, loss_fn, mesh=(2,), dtype="float32", profile=SLOW_DEVICE)
    assert report.ok, str(report)
    assert program.plan.collectives(), program.plan.table()


@pytest.mark.parametrize("family", FAMILIES)
def test_an_expert_parallel_hint_is_gathered_with_a_warning_and_trains_correctly(family):
    model, inputs, loss_fn = transformers_moe.FACTORIES[family]()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report, program = verify_simulated(model, inputs, loss_fn, mesh=(2,), axis_names=("ep",), dtype="float32",
                                           hints=transformers_moe.expert_parallel_hints(family))
    assert report.ok, str(report)
    [warning] = [str(w.message) for w in caught if "mlp.experts.gate_up_proj" in str(w.message)]
    assert "the hint S(0) on mesh axis 'ep' is not realised" in warning
    assert "grouped_mm" in warning and "has no strategy that takes this input as S(0)" in warning
    axis = program.state.mesh.names.index("ep")
    assert str(program.rank_program.param_specs["model.layers.0.mlp.experts.gate_up_proj"][axis]) == "S(0)"
