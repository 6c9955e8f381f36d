"""Overlap at run time (issue 17 item 4): gradient buckets reduced during backward, ZeRO-3's gathers prefetched
and its reduce-scatters started in backward give bitwise the gradients and parameters of the sync after
backward (`module.overlap = False`), on gloo (exact and native collectives) and in the simulator, through
gradient accumulation (with and without no_sync), clipping after the sync and a parameter unused in a step.
"""
import contextlib
import gc
import weakref

import pytest
import torch

import autoshard
from autoshard.runtime.simulator import run_ranks
from autoshard.runtime.zero import ZeroOptimizer
from autoshard.zoo import mlp

DP = ((2,), ("dp",), {"input:0": {"dp": "S(0)"}})
DP4 = ((4,), ("dp",), {"input:0": {"dp": "S(0)"}})
DP_TP = ((2, 2), ("dp", "tp"), {"input:0": {"dp": "S(0)"}, "layers.0.weight": {"tp": "S(0)"},
                                "layers.1.weight": {"tp": "S(1)"}})


def _program(plan, zero=None):
    mesh, names, hints = plan
    model, inputs, loss_fn = mlp(batch=8, in_dim=8, hidden=16, out_dim=8, n_layers=3)
    model, inputs = model.double(), tuple(x.double() for x in inputs)
    prog = autoshard.parallelize(model, mesh, inputs, loss_fn=loss_fn, axis_names=names, hints=hints, zero=zero)
    return prog, inputs


def _train(module, inputs, overlap, accumulate=1, no_sync=True, steps=3):
    """Per step: the gradients after sync_grads and clipping; then the parameters."""
    module.overlap = overlap
    sgd = torch.optim.SGD(module.parameters(), lr=0.1)
    opt = ZeroOptimizer(module, sgd) if module.rank_program.zero is not None else sgd
    local = module.local_inputs(*inputs)
    grads, started = [], []
    for _ in range(steps):
        opt.zero_grad()
        for j in range(accumulate):
            quiet = module.no_sync() if no_sync and j < accumulate - 1 else contextlib.nullcontext()
            with quiet:
                module(*local)[0].backward()
        started.append(module._overlapped is not None and any(p is not None for p in module._overlapped.pending)
                       or module._zero3 is not None and any(not isinstance(group, list)  # a started group
                                                            for one_pass in module._zero3.passes for group in one_pass))
        module.sync_grads()
        module.clip_grad_norm_(0.05)
        grads.append(opt.full_grads() if isinstance(opt, ZeroOptimizer) else
                     {f: p.grad.clone() for f, p in module.named_local_parameters()})
        opt.step()
    zero3 = module.rank_program.zero is not None and module.rank_program.zero.stage == 3
    assert started == [overlap and zero3] + [overlap] * (steps - 1), started  # in backward (buckets: from step 2)
    return grads, {f: p.detach().clone() for f, p in module.named_local_parameters()}


def _both_task(rank, world, plan, zero, exact, accumulate, no_sync):
    from autoshard.runtime.launch import communicator_for
    prog, inputs = _program(plan, zero)
    comm = communicator_for(prog.mesh, exact=exact, strict_world=False)
    if comm is None:
        return None
    return {overlap: _train(prog.module(rank, comm), inputs, overlap, accumulate, no_sync) for overlap in (True, False)}


def _assert_bitwise(results):
    for rank, res in results.items():
        if res is None:
            continue
        (grads_on, params_on), (grads_off, params_off) = res[True], res[False]
        assert len(grads_on) == len(grads_off)
        for step, (on, off) in enumerate(zip(grads_on, grads_off)):
            assert on.keys() == off.keys()
            for fqn in on:
                assert torch.equal(on[fqn], off[fqn]), (rank, step, fqn)
        for fqn in params_on:
            assert torch.equal(params_on[fqn], params_off[fqn]), (rank, fqn)


GLOO = {"dp2-exact": (DP, None, True, 1, True), "dp2xtp2-native-accumulate": (DP_TP, None, False, 2, True),
        "dp2-native-accumulate-without-no_sync": (DP, None, False, 2, False),
        "dp2xtp2-zero3-native-accumulate": (DP_TP, 3, False, 2, True), "dp2-zero2-exact": (DP, 2, True, 1, True),
        "dp4-zero3-native": (DP4, 3, False, 1, True)}  # four ranks: gloo's own sums depend on the layout


@pytest.mark.parametrize("case", list(GLOO))
def test_overlapped_equals_sync_after_backward_on_gloo(pool, case):
    plan, zero, exact, accumulate, no_sync = GLOO[case]
    _assert_bitwise(pool.run(_both_task, plan, zero, exact, accumulate, no_sync))


@pytest.mark.parametrize("zero", [None, 1, 3])
def test_overlapped_equals_sync_after_backward_in_the_simulator(zero):
    prog, inputs = _program(DP_TP, zero)
    _assert_bitwise(run_ranks(prog, lambda m: {o: _train(prog.module(m.rank, m.comm), inputs, o, accumulate=2)
                                               for o in (True, False)}))


def test_a_parameter_unused_in_a_step_falls_back_and_still_agrees():
    prog, inputs = _program(DP)

    def train(module):
        module.sync_grads()  # nothing yet: the layout is empty
        _train(module, inputs, True, steps=2)
        module.zero_grad()
        module(*module.local_inputs(*inputs))[0].backward()
        module.gm.layers_0_bias.grad = None  # as if unused this step: the layout changed
        module.sync_grads()
        return module.gm.layers_1_bias.grad, module._overlapped is not None

    results = run_ranks(prog, train)
    assert torch.equal(results[0][0], results[1][0]) and results[0][1]


def test_a_dropped_module_is_freed_with_its_communicator():
    """The gradient hooks hold their sync weakly: a parameter -> hook -> sync -> parameter cycle runs through
    autograd's C++ hooks, which Python's GC cannot see, so the module, its communicator and (on real ranks) its
    process groups lived until the interpreter exited, where a gloo thread aborted the process."""
    prog, inputs = _program(DP)

    def train_and_drop(rank_module):
        module = prog.module(rank_module.rank, rank_module.comm)
        _train(module, inputs, True, steps=2)  # the second step's backward runs the overlap hooks
        assert module._overlapped is not None
        freed = weakref.ref(module._overlapped)
        params = list(module.parameters())  # the parameters outlive the module (an optimizer's, say)
        del module
        gc.collect()
        module_gone = freed() is None
        params[0].sum().backward()  # a hook whose sync is gone does nothing
        return module_gone

    assert all(run_ranks(prog, train_and_drop).values())
