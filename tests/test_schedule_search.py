"""The pipeline search weighs interleaved 1F1B and zero-bubble schedules beside 1F1B, by the simulated timeline of
each schedule's own action order; a schedule the user names is kept."""
import autoshard
from autoshard.zoo import gpt2


def _pipelined(**pipeline):
    model, inputs, loss_fn = gpt2(n_layers=4)
    return autoshard.parallelize(model, (2, 2), inputs, loss_fn=loss_fn, axis_names=("pp", "dp"),
                                 hints={"input:0": {"dp": "S(0)"}}, pipeline=pipeline or None)


def test_the_fastest_schedule_is_chosen_among_those_compared():
    prog = _pipelined()
    rows = prog.plan.pipeline["schedule_search"]
    assert [r["schedule"] for r in rows] == ["1F1B", "Interleaved1F1B", "ZBVZeroBubble"]
    steps = {r["schedule"]: r["predicted_step_s"] for r in rows if "predicted_step_s" in r}
    assert prog.plan.pipeline["schedule"] == min(steps, key=steps.get)
    assert prog.plan.pipeline["predicted_step_s"] == min(steps.values())


def test_a_schedule_the_user_names_is_not_searched():
    prog = _pipelined(schedule="GPipe", microbatches=2)
    assert prog.plan.pipeline["schedule"] == "GPipe" and "schedule_search" not in prog.plan.pipeline
