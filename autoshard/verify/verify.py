"""Train the parallel program and the single-device model side by side and compare them.

Both run N optimizer steps (SGD, or Adam; a ZeRO program steps a ZeroOptimizer) in float64 (or `dtype`)
from the same weights on the same full batch. Compared: the loss of every step, the outputs and gradients
of the first step, and the parameters after the last step (largest relative difference each). In float64
every difference must be within 1e-6; in float32 / bfloat16 each tensor's tolerance is derived from the
model's own rounding noise (autoshard/verify/tolerance.py says exactly how).
`verify_simulated` runs all ranks in this process;
`autoshard.runtime.launch` runs the same rank function on real process groups; the report and the
comparison are autoshard/verify/report.py.

>>> import torch
>>> from autoshard.ir.mesh import Mesh
>>> from autoshard.verify.report import rel_diff
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> hints = {"input:0": {"dp": "S(0)"}, "layers.0.weight": {"tp": "S(0)"}, "layers.0.bias": {"tp": "R"},
...          "layers.1.*": {"tp": "R"}}
>>> report, program = verify_simulated(model, inputs, loss_fn, mesh=(2, 2), axis_names=("dp", "tp"), hints=hints)
>>> report.ok
True
"""
from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree

from autoshard.api import parallelize
from autoshard.frontend.factory import make_case
from autoshard.frontend.trace import default_loss
from autoshard.ir.errors import UserInputError
from autoshard.ir.mesh import Mesh
from autoshard.plan.plan import Plan
from autoshard.program.pipeline_program import InnerRanks
from autoshard.runtime.launch import (
    check_fingerprint,
    communicator_for,
    remember_warnings,
    run_distributed,
)
from autoshard.runtime.loss_scale import LossScaler, optimizer_step
from autoshard.runtime.pipeline import pipeline_rank_run
from autoshard.runtime.simulator import run_ranks
from autoshard.runtime.zero import ZeroOptimizer
from autoshard.verify.report import compare
from autoshard.verify.tolerance import (
    coarsest_dtype,
    float64_unsupported,
    nudged,
    resolve_dtype,
    to_dtype,
)
from autoshard.verify.training import DEFAULT_OPTIONS, Training, VerifyOptions
from autoshard.weights import replay_init


def to_double(model, inputs):
    """A float64 copy of `model` and of the floating inputs (integer inputs, e.g. token ids, stay).

    >>> double, (x,) = to_double(model, inputs)
    >>> double.layers[0].weight.dtype, x.dtype, model.layers[0].weight.dtype
    (torch.float64, torch.float64, torch.float32)
    """
    return to_dtype(model, inputs, torch.float64)


OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}


def make_optimizer(params, lr: float, optimizer: str = "sgd", module=None, offload: bool = False):
    """`optimizer` ("sgd" or "adam") over `params`; for a rank module of a ZeRO program, its ZeroOptimizer.

    >>> type(make_optimizer(list(model.parameters()), 0.1, "adam")).__name__, make_optimizer([], 0.1)
    ('Adam', None)
    """
    if not params:
        return None
    opt = OPTIMIZERS[optimizer](params, lr=lr)
    if module is not None and module.rank_program.zero is not None:
        return ZeroOptimizer(module, opt, offload=offload)
    return opt


def reference_run(model, inputs, loss_fn, options: VerifyOptions = DEFAULT_OPTIONS) -> dict:
    """The single-device training run of `options` (its steps, optimizer and training; the model is already in
    its dtype): {'loss': [...], 'outputs': [...], 'grads': {...}, 'params': {...}, 'loss_scale': [...]}
    (outputs of the first pass of the first step; its gradients after clipping -- with fp16 loss scaling, of
    the first step whose gradients were finite, the first the scaler did not skip).

    >>> double, double_inputs = to_double(model, inputs)
    >>> ref = reference_run(double, double_inputs, loss_fn, VerifyOptions(steps=2, lr=0.1))
    >>> len(ref["loss"]), bool(ref["loss"][1] < ref["loss"][0]), ref["grads"]["layers.0.weight"].shape
    (2, True, torch.Size([128, 32]))
    """
    with torch.random.fork_rng(devices=[]):  # dropout draws from the training's seed, as the ranks' streams do
        torch.manual_seed(options.training.seed)
        return _reference_steps(model, inputs, loss_fn, options)


