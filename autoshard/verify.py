"""Train the parallel program and the single-device model side by side and compare them.

Both run N optimizer steps (SGD, or Adam; a ZeRO program steps a ZeroOptimizer) in float64 from the
same weights on the same full batch. Compared: the loss of every step, the outputs and gradients of
the first step, and the parameters after the last step (largest relative difference each).
`verify_simulated` runs all ranks in this process;
`autoshard.runtime.launch` runs the same rank function on real process groups.

>>> import torch
>>> from autoshard.mesh import Mesh
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> hints = {"input:0": {"dp": "S(0)"}, "layers.0.weight": {"tp": "S(0)"}, "layers.0.bias": {"tp": "R"},
...          "layers.1.*": {"tp": "R"}}
>>> report, program = verify_simulated(model, inputs, loss_fn, mesh=(2, 2), axis_names=("dp", "tp"), hints=hints)
>>> report.ok
True
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree

TOLERANCE = 1e-6


def to_double(model, inputs):
    """A float64 copy of `model` and of the floating inputs (integer inputs, e.g. token ids, stay).

    >>> double, (x,) = to_double(model, inputs)
    >>> double.layers[0].weight.dtype, x.dtype, model.layers[0].weight.dtype
    (torch.float64, torch.float64, torch.float32)
    """
    model = copy.deepcopy(model).double()
    inputs = tuple(x.double() if x.is_floating_point() else x for x in inputs)
    return model, inputs


OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}


def make_optimizer(params, lr: float, optimizer: str = "sgd", module=None, offload: bool = False):
    """`optimizer` ("sgd" or "adam") over `params`; for a rank module of a ZeRO program, its ZeroOptimizer.

    >>> type(make_optimizer(list(model.parameters()), 0.1, "adam")).__name__, make_optimizer([], 0.1)
    ('Adam', None)
    """
    if not params:
        return None
    opt = OPTIMIZERS[optimizer](params, lr=lr)
    if module is not None and getattr(module._program, "zero", None) is not None:
        from .runtime.zero import ZeroOptimizer
        return ZeroOptimizer(module, opt, offload=offload)
    return opt


def reference_run(model, inputs, loss_fn, steps: int, lr: float, optimizer: str = "sgd") -> dict:
    """The single-device training run: {'loss': [...], 'outputs': [...], 'grads': {...}, 'params': {...}}.

    >>> double, double_inputs = to_double(model, inputs)
    >>> ref = reference_run(double, double_inputs, loss_fn, steps=2, lr=0.1)
    >>> len(ref["loss"]), bool(ref["loss"][1] < ref["loss"][0]), ref["grads"]["layers.0.weight"].shape
    (2, True, torch.Size([128, 32]))
    """
    from .frontend import default_loss
    params = dict(model.named_parameters())
    opt = make_optimizer(list(params.values()), lr, optimizer)
    losses, outputs, grads = [], None, None
    for step in range(steps):
        model.zero_grad()
        out = model(*inputs)
        loss = loss_fn(out, *inputs) if loss_fn is not None else default_loss(out)
        if loss.requires_grad:  # a model without parameters has nothing to differentiate
            loss.backward()
        losses.append(loss.detach().clone())
        if step == 0:
            outputs = [o.detach().clone() for o in pytree.tree_leaves(out)]
            grads = {k: p.grad.detach().clone() for k, p in params.items() if p.grad is not None}
        if opt is not None:
            opt.step()
    return {"loss": losses, "outputs": outputs, "grads": grads,
            "params": {k: p.detach().clone() for k, p in params.items()}}


def rank_run(module, inputs, steps: int, lr: float, optimizer: str = "sgd", offload: bool = False) -> dict:
    """One rank's training run on its module; returns its local results and collective counts (of the
    first step, optimizer step included: ZeRO all-gathers parameters there).

    >>> from autoshard.runtime.simulator import run_ranks
    >>> ranks = run_ranks(program, lambda module: rank_run(module, to_double(model, inputs)[1], steps=1, lr=0.1))
    >>> sorted(ranks[0])
    ['counts', 'grads', 'loss', 'outputs', 'params']
    >>> ranks[0]["counts"]["tp"]["all_to_all"]  # of the first step, on rank 0
    {'fwd': 1, 'bwd': 1, 'sync': 0, 'bytes': 4096}
    """
    if getattr(module, "pipelined", False):
        from .runtime.pipeline import pipeline_rank_run
        return pipeline_rank_run(module, inputs, steps, lr)
    local_inputs = module.local_inputs(*inputs)
    params = dict(module.named_local_parameters())
    opt = make_optimizer(list(params.values()), lr, optimizer, module, offload)
    module.comm.log.clear()
    losses, outputs, grads, counts = [], None, None, None
    for step in range(steps):
        module.zero_grad()
        loss, out = module(*local_inputs)
        module.comm.phase = "bwd"
        if loss.requires_grad:
            loss.backward()
        module.sync_grads()
        module.comm.phase = "fwd"
        losses.append(loss.detach().clone())
        if step == 0:
            outputs = [o.detach().clone() for o in pytree.tree_leaves(out)]
            grads = opt.full_grads() if hasattr(opt, "full_grads") else \
                {k: p.grad.detach().clone() for k, p in params.items() if p.grad is not None}
        if opt is not None:
            opt.step()
        if step == 0:
            counts = module.comm.log.summary()
    return {"loss": losses, "outputs": outputs, "grads": grads, "counts": counts,
            "params": {k: p.detach().clone() for k, p in params.items()}}


@dataclass
class VerifyReport:
    """Largest relative differences and the collectives one training step ran on rank 0.

    >>> print(report)  # doctest: +ELLIPSIS
    verify: OK (2 steps, tolerance 1e-06)
      loss     max rel diff ...
    """

    max_diff: dict = field(default_factory=dict)
    worst: dict = field(default_factory=dict)
    collectives: dict = field(default_factory=dict)
    predicted: dict = field(default_factory=dict)
    steps: int = 0
    tolerance: float = TOLERANCE

    @property
    def ok(self) -> bool:
        """Every largest relative difference is within the tolerance.

        >>> report.ok, VerifyReport(max_diff={"loss": 1e-3}).ok
        (True, False)
        """
        return all(v <= self.tolerance for v in self.max_diff.values())

    def to_json(self) -> dict:
        """What `verify --json` prints.

        >>> sorted(report.to_json())
        ['collectives_per_step', 'max_rel_diff', 'ok', 'predicted', 'steps', 'tolerance', 'worst']
        """
        return {"ok": self.ok, "steps": self.steps, "tolerance": self.tolerance, "max_rel_diff": self.max_diff,
                "worst": self.worst, "collectives_per_step": self.collectives, "predicted": self.predicted}

    def __repr__(self) -> str:
        lines = [f"verify: {'OK' if self.ok else 'MISMATCH'} ({self.steps} steps, tolerance {self.tolerance:g})"]
        for key, value in self.max_diff.items():
            lines.append(f"  {key:<8} max rel diff {value:.3e}  ({self.worst.get(key, '')})")
        for axis, kinds in self.collectives.items():
            for kind, c in kinds.items():
                lines.append(f"  axis {axis}: {kind} fwd {c['fwd']} bwd {c['bwd']} sync {c.get('sync', 0)} "
                             f"bytes {c['bytes']}")
        return "\n".join(lines)


ABS_FLOOR = 1e-9  # gradients that are zero in exact arithmetic (e.g. a key bias) compare absolutely


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, with |b| floored so float64 round-off around zero is not a mismatch.

    >>> rel_diff(torch.tensor([1.0, 2.5]), torch.tensor([1.0, 2.0])), rel_diff(torch.zeros(2), torch.zeros(3))
    (0.25, inf)
    """
    if a.shape != b.shape:
        return float("inf")
    if not b.numel():
        return 0.0
    return (a - b).abs().max().item() / max(b.abs().max().item(), ABS_FLOOR)


