"""The smallest configuration of each benchmark runs end to end (so the benchmarks cannot silently rot).
Nothing is timed or judged here and RESULTS.md is not written; `python -m benchmarks` does that."""
import os

import pytest

from benchmarks import (
    moe,
    plan_quality,
    planning,
    planning_moe,
    planning_scale,
    prediction_accuracy,
    rank_waits,
    runtime_overhead,
    tp_modes,
    zero_memory,
)

TINY_GPT2 = {"gpt2": {"batch": 4, "seq": 8, "dim": 32, "n_heads": 4}}


@pytest.fixture(autouse=True)
def no_pass_verifier(monkeypatch):
    """The suite verifies every compile (AUTOSHARD_DEBUG); the benchmarks measure compiles as users run them."""
    monkeypatch.setenv("AUTOSHARD_DEBUG", "0")


FULL = os.environ.get("AUTOSHARD_FULL_MATRIX") == "1"
GLOO_BENCHMARKS = pytest.mark.skipif(not FULL, reason="a gloo benchmark's smallest run (about 6 s); "
                                                      "AUTOSHARD_FULL_MATRIX=1 runs it")


@GLOO_BENCHMARKS
def test_plan_quality_smallest():
    rows = plan_quality.measure([((2,), ("tp",))], ["gpt2"], shapes=TINY_GPT2)
    assert {r["variant"] for r in rows} == {"autoshard auto", "autoshard + Megatron hints", *plan_quality.TORCH_PLANS}
    auto = next(r for r in rows if r["variant"] == "autoshard auto")
    assert auto["counted_logical"] == auto["commlog"]  # the dispatcher counter sees what CommLog records
    body, headers, csv_rows = plan_quality.report(rows)
    assert "gpt2" in body and len(csv_rows) == len(rows) and len(headers) == len(csv_rows[0])


@GLOO_BENCHMARKS
def test_runtime_overhead_smallest():
    rows = runtime_overhead.measure((2,), {64: (1, 1)})
    assert set(rows[0]["times"]) == {"single device", "hand-written Megatron", "DTensor parallelize_module",
                                     "autoshard"}
    body, _, _ = runtime_overhead.report(rows)
    assert "| 2     | 64" in body


@pytest.mark.skipif(not FULL, reason="a planning run in a fresh process (about 5 s); AUTOSHARD_FULL_MATRIX=1 runs it")
def test_planning_smallest():
    result = planning.run({"model": "llama", "batch": 2, "seq": 16, "dim": 64, "n_heads": 8, "n_kv_heads": 4, "n_layers": 2,
                               "ffn_dim": 128, "vocab_size": 64, "mesh": [2], "memory_budget": float("inf")})
    assert result["plan_s"] > 0 and result["ilp"] and result["ilp"][0]["variables"] > 0


@pytest.mark.skipif(not FULL, reason="three candidate meshes, Megatron's layout and a simulated check (about 20 s); "
                                     "AUTOSHARD_FULL_MATRIX=1 runs it")
def test_planning_scale_smallest():
    tiny = {"dim": 32, "n_heads": 4, "vocab_size": 64, "seq": 16, "n_layers": 8}
    result = planning_scale.plan_model(("tiny", 4, 64, 8, 2, 2, 8, 16, 0.5), seq=16, vocab=128, tiny=tiny)
    assert [c["mesh"] for c in result["candidates"]] == [[8], [2, 4], [2, 2, 2]]
    assert result["published"]["names"] == ("pp", "dp", "tp") and result["published"]["recomputed"] == 8
    assert result["verify"]["ok"], result["verify"]["report"]
    assert result["verify"]["built_ranks"] == [0, 7], result["verify"]["built_error"]  # its file, at the real width
    configs, figures, checks, headers, csv_headers, csv_rows, _ = planning_scale.report([result])
    assert [len(rows[0]) for rows in (configs, figures, checks)] == [len(h) for h in headers]
    assert len(csv_rows[0]) == len(csv_headers)