def _reference_steps(model, inputs, loss_fn, options: VerifyOptions) -> dict:
    training = options.training
    params = dict(model.named_parameters())
    opt = make_optimizer(list(params.values()), options.lr, options.optimizer)
    scaler = torch.amp.GradScaler("cpu") if training.loss_scaling and opt is not None else None
    losses, outputs, grads, scales = [], None, None, []
    passes = training.passes(inputs)
    for step in range(options.steps):
        model.zero_grad()
        total = None
        for chunk in passes:
            out = training.forward(model, chunk)
            loss = loss_fn(out, *chunk) if loss_fn is not None else default_loss(out)
            loss = loss / training.accumulate if training.accumulate > 1 else loss
            if loss.requires_grad:  # a model without parameters has nothing to differentiate
                (loss if scaler is None else scaler.scale(loss)).backward()
            total = loss.detach().clone() if total is None else total + loss.detach()
            if step == 0 and outputs is None:
                outputs = [o.detach().clone() for o in pytree.tree_leaves(out)]
        if scaler is not None:
            scaler.unscale_(opt)
        if training.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(list(params.values()), training.clip_grad_norm)
        losses.append(total)
        if grads is None and (scaler is None or all(torch.isfinite(p.grad).all() for p in params.values()
                                                    if p.grad is not None)):
            grads = {k: p.grad.detach().clone() for k, p in params.items() if p.grad is not None}
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        elif opt is not None:
            opt.step()
    return {"loss": losses, "outputs": outputs, "grads": grads, "loss_scale": scales,
            "params": {k: p.detach().clone() for k, p in params.items()}}


def reference_runs(model, inputs, loss_fn, options: VerifyOptions = DEFAULT_OPTIONS,
                   unit=None) -> tuple[dict, dict | None]:
    """(the reference run, the noise run or None) of a model already in `options.dtype`: below float64, the
    reference is trained again from nudged weights and inputs to measure the model's own rounding noise
    (autoshard/verify/tolerance.py). `model` itself is left untouched. A model that cannot run in float64 gets a
    UserInputError saying to pass a lower dtype. `unit`: the coarsest dtype the program computes in (its
    eps sizes the nudges; tolerance.coarsest_dtype), default `options.dtype`.

    >>> low, low_inputs = to_dtype(model, inputs, torch.float32)
    >>> ref, noise = reference_runs(low, low_inputs, loss_fn, VerifyOptions(steps=1, dtype=torch.float32))
    >>> 0 < rel_diff(noise["loss"][0], ref["loss"][0]) < 1e-5
    True
    """
    try:
        ref = reference_run(copy.deepcopy(model), inputs, loss_fn, options)
    except Exception as exc:
        error = float64_unsupported(exc, type(model).__name__) if options.dtype == torch.float64 else None
        if error is not None:
            raise error from exc
        raise
    if (unit or options.dtype) == torch.float64:
        return ref, None
    return ref, noise_run(model, inputs, loss_fn, options, unit)


def noise_run(model, inputs, loss_fn, options: VerifyOptions = DEFAULT_OPTIONS, unit=None) -> dict:
    """The reference trained again from weights and inputs nudged by one ulp of `unit` (default: their
    dtype): how far the model's own rounding moves each tensor (autoshard/verify/tolerance.py).

    >>> single, single_inputs = to_dtype(model, inputs, torch.float32)
    >>> one_step = VerifyOptions(steps=1, dtype=torch.float32)
    >>> moved = noise_run(single, single_inputs, loss_fn, one_step)
    >>> exact = reference_run(copy.deepcopy(single), single_inputs, loss_fn, one_step)
    >>> 0 < rel_diff(moved["loss"][0], exact["loss"][0]) < 1e-5
    True
    """
    moved, moved_inputs = nudged(model, inputs, unit=unit)
    return reference_run(moved, moved_inputs, loss_fn, options)