def compare(program, ref: dict, ranks: dict, steps: int) -> VerifyReport:
    """The VerifyReport of the ranks' results (assembled into global tensors) against the reference run.

    >>> double, double_inputs = to_double(model, inputs)
    >>> ref = reference_run(double, double_inputs, loss_fn, steps=1, lr=0.1)
    >>> ranks = simulate_ranks(program, lambda module: rank_run(module, double_inputs, steps=1, lr=0.1))
    >>> compare(program, ref, ranks, steps=1).ok
    True
    """
    report = VerifyReport(steps=steps)
    specs = program.output_specs

    def track(key, name, value):
        if value >= report.max_diff.get(key, -1.0):
            report.max_diff[key], report.worst[key] = value, name

    for step in range(steps):
        loss = program.assemble({r: res["loss"][step] for r, res in ranks.items()}, specs[0])
        track("loss", f"step {step}", rel_diff(loss, ref["loss"][step]))
    for i, expected in enumerate(ref["outputs"]):
        got = program.assemble({r: res["outputs"][i] for r, res in ranks.items()}, specs[1 + i])
        track("outputs", f"output {i}", rel_diff(got, expected))
    for kind in ("grads", "params"):
        for fqn, expected in ref[kind].items():
            name = program.canonical_param(fqn)
            blocks = {r: res[kind][name] for r, res in ranks.items() if name in res[kind]}  # pipelines: owners
            got = program.assemble(blocks, program.param_spec(name))
            track(kind, fqn, rel_diff(got, expected))
    report.collectives = ranks[0]["counts"]
    report.predicted = program.plan.predicted
    return report


