"""Predictions as typed records (autoshard/cost/prediction.py) keep the dict form plan files and old code use."""
import dataclasses
import json
import warnings

import pytest

import autoshard
from autoshard.cost.prediction import AxisBytes, MemoryParts, NodeCost, Prediction
from autoshard.ir.meta import COMM_COST, NODE_COST
from autoshard.zoo import mlp

KEYS = ["step_time_s", "compute_s", "comm_s", "comm_bytes_per_step", "memory_bytes_per_rank", "recompute_s", "memory",
        "overlapped_step_s"]


@pytest.fixture(scope="module")
def prog():
    model, inputs, loss_fn = mlp(n_layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
                                     hints={"input:0": {"dp": "S(0)"}}, zero=3, checkpoint=["layers.*"])


def test_the_dict_form_is_plain_json_in_the_order_plans_always_had(prog):
    predicted = prog.plan.predicted
    form = dict(predicted)
    assert form == predicted.to_dict() == json.loads(json.dumps(form)) and list(form) == KEYS
    assert type(form["memory"]) is dict and type(form["comm_bytes_per_step"]["dp"]) is dict
    assert form["comm_bytes_per_step"]["dp"]["fwd"] == predicted.comm_bytes_per_step["dp"].fwd > 0
    assert sum(form["memory"].values()) == predicted.memory.total() == predicted.memory_bytes_per_rank


def test_reading_by_key_never_writes(prog):
    predicted = prog.state.predicted.copy()
    with pytest.raises(TypeError):
        predicted["comm_s"] = 0.0
    predicted["memory"]["params"] = -1  # a copy: the record keeps its parts
    assert predicted.memory.params > 0 and predicted == prog.state.predicted


def test_node_costs_are_records_read_by_field_or_key(prog):
    nodes = prog.state.gm.graph.nodes
    costs = [n.meta[NODE_COST] for n in nodes if NODE_COST in n.meta]
    assert all(isinstance(c, NodeCost) and c["seconds"] == c.seconds for c in costs)
    with pytest.raises(dataclasses.FrozenInstanceError):
        costs[0].seconds = 1.0
    comm = next(n.meta[COMM_COST] for n in nodes if COMM_COST in n.meta)
    assert dict(comm) == {"fwd_bytes": comm.fwd_bytes, "bwd_bytes": comm.bwd_bytes, "seconds": comm.seconds,
                          "sync_s": comm.sync_s}


def test_a_plan_file_without_the_optional_figures_loads_and_saves_them_absent(prog, tmp_path):
    data = dict(json.loads(prog.plan.dumps()), fingerprint=None)
    for key in ("recompute_s", "memory", "overlapped_step_s"):
        del data["predicted"][key]
    plan = autoshard.Plan.from_json(data)
    assert plan.predicted.memory is None and "memory" not in plan.predicted
    assert json.loads(plan.dumps())["predicted"] == data["predicted"]
    assert "overlapped" not in plan.summary()


def test_records_from_their_parts():
    p = Prediction(1.0, 0.5, 0.5, {"tp": AxisBytes(fwd=8)}, 64, memory=MemoryParts(params=64))
    p.add_comm(0.25)
    assert (p.comm_s, p.step_time_s, p["memory"]["params"], "recompute_s" in p) == (0.75, 1.25, 64, False)
    assert Prediction.from_dict(p) == p