def rank_run(module, inputs, options: VerifyOptions = DEFAULT_OPTIONS) -> dict:
    """One rank's training run of `options` on its module; returns its local results and collective counts (of
    the first step, optimizer step included: ZeRO all-gathers parameters there).

    >>> from autoshard.runtime.simulator import run_ranks
    >>> one_step = VerifyOptions(steps=1)
    >>> ranks = run_ranks(program, lambda module: rank_run(module, to_double(model, inputs)[1], one_step))
    >>> sorted(ranks[0])
    ['counts', 'grads', 'loss', 'loss_scale', 'outputs', 'params']
    >>> ranks[0]["counts"]["tp"]["all_to_all"]  # of the first step, on rank 0
    {'fwd': 1, 'bwd': 1, 'sync': 0, 'bytes': 4096}
    """
    training, steps = options.training, options.steps
    params = dict(module.named_local_parameters())
    opt = make_optimizer(list(params.values()), options.lr, options.optimizer, module, options.offload)
    if getattr(module, "pipelined", False):
        return pipeline_rank_run(module, inputs, steps, options.lr, training.clip_grad_norm, training.accumulate,
                                 training.loss_scaling, opt)
    passes = [module.local_inputs(*chunk) for chunk in training.passes(inputs)]
    scaler = LossScaler(module) if training.loss_scaling else None
    module.comm.log.clear()
    losses, outputs, grads, counts, scales = [], None, None, None, []
    for step in range(steps):
        module.zero_grad()
        total = None
        for j, local_inputs in enumerate(passes):
            last = j == len(passes) - 1  # only the last pass's backward starts the gradient reductions
            with contextlib.nullcontext() if last else module.no_sync():
                loss, out = module(*local_inputs)
                loss = loss / training.accumulate if training.accumulate > 1 else loss
                module.comm.phase = "bwd"
                if loss.requires_grad:
                    (loss if scaler is None else scaler.scale(loss)).backward()
            module.comm.phase = "fwd"
            total = loss.detach().clone() if total is None else total + loss.detach()
            if step == 0 and outputs is None:
                outputs = [o.detach().clone() for o in pytree.tree_leaves(out)]
        module.comm.phase = "bwd"
        module.sync_grads()
        if scaler is not None:
            scaler.unscale_()
        if training.clip_grad_norm is not None:
            module.clip_grad_norm_(training.clip_grad_norm)
        module.comm.phase = "fwd"
        losses.append(total)
        if grads is None and (scaler is None or not scaler.found_inf):  # fp16: the first step that ran
            grads = opt.full_grads() if hasattr(opt, "full_grads") else \
                {k: p.grad.detach().clone() for k, p in params.items() if p.grad is not None}
        optimizer_step(opt, scaler, scales)
        if step == 0:
            counts = module.comm.log.summary()
    return {"loss": losses, "outputs": outputs, "grads": grads, "counts": counts, "loss_scale": scales,
            "params": {k: p.detach().clone() for k, p in params.items()}}


def _noise_for(program, model, inputs, loss_fn, options: VerifyOptions) -> dict | None:
    """The noise run where the program computes below float64 (its dtype, autocast regions, mixed precision)."""
    unit = coarsest_dtype(program.state.gm.graph, options.dtype)
    return None if unit == torch.float64 else noise_run(model, inputs, loss_fn, options, unit)


def verify_simulated(model, inputs, loss_fn=None, mesh=(2,), steps: int = 2, lr: float = 0.1,
                     optimizer: str = "sgd", offload: bool = False, dtype="float64", accumulate: int = 1,
                     clip_grad_norm: float | None = None, rng: str = "exact", seed: int = 0, mixed_precision=None,
                     **kwargs):
    """Parallelize in `dtype` (float64, float32 or bfloat16), train in the simulator and on one device;
    return (VerifyReport, program). Tolerances: see the module docstring.

    >>> report.max_diff["params"] < 1e-12  # the simulator agrees to float64 round-off
    True
    >>> low, _ = verify_simulated(model, inputs, loss_fn, mesh=(2, 2), axis_names=("dp", "tp"), hints=hints,
    ...                           dtype="float32")
    >>> low.ok, low.dtype, low.tolerances["grads"] >= 10 * torch.finfo(torch.float32).eps
    (True, 'float32', True)
    """
    options = VerifyOptions(steps, lr, optimizer, offload, resolve_dtype(dtype),
                            Training(accumulate, clip_grad_norm, rng, seed, mixed_precision))
    model, inputs = to_dtype(model, inputs, options.dtype)
    ref, _ = reference_runs(model, inputs, loss_fn, options, unit=torch.float64)
    program = parallelize(model, mesh, options.training.passes(inputs)[0], loss_fn=loss_fn,
                          **options.training.program_options(), **kwargs)
    noise = _noise_for(program, model, inputs, loss_fn, options)
    ranks = simulate_ranks(program, lambda module: rank_run(module, inputs, options))
    return compare(program, ref, ranks, options, noise), program


def simulate_ranks(program, fn) -> dict:
    """`fn(module)` on every rank in this process; a pipeline runs one thread per intra-op rank (all its
    stages in order), its results keyed by the global rank of pp coordinate 0.

    >>> simulate_ranks(program, lambda module: module.rank)
    {0: 0, 1: 1, 2: 2, 3: 3}
    """
    if getattr(program, "config", None) is None:
        return run_ranks(program, fn)
    results = run_ranks(InnerRanks(program), fn)
    return {program.mesh.rank(program._full_coord(r)): res for r, res in results.items()}