def verify_simulated(model, inputs, loss_fn=None, mesh=(2,), steps: int = 2, lr: float = 0.1,
                     optimizer: str = "sgd", offload: bool = False, **kwargs):
    """Parallelize in float64, train in the simulator and on one device; return (VerifyReport, program).

    >>> report.max_diff["params"] < 1e-12  # the simulator agrees to float64 round-off
    True
    """
    from .program import parallelize
    model, inputs = to_double(model, inputs)
    program = parallelize(copy.deepcopy(model), mesh, inputs, loss_fn=loss_fn, **kwargs)
    ref = reference_run(model, inputs, loss_fn, steps, lr, optimizer)
    ranks = simulate_ranks(program, lambda module: rank_run(module, inputs, steps, lr, optimizer, offload))
    return compare(program, ref, ranks, steps), program


def simulate_ranks(program, fn) -> dict:
    """`fn(module)` on every rank in this process; a pipeline runs one thread per intra-op rank (all its
    stages in order), its results keyed by the global rank of pp coordinate 0.

    >>> simulate_ranks(program, lambda module: module.rank)
    {0: 0, 1: 1, 2: 2, 3: 3}
    """
    from .runtime.simulator import run_ranks
    if getattr(program, "config", None) is None:
        return run_ranks(program, fn)
    from .pipeline_program import InnerRanks
    results = run_ranks(InnerRanks(program), fn)
    return {program.mesh.rank(program._full_coord(r)): res for r, res in results.items()}


