"""`autoshard.parallelize(model, mesh)` without example inputs on 8 real gloo ranks: a plain training loop (the
module returns the loss, `loss.backward()` reduces the gradients when backward ends, a torch optimizer made before
the first batch over `module.parameters()`) trains like one device in float64 — through a batch of another size
(re-specialised, not re-planned), gradient accumulation under `no_sync`, clipping by the global norm, and ZeRO-2
with `autoshard.ZeroOptimizer` made before the first batch."""
import warnings

import torch

import autoshard
from autoshard.ir.placement import Spec, parse_placement, unshard_tensors
from autoshard.zoo import llama

VOCAB = 64


def _model():
    model, _, loss_fn = llama(n_layers=2)
    return model.double(), loss_fn


def _batches(sizes):
    data = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (b, 16), generator=data) for b in sizes]


def _step_plan():
    """(batch sizes of each optimizer step's backward passes, clip norm): three steps, the second accumulating
    two halves, the third a smaller batch."""
    return [((16,), 0.5), ((8, 8), 0.5), ((8,), None)]


def _single_device():
    model, loss_fn = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for sizes, clip in _step_plan():
        for ids in _batches(sizes):
            loss = loss_fn(model(ids), ids)
            loss.backward()
            losses.append(loss.item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach() for k, v in model.named_parameters()}


def _plain_loop_task(rank, world, mesh, axis_names, zero, hints, save_to=None):
    model, loss_fn = _model()
    module = autoshard.parallelize(model, mesh, axis_names=axis_names, loss_fn=loss_fn, zero=zero, hints=hints)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)  # before the first batch: the model's own parameters
    if zero is not None:
        opt = autoshard.ZeroOptimizer(module, opt)  # binds to the shards when the module plans
    losses, replanned = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for sizes, clip in _step_plan():
            batches = _batches(sizes)
            for i, ids in enumerate(batches):
                with module.no_sync() if i < len(batches) - 1 else _nothing():
                    loss = module(ids)
                    loss.backward()
                losses.append(loss.item())
            if clip is not None:
                module.clip_grad_norm_(clip)
            opt.step()
            opt.zero_grad()
    replanned = [str(w.message) for w in caught if "planning again" in str(w.message)]
    if save_to is not None:
        autoshard.save_weights(save_to, module)  # the whole model, written from every rank's shards
    prog = module.program
    held = {fqn: (p.detach(), [repr(q) for q in prog.param_spec(fqn)])
            for fqn, p in module.rank_module.named_local_parameters()}
    same_objects = all(any(p is q for q in model.parameters()) for _, p in module.rank_module.named_local_parameters())
    return {"losses": losses, "replanned": replanned, "coord": module.comm.coord, "held": held,
            "mesh": prog.mesh.shape, "same_objects": same_objects, "zero": repr(prog.zero),
            "report": module.report().to_json(), "report_text": str(module.report())}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _check(results):
    losses, params = _single_device()
    for rank, got in results.items():
        assert got["replanned"] == [], got["replanned"]  # the smaller batch re-specialised the plan
        assert got["same_objects"], "the rank module trains the model's own Parameter objects"
        for a, b in zip(got["losses"], losses):
            assert abs(a - b) <= 1e-10 * abs(b), (rank, got["losses"], losses)
    mesh = results[0]["mesh"]
    for fqn, expected in params.items():
        holders = [got for got in results.values() if fqn in got["held"]]
        spec = Spec(parse_placement(p) for p in holders[0]["held"][fqn][1])
        cut = len(mesh) - len(spec)  # a pipeline's specs are on the mesh without its pp axis (the first)
        blocks = {got["coord"][cut:]: got["held"][fqn][0] for got in holders}
        whole = unshard_tensors(blocks, spec, mesh[cut:])
        assert torch.allclose(whole, expected, rtol=1e-9, atol=1e-12), fqn


def _check_report(results, exact_bytes: bool, traffic: bool = False):
    """`module.report()` after the loop: the second step measured (the first plans; the third has no next forward)
    against the plan's predictions, phase by phase; the bytes sent on each axis as predicted (`exact_bytes`: to the
    byte, a flat plan's collectives are the plan's; `traffic`: some axis sends)."""
    for rank, got in results.items():
        report = got["report"]
        assert report["steps"] == 1, report
        figures = {row["figure"]: row for row in report["rows"]}
        assert {"forward_s", "backward_s", "sync_s", "optimizer_s", "step_s"} <= set(figures), figures
        assert figures["step_s"]["measured"] > 0 and figures["step_s"]["predicted"] > 0
        sent = [row for name, row in figures.items() if name.endswith("_bytes") and name != "peak_memory_bytes"]
        assert sent and (not traffic or any(row["measured"] > 0 for row in sent)), got["report_text"]
        if exact_bytes:
            assert all(row["predicted"] == row["measured"] for row in sent), (rank, sent)
        assert "predicted vs measured" in got["report_text"]


def test_a_plain_loop_trains_like_one_device(pool, tmp_path):
    results = pool.run(_plain_loop_task, (2, 2, 2), None, None, None, str(tmp_path / "saved"))
    _check(results)
    _check_report(results, exact_bytes=True)
    saved = autoshard.load_weights(str(tmp_path / "saved"))
    for fqn, expected in _single_device()[1].items():
        assert torch.allclose(saved[fqn], expected, rtol=1e-9, atol=1e-12), fqn


def test_zero_optimizer_made_before_the_first_batch(pool):
    results = pool.run(_plain_loop_task, (4, 2), ("dp", "tp"), 2, {"input:0": {"dp": "S(0)"}})
    assert results[0]["zero"].startswith("ZeRO-2 on 'dp'"), results[0]["zero"]
    _check(results)
    _check_report(results, exact_bytes=True, traffic=True)


def test_a_pipelined_plan_trains_in_the_same_loop(pool):
    """pp x dp x tp: each call runs the schedule (every micro-batch's forward and backward), so `loss.backward()`
    has nothing left to do; accumulation under no_sync sums the passes as one device does."""
    results = pool.run(_plain_loop_task, (2, 2, 2), ("pp", "dp", "tp"), None, None)
    _check(results)
    _check_report(results, exact_bytes=False)
