"""Tier 3 for the automatic planner: no hints at all, real gloo ranks, equal to the single device.

A slow-compute profile makes sharding pay even for the tiny zoo models, so these plans really are
parallel (each test asserts communication happens) and exercise many strategies. By default three cases
run on gloo and the rest in the simulator, which is bitwise equal to gloo (test_sim_equals_real.py), and
(2,2,2) plans three models (llama on (2,2,2) only, resnet on (2,) only); the solver finds Megatron for gpt2 at tp=2 (and llama
at tp=4 in the full matrix); `AUTOSHARD_FULL_MATRIX=1` runs every model on every mesh on gloo and both models at both degrees.
"""
import os

import pytest

from autoshard.cost.profiles import HardwareProfile, Link
from autoshard.verify.verify import verify_factory
from autoshard.zoo import FACTORIES
from autoshard.zoo.hints import megatron

SLOW_COMPUTE = HardwareProfile(name="slow-compute", peak_flops=1e8, memory_bandwidth=1e8, devices_per_node=64,
                               intra_node=Link(1e-5, 1e9), inter_node=Link(1e-5, 1e9))
# Matmul-bound (cheap elementwise ops, as on accelerators): splitting norms and residuals does not pay,
# so the optimum at weight-heavy shapes is Megatron's column/row pattern.
MATMUL_BOUND = HardwareProfile(name="matmul-bound", peak_flops=2e10, memory_bandwidth=1e12, devices_per_node=64,
                               intra_node=Link(5e-5, 1e9), inter_node=Link(5e-5, 1e9))
FULL = os.environ.get("AUTOSHARD_FULL_MATRIX") == "1"
THREE_AXES = FACTORIES if FULL else ("mlp", "gpt2", "llama")  # by default the others on (2,) and (2, 2) only
# by default llama's automatic plan runs on (2,2,2) (on gloo) only, resnet's on (2,) (convolutions: zoo_verify)
TWO_AXES = FACTORIES if FULL else [m for m in FACTORIES if m not in ("llama", "resnet")]
AUTO_CASES = [(m, mesh) for m in FACTORIES for mesh in [(2,), (2, 2), (2, 2, 2)]
              if len(mesh) == 1 or (len(mesh) == 2 and m in TWO_AXES) or (len(mesh) == 3 and m in THREE_AXES)]
ON_GLOO = {("mlp", (2,)), ("gpt2", (2, 2)), ("llama", (2, 2, 2))}


@pytest.mark.parametrize("model,mesh", AUTO_CASES, ids=[f"{m}-{'x'.join(map(str, s))}" for m, s in AUTO_CASES])
def test_auto_plan_matches_single_device(pool_runner, model, mesh):
    simulate = not FULL and (model, mesh) not in ON_GLOO
    report, program = verify_factory(f"autoshard.zoo:{model}", mesh, runner=pool_runner, profile=SLOW_COMPUTE,
                                     pipeline=False, simulate=simulate)  # the intra-op planner (pipelines: test_pipeline.py)
    assert report.ok, report
    moved = sum(b for axis in program.plan.predicted["comm_bytes_per_step"].values() for b in axis.values())
    assert moved > 0, program.plan.summary()  # a real parallel plan, not everything replicated
    for axis, kinds in report.collectives.items():
        counted = sum(k["bytes"] for k in kinds.values())
        predicted = sum(program.plan.predicted["comm_bytes_per_step"][axis].values())
        assert counted == predicted, (axis, counted, predicted)


MEGATRON_CASES = [(m, tp) for m in ("gpt2", "llama") for tp in (2, 4)] if FULL else [("gpt2", 2)]


@pytest.mark.parametrize("model,tp", MEGATRON_CASES)
def test_solver_rediscovers_megatron(pool_runner, model, tp):
    factory = f"autoshard.zoo.hints:{model}_wide"
    auto, auto_prog = verify_factory(factory, (tp,), ("tp",), runner=pool_runner, profile=MATMUL_BOUND)
    hinted, hinted_prog = verify_factory(factory, (tp,), ("tp",), hints=megatron(model, "tp"), runner=pool_runner,
                                         profile=MATMUL_BOUND)
    assert auto.ok and hinted.ok
    assert auto.collectives == hinted.collectives  # counted: 2 all-reduces per layer each way, same bytes
    assert auto_prog.plan.predicted["comm_bytes_per_step"] == hinted_prog.plan.predicted["comm_bytes_per_step"]
