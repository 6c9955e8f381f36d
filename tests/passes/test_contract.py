"""Pass contracts: every pass declares what it reads, writes and ensures; the manager refuses a pipeline
that runs a pass before what it reads is written; CompileState and CompileOptions accept declared fields
only."""
import pytest
import torch

from autoshard.frontend.request import CompileOptions
from autoshard.ir.errors import UserInputError
from autoshard.passes.contract import PassOrderError, check_order, contract_of
from autoshard.passes.manager import CompileState, run_passes
from autoshard.passes.pass_lists import (
    PASS_LISTS,
    PASSES,
    declared_pass_list,
    state_before,
)
from autoshard.zoo import mlp


def test_every_pass_of_every_declared_pipeline_has_a_contract_and_runs_in_order():
    for name in PASS_LISTS:
        passes, provided = declared_pass_list(name, plan=object())
        assert all(contract_of(p) is not None for p in passes), name
        check_order(passes, provided)


def test_a_pass_before_the_pass_that_writes_what_it_reads_is_refused():
    order = [p.name for p in PASSES]
    swapped = list(PASSES)
    i, j = order.index("solve"), order.index("insert_comm")
    swapped[i], swapped[j] = swapped[j], swapped[i]
    with pytest.raises(PassOrderError, match=r"pass 'insert_comm' reads 'autoshard\.spec', which no pass before it"):
        check_order(swapped)


def test_the_manager_checks_the_order_before_running_anything():
    model, inputs, loss_fn = mlp(n_layers=2)
    state = state_before("normalize", model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",))
    graph_before = state.gm.graph.python_code("self").src
    strategies_then_annotate = [p for p in PASSES if p.name == "strategies"]
    with pytest.raises(PassOrderError):
        run_passes(state, strategies_then_annotate)  # normalize did not run in this list
    assert state.gm.graph.python_code("self").src == graph_before


def test_state_and_options_take_declared_fields_only():
    model, inputs, loss_fn = mlp(n_layers=2)
    state = state_before("normalize", model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",))
    with pytest.raises(AttributeError):
        state.scratch = 1  # a pass that needs a new field declares it on CompileState
    assert isinstance(CompileState(state.gm, state.mesh, state.traced, options={"seed": 3}).options, CompileOptions)
    with pytest.raises(UserInputError, match=r"unknown compile option\(s\) \['memory'\]"):
        CompileOptions.of({"memory": 1e9})
    with pytest.raises(UserInputError, match=r"seed=1\.5: give an int"):
        CompileOptions.parse(seed=1.5)
    assert CompileOptions.parse(profile="cpu").profile.name == "cpu-gloo"
    assert torch.float16 == CompileOptions.parse(mixed_precision="fp16").mixed_precision.compute_dtype
