"""What a pipeline's micro-batch program is priced at: the ILP counts one pp rank's share of the parameters, a
stage's time includes its recomputation, the fullest pp rank is held to the budget, and the ILP's objective is
predict's step (less the gradient sync a micro-batch does not pay) also under mixed precision on three axes, where
fused gathers of one value by several chains once paid its all-reduce back per chain."""
import math

import autoshard
from autoshard.ir.meta import NODE_COST
from autoshard.zoo import gpt2


def _sync(prog) -> float:
    return sum(n.meta[NODE_COST].sync_s for n in prog.state.gm.graph.nodes if NODE_COST in n.meta)


def test_bf16_micro_batch_objective_is_its_predicted_step_on_three_axes():
    model, inputs, loss_fn = gpt2(batch=16, seq=512, dim=1024, n_heads=8, n_layers=3, vocab_size=4096,
                                  device="meta")
    m = 8
    prog = autoshard.parallelize(model, (2, 2, 2), inputs, loss_fn=loss_fn, profile="a100", mixed_precision="bf16",
                                 memory_budget=float("inf"), fold_layers=False,
                                 pipeline={"axis": "a0", "microbatches": m, "schedule": "1F1B"})
    step = prog.plan.predicted["step_time_s"]
    objective = prog.state.objective_s
    assert objective > 0
    assert math.isclose(objective, step - _sync(prog) * (1 - 1 / m), rel_tol=0.05), (objective, step, _sync(prog))


def test_a_stage_time_includes_its_recomputation():
    model, inputs, loss_fn = gpt2(n_layers=4)
    options = {"axis_names": ("pp",), "pipeline": {"microbatches": 2, "schedule": "1F1B"}}
    plain = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, **options)
    recomputed = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, checkpoint=["layers.*"], **options)
    rows = recomputed.plan.pipeline["stage_table"]
    assert all(row["recompute_s"] > 0 for row in rows)
    assert sum(row["seconds"] for row in rows) > sum(row["seconds"] for row in plain.plan.pipeline["stage_table"])
    assert recomputed.plan.pipeline["predicted_step_s"] > plain.plan.pipeline["predicted_step_s"]
    for row in rows:  # the recompute runs in backward
        assert math.isclose(row["fwd_s"] + row["bwd_s"], row["seconds"])
        assert row["bwd_s"] > 2 * row["fwd_s"]


def test_each_pp_rank_holds_its_share_of_the_parameters_when_the_ilp_plans():
    """A budget below the whole model's parameters but above a pp rank's: the pipeline plans without a memory
    saver; the same budget on the flat mesh needs one."""
    model, inputs, loss_fn = gpt2(n_layers=4, dim=256, vocab_size=512)
    pipe = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("pp",),
                                 pipeline={"microbatches": 2, "schedule": "1F1B"}, memory_budget=float("inf"))
    fullest = max(pipe.plan.pipeline["memory_bytes_per_pp_rank"])
    flat = autoshard.parallelize(model, (1,), inputs, loss_fn=loss_fn, axis_names=("dp",))
    params = flat.plan.predicted["memory"]
    budget = 0.75 * (params["params"] + params["grads"] + params["optimizer"])
    assert fullest < budget
    fitted = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("pp",),
                                   pipeline={"microbatches": 2, "schedule": "1F1B"}, memory_budget=budget)
    assert repr(fitted.state.memory_savers) == "no memory saver"
    assert max(fitted.plan.pipeline["memory_bytes_per_pp_rank"]) <= budget


def test_a_recut_program_is_the_fresh_compile_of_its_schedule():
    """The schedule search cuts the planned micro-batch program again instead of planning it again: the same plan."""
    from autoshard.frontend.request import CompileRequest
    from autoshard.program.pipeline import parallelize_pipeline, recut_pipeline

    model, inputs, loss_fn = gpt2(n_layers=4)
    request = CompileRequest(model, autoshard.Mesh((2, 2), ("pp", "dp")), inputs, loss_fn=loss_fn)
    first = parallelize_pipeline(request, "pp", {"microbatches": 4, "schedule": "1F1B"})
    for schedule in ("Interleaved1F1B", "ZBVZeroBubble"):
        options = {"microbatches": 4, "schedule": schedule, "virtual_stages": 2}
        fresh = parallelize_pipeline(request, "pp", options)
        again = recut_pipeline(request, first, options)
        assert again.plan.fingerprint == fresh.plan.fingerprint
        assert again.plan.dumps() == fresh.plan.dumps()
    assert first.config.schedule == "1F1B" and first.plan.pipeline["stages"] == 2  # the original is untouched



def test_a_recut_that_overflows_the_budget_is_planned_again_only_against_tighter_budgets(monkeypatch):
    """A schedule's cut whose fullest pp rank overflows the budget (ZBV's here: 1.13 MB against 1 MB, where 1F1B's
    plan keeps 0.72 MB) gives the program a fresh compile of that schedule gives, without compiling the micro-batch
    program again at the budget the cut overflowed: only the plans against tighter budgets are made."""
    from autoshard.frontend.request import CompileRequest
    from autoshard.program import pipeline

    model, inputs, loss_fn = gpt2(n_layers=4)
    request = CompileRequest(model, autoshard.Mesh((2, 2), ("pp", "dp")), inputs, loss_fn=loss_fn)
    request = request.replace(options=request.options.replace(memory_budget=10**6))
    first = pipeline.parallelize_pipeline(request, "pp", {"microbatches": 4, "schedule": "1F1B"})
    zbv = {"microbatches": 4, "schedule": "ZBVZeroBubble", "virtual_stages": 2}
    compiled, original = [], pipeline.compile_state

    def counted(micro, **kwargs):
        compiled.append(micro.options.memory_budget)
        return original(micro, **kwargs)

    monkeypatch.setattr(pipeline, "compile_state", counted)
    fresh = pipeline.parallelize_pipeline(request, "pp", zbv)
    fresh_budgets, compiled[:] = list(compiled), []
    again = pipeline.recut_pipeline(request, first, zbv)
    assert again.plan.dumps() == fresh.plan.dumps()
    assert fresh_budgets[0] == 10**6 and compiled == fresh_budgets[1:] and compiled  # the tighter ones only

def test_the_ilp_counts_the_activations_each_schedule_keeps_in_flight():
    """GPipe keeps every micro-batch's activations until the backward, 1F1B's first rank p of its 1/p of the layers:
    the ILP's memory row (before the cut) comes within the imbalance of the cut of the fullest rank (after it)."""
    model, inputs, loss_fn = gpt2(n_layers=4)
    for schedule in ("1F1B", "GPipe"):
        prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("pp",),
                                     pipeline={"microbatches": 4, "schedule": schedule}, memory_budget=float("inf"))
        fullest = max(prog.plan.pipeline["memory_bytes_per_pp_rank"])
        assert 0.95 * fullest <= prog.state.memory_row_bytes <= 1.1 * fullest, (schedule, prog.state.memory_row_bytes,
                                                                                  fullest)