def build_case(factory_spec: str, dtype=torch.float64):
    """(model, inputs, loss_fn) in `dtype` from a FACTORY returning (model, inputs[, loss_fn]), checked by
    autoshard.frontend.factory.make_case.

    >>> case_model, case_inputs, case_loss = build_case("autoshard.zoo:mlp")
    >>> case_inputs[0].dtype, case_loss.__name__
    (torch.float64, 'mlp_loss')
    """
    model, inputs, loss_fn = make_case(factory_spec)
    model, inputs = to_dtype(model, inputs, resolve_dtype(dtype))
    return model, inputs, loss_fn


def case_digest(model, inputs) -> str:
    """A hash of the model's weights and the example inputs: ranks rebuild the case from the factory and
    must get the launcher's (an unseeded factory would train every rank on other data).

    >>> case_digest(*build_case("autoshard.zoo:mlp")[:2]) == case_digest(*build_case("autoshard.zoo:mlp")[:2])
    True
    """
    import hashlib
    digest = hashlib.sha256()
    for tensor in [*model.state_dict().values(), *inputs]:
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class VerifyTask:
    """What the launcher of `verify` hands each real rank (pickled to it): the case to rebuild from `factory`
    (`digest`: a hash of the launcher's weights and inputs, which the rank's must match), the mesh (its JSON),
    the `hints` and `program_options` to plan with, or `plan`: the launcher's plan (its JSON with the
    fingerprint) to apply instead; `weights`: what `prog.module(..., weights=)` loads (the model is then built on
    the meta device and `inputs` are the launcher's example inputs); `options`: how to train.

    >>> VerifyTask("autoshard.zoo:mlp", Mesh((2,), ("dp",)).to_json()).options.steps
    2
    """

    factory: str
    mesh: dict
    hints: dict | None = None
    options: VerifyOptions = DEFAULT_OPTIONS
    program_options: dict = field(default_factory=dict)
    plan: dict | None = None
    digest: str | None = None
    weights: str | None = None
    inputs: tuple | None = None


def verify_rank_task(rank, world, task: VerifyTask):
    """What each real rank runs for `verify`: plan (or apply the plan the launcher made, as every rank of
    a job can: `parallelize(plan=...)`), check fingerprints, train, return local results. Here on a
    one-rank gloo group in this process:

    >>> import os
    >>> from unittest import mock
    >>> import torch.distributed as dist
    >>> from autoshard.runtime.launch import free_port, init_distributed
    >>> env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1"}
    >>> with mock.patch.dict(os.environ, env):
    ...     init_distributed("gloo")
    >>> task = VerifyTask("autoshard.zoo:mlp", Mesh((1,), ("dp",)).to_json(), options=VerifyOptions(steps=1))
    >>> result = verify_rank_task(0, 1, task)
    >>> sorted(result)
    ['counts', 'fingerprint', 'grads', 'loss', 'loss_scale', 'outputs', 'params']
    >>> dist.destroy_process_group()
    """
    options, program_options = task.options, dict(task.program_options)
    if task.plan is not None:
        program_options["plan"] = Plan.from_json(task.plan, "the launcher's plan")
    mesh = Mesh.from_json(task.mesh)
    comm = communicator_for(mesh, strict_world=False)
    if comm is None:
        return None
    inputs = task.inputs
    if task.weights is not None:  # the model built on the meta device, its weights from `weights`, the launcher's inputs
        with torch.device("meta"):
            model, _, loss_fn = build_case(task.factory, options.dtype)
        planned_inputs = _on_model_device(model, inputs)
    else:
        model, inputs, loss_fn = build_case(task.factory, options.dtype)
        planned_inputs = inputs
    if task.digest is not None and case_digest(torch.nn.Module() if task.weights else model, inputs) != task.digest:
        raise UserInputError(f"factory {task.factory} built other weights or example inputs on rank {rank} than in "
                             "the launcher: it is not deterministic, so the ranks cannot be compared with the single "
                             "device. Seed it: call torch.manual_seed(0) at the start of the factory")
    program = parallelize(model, mesh, options.training.passes(planned_inputs)[0], hints=task.hints, loss_fn=loss_fn,
                          **program_options)
    check_fingerprint(comm, program.plan.fingerprint)
    result = rank_run(program.module(rank, comm, weights=task.weights), inputs, options)
    result["fingerprint"] = program.plan.fingerprint
    return result


def _on_model_device(model, inputs) -> tuple:
    """The example inputs on the device of the model's first parameter (meta, for a factory that honours
    `torch.device("meta")`; a factory that builds on an explicit device keeps it)."""
    device = next(iter(model.parameters()), torch.empty(0)).device
    return tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs)


