"""Issue 29 on real gloo ranks: a transformers Llama wrapped in a user's module (autoshard/zoo/wrapped.py) is
built on the meta device on every rank and loaded with `prog.module(rank, comm, weights=dir)` from the
directory the inner model's `save_pretrained` wrote (its names lack the wrapper's `inner.`; the tied head
is saved once), without init_fn= (the rotary tables come from the inner model's `_init_weights`). It trains
2 SGD steps on dp x tp exactly like the single device (float64, verify's 1e-6): losses, outputs, gradients
and parameters. The ranks apply the plan the test process made, as verify's ranks do.
"""
import torch

import autoshard
from autoshard.ir.mesh import Mesh
from autoshard.verify.report import compare
from autoshard.verify.training import VerifyOptions
from autoshard.verify.verify import (
    VerifyTask,
    build_case,
    reference_runs,
    verify_rank_task,
)
from autoshard.zoo.wrapped import HINTS

FACTORY = "autoshard.zoo.wrapped:wrapped_llama"
MESH = Mesh((2, 2), ("dp", "tp"))
OPTIONS = VerifyOptions(steps=2, lr=0.1)


def test_wrapped_meta_llama_loaded_from_the_inner_save_pretrained_trains_like_one_device(pool, tmp_path):
    model, inputs, loss_fn = build_case(FACTORY)  # float64, seeded
    model.inner.save_pretrained(tmp_path)
    ref, noise = reference_runs(model, inputs, loss_fn, OPTIONS)
    with torch.device("meta"):
        planned, _, _ = build_case(FACTORY)
    program = autoshard.parallelize(planned, MESH, inputs, hints=HINTS, loss_fn=loss_fn)
    shared = {**program.plan.to_json(), "fingerprint": program.plan.fingerprint}
    task = VerifyTask(FACTORY, MESH.to_json(), program.state.hints.to_json(), OPTIONS, plan=shared,
                      weights=str(tmp_path), inputs=inputs)
    results = pool.run(verify_rank_task, task)
    ranks = {rank: result for rank, result in results.items() if result is not None}
    assert len(ranks) == MESH.size
    report = compare(program, ref, ranks, OPTIONS, noise)
    assert report.ok, str(report)
