"""No hangs: a rank that dies, raises or hangs mid-step makes the others fail within the collective timeout,
naming the rank and the collective, and `run_distributed` raises promptly naming the failed rank; ranks
that plan different programs fail at the fingerprint check, before any collective.

These use `run_distributed` (fresh gloo ranks per test), not the shared pool: killing a rank breaks a pool.
"""
import os
import re
import time

import pytest

from autoshard.runtime import launch
from autoshard.runtime.launch import RanksFailed, run_distributed

TIMEOUT_S = 10.0
MEGATRON = {"input:0": {"dp": "S(0)"}, "layers.0.weight": {"tp": "S(0)"}, "layers.0.bias": {"tp": "S(0)"},
            "layers.1.weight": {"tp": "S(1)"}}


def _program(hints, mesh=(2, 2), names=("dp", "tp")):
    import autoshard
    from autoshard.zoo import mlp
    model, inputs, loss_fn = mlp(batch=8, in_dim=8, hidden=16, out_dim=8)
    return autoshard.parallelize(model, mesh, inputs, loss_fn=loss_fn, axis_names=names, hints=hints), inputs


def _step_task(rank, world, mode, at_call, mesh, names):
    """Plan, check fingerprints, then one training step in which rank 1 misbehaves as `mode` says when it
    enters its `at_call`-th collective."""
    from autoshard.runtime.launch import check_fingerprint, communicator_for
    hints = {k: v for k, v in MEGATRON.items() if all(axis in names for axis in v)}
    prog, inputs = _program(hints, mesh, names)
    comm = communicator_for(prog.mesh)
    check_fingerprint(comm, prog.plan.fingerprint)
    module = prog.module(rank, comm)
    if rank == 1:
        calls = {"n": 0}

        def misbehaving(collective):  # every collective is one of the two primitives, blocking or started
            def misbehave(tensor, axis, what):
                calls["n"] += 1
                if calls["n"] == at_call:
                    if mode == "exit":
                        os._exit(1)
                    if mode == "raise":
                        raise ValueError("injected failure in rank 1")
                    if mode == "hang":
                        time.sleep(600)
                return collective(tensor, axis, what)
            return misbehave

        comm.all_gather_list = misbehaving(comm.all_gather_list)
        comm.start_all_gather_list = misbehaving(comm.start_all_gather_list)
    started = time.monotonic()
    try:
        loss, _ = module(*module.local_inputs(*inputs))
        comm.phase = "bwd"
        loss.backward()
        module.sync_grads()
    finally:
        elapsed = time.monotonic() - started
        assert elapsed < TIMEOUT_S + 5, f"rank {rank} waited {elapsed:.1f} s for a failed peer"
    return "finished"


def test_a_rank_that_dies_mid_step_fails_the_others_promptly():
    start = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        run_distributed(_step_task, 4, "exit", 2, (2, 2), ("dp", "tp"), timeout_s=TIMEOUT_S)
    took = time.monotonic() - start
    failure = info.value
    text = str(failure)
    assert re.match(r"[234] of 4 ranks failed; rank 1 died \(exit code 1\) without reporting a result: it crashed",
                    text), text
    assert failure.exit_codes == {1: 1} and not failure.hung and failure.errors
    # The peers that still needed rank 1 fail in a collective naming rank, collective, axis, group and rank 1.
    for rank, (kind, first, _) in failure.errors.items():
        assert kind == "CollectiveTimeout", first
        assert re.match(rf"rank {rank}: all_reduce on mesh axis '(dp|tp)' \(group ranks \[(1, {rank}|{rank}, 1)\], "
                        r"(forward|backward)\) failed after \d+\.\d s: .*\. Rank 1 died, raised, hangs or runs a "
                        r"different plan: look at its error", first), first
        assert f"\n  rank {rank}: all_reduce on mesh axis" in text
    assert took < 45, f"run_distributed took {took:.0f} s to report a dead rank"


def test_a_rank_that_raises_mid_step_is_named_as_the_cause():
    with pytest.raises(RanksFailed) as info:
        run_distributed(_step_task, 2, "raise", 1, (2,), ("tp",), timeout_s=TIMEOUT_S)
    text = str(info.value)
    assert text.startswith("2 of 2 ranks failed; rank 1 raised ValueError: injected failure in rank 1\n"
                           "  rank 0: all_reduce on mesh axis 'tp' (group ranks [0, 1], forward)"), text
    assert "rank 1's traceback:" in text and "misbehave" in text


def test_a_rank_that_hangs_is_stopped_after_the_timeout(monkeypatch):
    monkeypatch.setattr(launch, "FAILURE_GRACE_S", 1.0)
    start = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        run_distributed(_step_task, 2, "hang", 1, (2,), ("tp",), timeout_s=3.0)
    took = time.monotonic() - start
    text = str(info.value)
    assert info.value.hung == [1]
    assert text.startswith("2 of 2 ranks failed; rank 1 reported nothing 4 s after the first failure and was "
                           "stopped: it hangs outside a collective\n  rank 0: all_reduce on mesh axis 'tp' "
                           "(group ranks [0, 1], forward) did not complete within the 3 s timeout"), text
    assert took < 45, took


def _mismatched_plans_task(rank, world):
    from autoshard.runtime.launch import check_fingerprint, communicator_for
    hints = {"input:0": {"dp": "S(0)"}} if rank == 0 else {"input:0": {"dp": "S(0)"}, "layers.0.weight": {"dp": "S(0)"}}
    prog, _ = _program(hints, (2,), ("dp",))
    check_fingerprint(communicator_for(prog.mesh), prog.plan.fingerprint)
    return prog.plan.fingerprint


def test_ranks_with_different_plans_fail_at_the_fingerprint_check():
    with pytest.raises(RanksFailed) as info:
        run_distributed(_mismatched_plans_task, 2, timeout_s=TIMEOUT_S)
    failure = info.value
    assert set(failure.errors) == {0, 1}
    kind, first, _ = failure.errors[1]
    assert kind == "FingerprintMismatch"
    assert first.startswith("rank 1: the ranks planned different programs (plan fingerprints: ")
    fingerprints = first.split("(plan fingerprints: ")[1].split(")")[0]
    parts = sorted(fingerprints.split("; "))
    assert len(parts) == 2 and {p.split(" on ")[1] for p in parts} == {"rank 0", "rank 1"}, fingerprints
    assert "save the plan on one rank (prog.plan.save(path)) and pass plan=path" in first


def _sleep_task(rank, world, seconds):
    time.sleep(seconds)
    return rank


def test_total_s_bounds_the_whole_task_apart_from_each_collective():
    """`total_s` is the whole task's deadline (a benchmark training many plans passes a long one); the ranks that
    outlast it are reported as hung, the message naming that deadline, not the collective timeout's."""
    start = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        run_distributed(_sleep_task, 2, 120.0, timeout_s=TIMEOUT_S, total_s=2.0)
    took = time.monotonic() - start
    assert sorted(info.value.hung) == [0, 1]
    assert "did not finish within 2 s (no rank failed" in str(info.value) and "total_s" in str(info.value)
    assert took < 30, took
