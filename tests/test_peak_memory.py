"""The step's predicted peak (autoshard/report/peak_memory.py) of a pipeline is per pp rank: a rank's report compares
its own measured peak with its own rank's prediction; without a rank, the fullest rank's (what the planner budgets)."""
import autoshard
from autoshard.report.peak_memory import predicted_peak
from autoshard.zoo import gpt2


def test_a_pipelines_peak_is_each_pp_ranks_and_by_default_the_fullest():
    model, inputs, loss_fn = gpt2(n_layers=4)
    prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("pp",),
                                 pipeline={"microbatches": 4})
    per_rank = [predicted_peak(prog, exact=True, pp_rank=r) for r in range(2)]
    fullest = predicted_peak(prog, exact=True)
    assert fullest == max(per_rank, key=lambda peak: peak["bytes"])
    # the last rank holds the head and the loss, the first the embeddings: their peaks differ
    assert per_rank[0]["bytes"] != per_rank[1]["bytes"]


def test_zero3s_peak_holds_its_reduce_scatter_buffers():
    """ZeRO-3's peak (gathered copies saved as shards, per-layer reduce-scatters): without overlap every layer's
    full gradient waits for sync_grads, so the peak is there and higher, over the footprint (with overlap it can
    stay under it: the footprint counts every activation and gradient at once); gloo's exact path gathers every
    rank's rows."""
    model, inputs, loss_fn = gpt2(n_layers=4)
    prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
                                 hints={"input:0": {"dp": "S(0)"}}, zero=3)
    overlapped, after = predicted_peak(prog, exact=True), predicted_peak(prog, exact=True, overlap=False)
    assert overlapped["phase"] == "backward" and after["phase"] == "gradient sync"
    assert after["bytes"] > overlapped["bytes"] and after["bytes"] > prog.plan.predicted["memory_bytes_per_rank"]
    assert predicted_peak(prog, exact=False)["bytes"] < overlapped["bytes"]