def load_factory(spec: str):
    """'package.module:factory' -> the zero-argument callable (errors say what to fix).

    >>> load_factory("autoshard.zoo:mlp") is mlp
    True
    >>> load_factory("autoshard.zoo.mlp")
    Traceback (most recent call last):
    ...
    autoshard.errors.UserInputError: factory 'autoshard.zoo.mlp' must look like MODULE:FACTORY, e.g. ...
    """
    import importlib

    from .errors import UserInputError
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UserInputError(f"factory {spec!r} must look like MODULE:FACTORY, e.g. autoshard.zoo:gpt2")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserInputError(f"cannot import module {module_name!r} of factory {spec!r}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UserInputError(f"{module_name!r} has no callable {attr!r} (factory {spec!r})")
    return factory


def build_case(factory_spec: str):
    """(model, inputs, loss_fn) in float64 from a FACTORY returning (model, inputs[, loss_fn]).

    >>> case_model, case_inputs, case_loss = build_case("autoshard.zoo:mlp")
    >>> case_inputs[0].dtype, case_loss.__name__
    (torch.float64, 'mlp_loss')
    """
    from .errors import UserInputError
    made = load_factory(factory_spec)()
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise UserInputError(f"factory {factory_spec!r} must return (model, example_inputs) or "
                             "(model, example_inputs, loss_fn)")
    model, inputs = made[0], made[1]
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    model, inputs = to_double(model, inputs)
    return model, inputs, (made[2] if len(made) == 3 else None)


def verify_rank_task(rank, world, factory_spec, mesh_json, hints, steps, lr, options=None, optimizer="sgd",
                     offload=False, shared_plan=None):
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
    >>> result = verify_rank_task(0, 1, "autoshard.zoo:mlp", Mesh((1,), ("dp",)).to_json(), None, 1, 0.1)
    >>> sorted(result)
    ['counts', 'fingerprint', 'grads', 'loss', 'outputs', 'params']
    >>> dist.destroy_process_group()
    """
    if shared_plan is not None:
        from .plan_io import plan_from_json
        options = dict(options or {}, plan=plan_from_json(shared_plan, "the launcher's plan"))
    from .mesh import Mesh
    from .program import parallelize
    from .runtime.launch import check_fingerprint, communicator_for
    mesh = Mesh.from_json(mesh_json)
    comm = communicator_for(mesh, strict_world=False)
    if comm is None:
        return None
    model, inputs, loss_fn = build_case(factory_spec)
    program = parallelize(model, mesh, inputs, hints=hints, loss_fn=loss_fn, **(options or {}))
    check_fingerprint(comm, program.plan.fingerprint)
    result = rank_run(program.module(rank, comm), inputs, steps, lr, optimizer, offload)
    result["fingerprint"] = program.plan.fingerprint
    return result


def verify_factory(factory_spec: str, mesh, axis_names=None, hints=None, steps: int = 2, lr: float = 0.1,
                   runner=None, simulate: bool = False, optimizer: str = "sgd", offload: bool = False, **options):
    """`python -m autoshard verify`: real gloo ranks (or the simulator) against the single device.

    >>> checked, _ = verify_factory("autoshard.zoo:mlp", (2,), ("dp",), hints={"input:0": {"dp": "S(0)"}},
    ...                             simulate=True)
    >>> checked.ok, checked.collectives["dp"]["all_reduce"]["sync"]
    (True, 1)
    """
    from .mesh import Mesh
    from .program import parallelize
    from .runtime.launch import run_distributed
    mesh = Mesh.of(mesh, axis_names)
    model, inputs, loss_fn = build_case(factory_spec)
    program = parallelize(copy.deepcopy(model), mesh, inputs, hints=hints, loss_fn=loss_fn, **options)
    ref = reference_run(model, inputs, loss_fn, steps, lr, optimizer)
    if simulate:
        ranks = simulate_ranks(program, lambda module: rank_run(module, inputs, steps, lr, optimizer, offload))
    else:
        # Ranks apply the launcher's plan instead of each solving the ILP again; the fingerprint check still
        # compares every rank's program.
        shared = {**program.plan.to_json(), "fingerprint": program.plan.fingerprint}
        args = (factory_spec, mesh.to_json(), program.state.hints.to_json() if hints else None, steps, lr, options,
                optimizer, offload, shared)
        results = (runner or (lambda task, n, *a: run_distributed(task, n, *a)))(verify_rank_task, mesh.size, *args)
        ranks = {r: res for r, res in results.items() if res is not None}
    return compare(program, ref, ranks, steps), program