def _weights_for_ranks(model, weights, simulate: bool):
    """What the ranks pass as prog.module(..., weights=): a safetensors file of `model` in a temporary
    directory, or "init" (then `model` itself is re-initialised the same way, as the reference)."""
    if weights is None:
        return None
    if simulate:
        raise UserInputError("verify with weights= runs on real ranks (it builds the model on the meta device on "
                             "each); drop --simulate")
    if weights == "init":
        targets = {**dict(model.named_parameters(remove_duplicate=False)),
                   **dict(model.named_buffers(remove_duplicate=False))}
        with torch.no_grad():
            replay_init(model, lambda fqn, full: targets[fqn].copy_(full))
        return "init"
    if weights != "safetensors":
        raise UserInputError(f"verify weights= is 'safetensors' or 'init', not {weights!r}")
    import tempfile

    from safetensors.torch import save_model
    folder = tempfile.mkdtemp(prefix="autoshard-verify-weights-")
    save_model(model, os.path.join(folder, "model.safetensors"))  # a tied tensor once, under one of its names
    return folder


def verify_factory(factory_spec: str, mesh, axis_names=None, hints=None, steps: int = 2, lr: float = 0.1,
                   runner=None, simulate: bool = False, optimizer: str = "sgd", offload: bool = False,
                   dtype="float64", weights=None, accumulate: int = 1, clip_grad_norm: float | None = None,
                   rng: str = "exact", seed: int = 0, mixed_precision=None, **program_options):
    """`python -m autoshard verify`: real gloo ranks (or the simulator) against the single device, in `dtype`.

    `weights` ("safetensors" or "init", real ranks) verifies a model built on the meta device on every
    rank: "safetensors" loads it from a file the launcher writes from its seeded model; "init" replays
    the model's initialisation (autoshard/weights/replay.py) on the ranks and on the launcher's model.
    `accumulate` (k passes over k slices of the batch per step, one gradient sync) and `clip_grad_norm`
    (clip by the global norm before each step) train both sides that way (`Training`); the program is
    planned for one pass's slice of the example inputs. `runner(verify_rank_task, world, task)` runs the real
    ranks (default: `run_distributed`); other keywords go to `parallelize`.

    >>> checked, _ = verify_factory("autoshard.zoo:mlp", (2,), ("dp",), hints={"input:0": {"dp": "S(0)"}},
    ...                             simulate=True)
    >>> checked.ok, checked.collectives["dp"]["all_reduce"]["sync"]
    (True, 1)
    """
    mesh = Mesh.of(mesh, axis_names)
    options = VerifyOptions(steps, lr, optimizer, offload, resolve_dtype(dtype),
                            Training(accumulate, clip_grad_norm, rng, seed, mixed_precision))
    program_options = {**program_options, **options.training.program_options()}
    with remember_warnings():  # the ranks' copies of these are not shown again
        model, inputs, loss_fn = build_case(factory_spec, options.dtype)
        weights_arg = _weights_for_ranks(model, weights, simulate)
        ref, _ = reference_runs(model, inputs, loss_fn, options, unit=torch.float64)
        one_pass = options.training.passes(inputs)[0]  # the program runs one pass of the step at a time
        if weights is not None:  # planned as the ranks plan it: on the meta device (its trace can differ)
            with torch.device("meta"):
                planned, _, _ = build_case(factory_spec, options.dtype)
            program = parallelize(planned, mesh, _on_model_device(planned, one_pass), hints=hints, loss_fn=loss_fn,
                                  **program_options)
        else:
            program = parallelize(model, mesh, one_pass, hints=hints, loss_fn=loss_fn, **program_options)
        noise = _noise_for(program, model, inputs, loss_fn, options)
    if simulate:
        ranks = simulate_ranks(program, lambda module: rank_run(module, inputs, options))
    else:
        # Ranks apply the launcher's plan instead of each solving the ILP again; the fingerprint check still
        # compares every rank's program. A meta model has no weights to hash.
        task = VerifyTask(factory_spec, mesh.to_json(), program.state.hints.to_json() if hints else None, options,
                          program_options, plan={**program.plan.to_json(), "fingerprint": program.plan.fingerprint},
                          digest=case_digest(torch.nn.Module() if weights else model, inputs), weights=weights_arg,
                          inputs=inputs if weights else None)
        results = (runner or run_distributed)(verify_rank_task, mesh.size, task)
        ranks = {r: res for r, res in results.items() if res is not None}
    return compare(program, ref, ranks, options, noise), program