@pytest.mark.skipif(not FULL, reason="a devices=8 search, the expert's layout and a simulated check (about 45 s); "
                                     "AUTOSHARD_FULL_MATRIX=1 runs it")
def test_planning_moe_smallest():
    result = planning_moe.plan_run(planning_moe.QUICK[0])
    assert result["expert"]["names"] == ("ep",) and result["auto"]["mesh"]
    assert result["verify"]["ok"], result["verify"]["report"]
    assert result["verify"]["built_ranks"], result["verify"]["built_error"]
    rows, headers, csv_rows, csv_headers, _ = planning_moe.report([result])
    assert len(rows[0]) == len(headers) and len(csv_rows[0]) == len(csv_headers)


@pytest.mark.skipif(not FULL, reason="calibrate and train the zoo GPT-2 on 1 and 2 gloo ranks (about 60 s); "
                                     "AUTOSHARD_FULL_MATRIX=1 runs it")
def test_prediction_accuracy_smallest():
    rows = prediction_accuracy.measure(quick=True)
    measured = [r for r in rows if "error" not in r]
    assert {r["world"] for r in measured} == {1, 2} and all(r["measured"]["step_s"] > 0 for r in measured)
    assert all(len(r["rounds"]) == prediction_accuracy.ROUNDS and r["measured"]["step_s"] in r["rounds"]
               for r in measured)  # the median round is the figure
    assert all(r["bytes"] == {a: r["sent"][a] for a in r["bytes"]} for r in measured)  # the plan's bytes, sent
    # the prediction: the mean of the plan's prices under the calibrations before and after its runs
    assert all(r["predicted"]["step_s"] == pytest.approx((r["predicted_before"]["step_s"]
                                                           + r["predicted_after"]["step_s"]) / 2) for r in measured)
    body, headers, csv_rows = prediction_accuracy.report(rows)
    assert "Step time:" in body and len(csv_rows) == len(rows) and len(headers) == len(csv_rows[0])


@pytest.mark.skipif(not FULL, reason="ZeRO-3 measured on simulated ranks (about 5 s; tests/passes/test_zero_verify.py "
                                     "checks the same bound); AUTOSHARD_FULL_MATRIX=1 runs it")
def test_parallel_modes_pieces():
    per_axis = tp_modes.per_layer("2d", 4, None)
    assert set(per_axis) == {"row", "col"} and all(counted > 0 for counted, _ in per_axis.values())
    assert zero_memory.check_line(zero_memory.zero3_check("gpt2")).endswith("-- met")


def test_moe_bytes_smallest():
    rows = moe.measure_bytes(moe.BYTES_CASES[:1])
    assert rows[0]["match"] and rows[0]["verify"] == "OK"
    body, table_rows = moe.report(rows, [])
    assert "4 x layers x G x E x C x D" in body and table_rows == []


@pytest.mark.skipif(not FULL, reason="two automatic plans with the pipeline search (about 5 s); "
                                     "AUTOSHARD_FULL_MATRIX=1 runs it")
def test_moe_choices_smallest():
    tiny = {"tiny": {"dim": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128, "n_experts": 4, "top_k": 2,
                     "vocab_size": 64, "n_layers": 2}}
    choices = moe.plan_choices(True, shapes=tiny, mesh=(2, 2), batch=4, seq=16, group=16)
    assert [r["run"] for r in choices] == ["automatic", "automatic, pipeline=False"]
    assert len(moe.report([], choices)[1]) == 2


@GLOO_BENCHMARKS
def test_rank_waits_smallest():
    (row,) = rank_waits.measure(quick=True)
    assert len(row["ranks"]) == 2 and all(r["alone_s"] > 0 for r in row["ranks"])
    parts = rank_waits.decomposed(row)
    assert parts["busy_s"] > 0 and parts["waiting_s"] >= 0  # medians per phase: their sum need not stay under the step
    body = rank_waits.report([row])
    assert "llama (zoo)" in body and "data parallel" in body and "all-reduce alone" in body
