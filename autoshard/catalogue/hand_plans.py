"""The plans people write by hand, as hints and options `parallelize` takes: DDP, FSDP, DDP x TP (Megatron), FSDP x TP, TP x SP
(Megatron-SP), FSDP x TP x PP, TP x CP and EP inside dp. Each is built for a model from its roles
(autoshard/catalogue/roles.py) and a mesh's axes, so the same plan is written for the zoo's models and for
transformers' families; the planner's search compares its own plan with every one that applies
(autoshard/search/hand_plan_search.py).

>>> import autoshard
>>> from autoshard.zoo import llama
>>> model, inputs, loss_fn = llama(n_layers=2)
>>> mesh = autoshard.Mesh((2, 2), ("dp", "tp"))
>>> roles = model_roles_of(model, inputs, loss_fn)
>>> plan = fsdp_tp(roles, mesh, batch=inputs[0].shape[0])
>>> plan
HandPlan('fsdp_tp': FSDP (ZeRO-3) over dp x Megatron TP over tp)
>>> plan.hints["layers.*.attn.wo.weight"], plan.options["zero"]
({'tp': 'S(1)'}, {'dp': 3})
>>> prog = autoshard.parallelize(model, mesh.shape, inputs, loss_fn=loss_fn, **plan.options)
>>> prog.zero
ZeRO-3 on 'dp'
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from autoshard.catalogue.roles import ModelRoles, model_roles
from autoshard.frontend.trace import trace
from autoshard.ir.mesh import Mesh

CATALOGUE = ("ddp", "fsdp", "dp_tp", "fsdp_tp", "tp_sp", "fsdp_tp_pp", "tp_cp", "ep_dp")


class NotApplicable(ValueError):
    """A hand plan that cannot be written for this model and mesh; the message says why.

    >>> tp_cp(roles, mesh, batch=8, seq=16)
    Traceback (most recent call last):
    ...
    autoshard.catalogue.hand_plans.NotApplicable: context parallelism needs a mesh axis (mesh axes: ['dp', 'tp'])
    """


@dataclass(frozen=True)
class HandPlan:
    """One hand-written plan: its catalogue `name`, what it does, and `options`, the keywords `parallelize`
    takes for it (axis_names, hints, zero, pipeline).

    >>> plan.name, plan.zero
    ('fsdp_tp', {'dp': 3})
    """

    name: str
    description: str
    mesh: Mesh
    hints: dict
    zero: dict | None = None
    pipeline: dict | None = None
    extra: dict = field(default_factory=dict)

    @property
    def options(self) -> dict:
        """`parallelize(model, mesh.shape, inputs, **plan.options)` plans it.

        >>> sorted(plan.options)
        ['axis_names', 'hints', 'zero']
        """
        out = {"axis_names": self.mesh.names, "hints": self.hints}
        if self.zero:
            out["zero"] = self.zero
        if self.pipeline is not None:
            out["pipeline"] = self.pipeline
        return out

    def __repr__(self) -> str:
        return f"HandPlan({self.name!r}: {self.description})"


def model_roles_of(model, example_inputs, loss_fn=None) -> ModelRoles:
    """The model's roles from one trace (a user building hand plans outside the planner).

    >>> roles.sequence_regions
    ['layers.*.attn_norm', 'layers.*.ffn_norm']
    """
    return model_roles(trace(model, tuple(example_inputs), loss_fn).gm)


def _axis(mesh: Mesh, name: str | None, role: str) -> str:
    if name is None or name not in mesh.names:
        raise NotApplicable(f"{role} needs a mesh axis (mesh axes: {list(mesh.names)})")
    if mesh.shape[mesh.axis(name)] < 2:
        raise NotApplicable(f"{role} axis {name!r} has size 1")
    return name


def _batch_hints(mesh: Mesh, axes: tuple, batch: int, n_inputs: int) -> dict:
    ways = math.prod(mesh.shape[mesh.axis(a)] for a in axes)
    if not axes:
        raise NotApplicable("no mesh axis is left for the batch")
    if batch % ways:
        raise NotApplicable(f"the batch of {batch} does not split {ways} ways over {list(axes)}")
    return {f"input:{i}": {a: "S(0)" for a in axes} for i in range(n_inputs)}


def _megatron_hints(roles: ModelRoles, mesh: Mesh, tp: str) -> dict:
    if not roles.row:
        raise NotApplicable("the model has no column/row pair of linear layers in its repeated blocks")
    k = mesh.shape[mesh.axis(tp)]
    hints = {}
    for table in (roles.column, roles.row):
        for glob, dim in table.items():
            if roles.sizes[glob][dim] % k:
                raise NotApplicable(f"{glob} has {roles.sizes[glob][dim]} features on dim {dim}, not divisible "
                                    f"by {tp}={k}")
            hints[glob] = {tp: f"S({dim})"}
    hints.update({glob: {tp: "S(0)"} for glob in roles.column_bias})
    return hints


def _zero_axis(mesh: Mesh, axes: tuple) -> str:
    """FSDP shards over the largest batch axis (the inner one on a tie: the fastest links)."""
    return max(reversed(axes), key=lambda a: mesh.shape[mesh.axis(a)])


def ddp(roles: ModelRoles, mesh: Mesh, batch: int, n_inputs: int = 1, axes: tuple | None = None) -> HandPlan:
    """Data parallel over `axes` (default: every axis): the batch split, parameters replicated.

    >>> ddp(roles, mesh, batch=8).hints
    {'input:0': {'dp': 'S(0)', 'tp': 'S(0)'}}
    """
    axes = tuple(axes or [a for a, n in zip(mesh.names, mesh.shape) if n > 1])
    return HandPlan("ddp", f"DDP over {' x '.join(axes)}", mesh, _batch_hints(mesh, axes, batch, n_inputs))


def fsdp(roles: ModelRoles, mesh: Mesh, batch: int, n_inputs: int = 1, axes: tuple | None = None) -> HandPlan:
    """FSDP (ZeRO-3) over the largest batch axis, the batch split over `axes` (HSDP when there are several).

    >>> fsdp(roles, mesh, batch=8), fsdp(roles, mesh, batch=8, axes=("dp",)).zero
    (HandPlan('fsdp': HSDP: ZeRO-3 over tp, replicated over the rest of dp x tp), {'dp': 3})
    """
    plan = ddp(roles, mesh, batch, n_inputs, axes)
    axes = tuple(plan.hints["input:0"])
    shard = _zero_axis(mesh, axes)
    kind = "FSDP (ZeRO-3)" if len(axes) == 1 else f"HSDP: ZeRO-3 over {shard}, replicated over the rest of"
    return HandPlan("fsdp", f"{kind} {' x '.join(axes)}", mesh, plan.hints, zero={shard: 3})


def dp_tp(roles: ModelRoles, mesh: Mesh, batch: int, n_inputs: int = 1, tp: str = "tp",
          axes: tuple | None = None) -> HandPlan:
    """Megatron tensor parallel over `tp`, data parallel (DDP) over the batch axes: Megatron-LM's original layout,
    parameters replicated over the batch axes (the memory ladder adds ZeRO where the budget needs it, as Megatron's
    distributed optimizer does).

    >>> plan = dp_tp(roles, mesh, batch=8)
    >>> plan.hints["layers.*.attn.q.weight"], plan.hints["input:0"], "zero" in plan.options
    ({'tp': 'S(0)'}, {'dp': 'S(0)'}, False)
    """
    tp = _axis(mesh, tp, "tensor parallelism")
    axes = tuple(axes or [a for a, n in zip(mesh.names, mesh.shape) if n > 1 and a != tp])
    hints = {**_batch_hints(mesh, axes, batch, n_inputs), **_megatron_hints(roles, mesh, tp)}
    return HandPlan("dp_tp", f"DDP over {' x '.join(axes)} x Megatron TP over {tp}", mesh, hints)


def fsdp_tp(roles: ModelRoles, mesh: Mesh, batch: int, n_inputs: int = 1, tp: str = "tp",
            axes: tuple | None = None) -> HandPlan:
    """FSDP (ZeRO-3) over the batch axes x Megatron tensor parallel over `tp` (torchtitan's 2-D layout).

    >>> fsdp_tp(roles, mesh, batch=8).hints["layers.*.attn.q.weight"]
    {'tp': 'S(0)'}
    """
    tp = _axis(mesh, tp, "tensor parallelism")
    axes = tuple(axes or [a for a, n in zip(mesh.names, mesh.shape) if n > 1 and a != tp])
    hints = {**_batch_hints(mesh, axes, batch, n_inputs), **_megatron_hints(roles, mesh, tp)}
    shard = _zero_axis(mesh, axes)
    return HandPlan("fsdp_tp", f"FSDP (ZeRO-3) over {shard} x Megatron TP over {tp}", mesh, hints,
                    zero={shard: 3})


def tp_sp(roles: ModelRoles, mesh: Mesh, batch: int, n_inputs: int = 1, tp: str = "tp",
          axes: tuple | None = None) -> HandPlan:
    """Megatron-SP over `tp` (tensor parallel, the norms' regions split on the sequence), data parallel over
    the batch axes (none on a 1-D mesh).

    >>> sp = tp_sp(roles, mesh, batch=8)
    >>> sp.hints["layers.*.attn_norm:output"], sp.hints["layers.*.mlp.w1:input"], "zero" in sp.options
    ({'tp': 'S(1)'}, {'tp': 'R'}, False)
    """
    tp = _axis(mesh, tp, "tensor parallelism")
    axes = tuple(axes if axes is not None else [a for a, n in zip(mesh.names, mesh.shape) if n > 1 and a != tp])
    hints = _batch_hints(mesh, axes, batch, n_inputs) if axes else {}
    hints.update(_megatron_hints(roles, mesh, tp))
    if not roles.sequence_regions:
        raise NotApplicable("no module feeds the column-parallel linears from outside their block (no norm region "
                            "to split on the sequence)")
    k = mesh.shape[mesh.axis(tp)]
    for region in roles.sequence_regions:
        shape = roles.sizes.get(region, ())
        if len(shape) != 3 or shape[1] % k:
            raise NotApplicable(f"{region}'s output {list(shape)} is not [batch, sequence, features] with a "
                                f"sequence divisible by {tp}={k}")
    hints.update({f"{m}:output": {tp: "S(1)"} for m in roles.sequence_regions + roles.row_modules})
    hints.update({f"{m}:input": {tp: "R"} for m in roles.column_modules})
    dp = f", data parallel over {' x '.join(axes)}" if axes else ""
    return HandPlan("tp_sp", f"Megatron-SP over {tp}{dp}", mesh, hints)


def fsdp_tp_pp(roles: ModelRoles, mesh: Mesh, batch: int, n_inputs: int = 1, tp: str = "tp", pp: str = "pp",
               schedule: str = "1F1B", microbatches: int | None = None) -> HandPlan:
    """FSDP x TP inside each stage of a pipeline over `pp` (torchtitan's 3-D layout); `schedule` 1F1B or
    Interleaved1F1B (two stages per pp rank).

    >>> cube = autoshard.Mesh((2, 2, 2), ("pp", "dp", "tp"))
    >>> fsdp_tp_pp(roles, cube, batch=8).options["pipeline"]
    {'axis': 'pp', 'schedule': '1F1B', 'microbatches': 4}
    """
    pp = _axis(mesh, pp, "a pipeline")
    stages = mesh.shape[mesh.axis(pp)]
    inner = Mesh(tuple(n for a, n in zip(mesh.names, mesh.shape) if a != pp), tuple(a for a in mesh.names if a != pp))
    ways = math.prod(n for a, n in zip(inner.names, inner.shape) if a != tp)
    m = microbatches or _microbatch_count(batch, ways, stages)
    if batch % m:
        raise NotApplicable(f"the batch of {batch} does not split into {m} micro-batches")
    plan = fsdp_tp(roles, inner, batch // m, n_inputs, tp)
    pipeline = {"axis": pp, "schedule": schedule, "microbatches": m}
    if schedule != "1F1B":
        pipeline["virtual_stages"] = 2
    return HandPlan("fsdp_tp_pp", f"{plan.description} x {schedule} pipeline over {pp}", mesh, plan.hints,
                    zero=plan.zero, pipeline=pipeline)


def _microbatch_count(batch: int, ways: int, stages: int) -> int:
    """The fewest micro-batches from 2 x `stages` up (a small bubble) whose size still splits `ways` ways over the
    batch axes; else the most there can be (one sequence per batch rank).

    >>> _microbatch_count(64, 8, 8), _microbatch_count(64, 2, 2)
    (8, 4)
    """
    fitting = [m for m in range(1, batch + 1) if batch % m == 0 and (batch // m) % ways == 0]
    if not fitting:
        raise NotApplicable(f"the batch of {batch} does not split {ways} ways over the batch axes")
    return next((m for m in fitting if m >= 2 * stages), fitting[-1])


def tp_cp(roles: ModelRoles, mesh: Mesh, batch: int, seq: int, n_inputs: int = 1, tp: str = "tp", cp: str = "cp",
          strategy: str = "ring") -> HandPlan:
    """Context parallel over `cp` (the inputs split on the sequence, each attention by `strategy`) x Megatron
    over `tp`, data parallel over the other axes.

    >>> ring = tp_cp(roles, autoshard.Mesh((2, 2), ("cp", "tp")), batch=8, seq=16)
    >>> ring.hints["input:0"], ring.hints["layers.*.attn:attention"]
    ({'cp': 'S(1)'}, {'cp': 'ring'})
    """
    tp, cp = _axis(mesh, tp, "tensor parallelism"), _axis(mesh, cp, "context parallelism")
    if not roles.attention:
        raise NotApplicable("the model has no scaled_dot_product_attention in its repeated blocks")
    k = mesh.shape[mesh.axis(cp)]
    if seq % (2 * k):
        raise NotApplicable(f"the sequence of {seq} does not split into {2 * k} chunks (zigzag over {cp}={k})")
    axes = tuple(a for a, n in zip(mesh.names, mesh.shape) if n > 1 and a not in (tp, cp))
    hints = _batch_hints(mesh, axes, batch, n_inputs) if axes else {}
    for i in range(n_inputs):
        hints.setdefault(f"input:{i}", {})[cp] = "S(1)"
    hints.update(_megatron_hints(roles, mesh, tp))
    hints.update({f"{m}:attention": {cp: strategy} for m in roles.attention})
    return HandPlan("tp_cp", f"context parallel ({strategy}) over {cp} x Megatron TP over {tp}", mesh, hints)


def ep_dp(roles: ModelRoles, mesh: Mesh, batch: int, n_inputs: int = 1, ep: str | None = None) -> HandPlan:
    """Expert parallelism inside data parallelism: the experts split over `ep` (default: the largest batch
    axis), which also splits the batch; the other axes data parallel too.

    >>> from autoshard.zoo import moe_llama
    >>> moe, moe_inputs, moe_loss = moe_llama()
    >>> ep_dp(model_roles_of(moe, moe_inputs, moe_loss), autoshard.Mesh((2,), ("dp",)), batch=8).hints
    {'input:0': {'dp': 'S(0)'}, 'layers.*.moe.w1': {'dp': 'S(0)'}, 'layers.*.moe.w3': {'dp': 'S(0)'}, 'layers.*.moe.w2': {'dp': 'S(0)'}}
    """
    if not roles.experts:
        raise NotApplicable("the model has no stacked expert weights in its repeated blocks")
    axes = tuple(a for a, n in zip(mesh.names, mesh.shape) if n > 1)
    ep = ep or _zero_axis(mesh, axes)
    hints = _batch_hints(mesh, axes, batch, n_inputs)
    k = mesh.shape[mesh.axis(ep)]
    for glob in roles.experts:
        if roles.sizes[glob][0] % k:
            raise NotApplicable(f"{glob} stacks {roles.sizes[glob][0]} experts, not divisible by {ep}={k}")
        hints[glob] = {ep: "S(0)"}
    return HandPlan("ep_dp", f"experts over {ep} inside data parallel {' x '.join(axes)}", mesh, hints)
