"""torch.export front end: model + example inputs (+ loss) -> one ATen-level fx graph of a training step.

The traced program is `loss, *outputs = step(*inputs)` with parameters, buffers and user inputs as
placeholders (export's lifted form). Shapes come from FakeTensors, so a model whose weights live on
the meta device is traced without allocating them. Tied parameters become one placeholder whose
other names are kept as aliases.

>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> traced = trace(model, inputs, loss_fn)
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch import fx

from autoshard.frontend.canonical import canonical_graph
from autoshard.frontend.factory import (
    check_inputs,
    check_loss_fn,
    check_loss_value,
    check_model,
    loss_name,
)
from autoshard.frontend.fold import reuse_folds
from autoshard.ir import meta
from autoshard.ir.errors import AutoshardError, ExportError, UserInputError
from autoshard.ir.mixed_precision import policy_call
from autoshard.ir.warn_once import warn_once


class _TrainStep(torch.nn.Module):
    """Wraps the user's model so the loss is part of the traced (and sharded) program."""

    def __init__(self, model, loss_fn, policy=None):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.policy = policy  # mixed precision: parameters and inputs cast for compute (autoshard/ir/mixed_precision.py)

    def forward(self, *inputs):
        outputs = self.model(*inputs) if self.policy is None else policy_call(self.model, inputs, self.policy)
        if self.loss_fn is None:
            return default_loss(outputs), outputs
        loss = self.loss_fn(outputs, *inputs)
        check_loss_value(loss, self.loss_fn)
        return loss, outputs

    @staticmethod
    def failed_in_loss(exc: BaseException) -> bool:
        """Whether `exc` was raised by the loss function, not the model: forward's frame has `outputs` once
        the model has returned (export restores attributes set while tracing, so no flag could say it)."""
        tb = exc.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code is _TrainStep.forward.__code__:
                return "outputs" in tb.tb_frame.f_locals
            tb = tb.tb_next
        return False


def default_loss(outputs):
    """The sum of every floating output's mean (DESIGN: the loss when the factory gives none).

    >>> default_loss((torch.ones(2), {"logits": torch.full((3,), 2.0), "ids": torch.arange(3)}))
    tensor(3.)
    """
    leaves = [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not leaves:
        raise UserInputError("the model returns no floating-point tensor to build a loss from; pass loss_fn")
    total = leaves[0].mean()
    for leaf in leaves[1:]:
        total = total + leaf.mean()
    return total


@dataclass
class Traced:
    """What the front end found: the graph and where its placeholders come from.

    >>> list(traced.params), traced.input_names
    (['layers.0.weight', 'layers.0.bias', 'layers.1.weight', 'layers.1.bias'], ['inputs_0'])
    """

    gm: fx.GraphModule
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    aliases: dict[str, list[str]] = field(default_factory=dict)
    input_names: list[str] = field(default_factory=list)
    output_spec: object = None  # pytree spec of the model's outputs
    # Buffers the model's state_dict leaves out (non-persistent buffers, lifted tensor constants).
    non_persistent: frozenset = frozenset()


# While `reuse_exports()` is active: (model, loss_fn, input shapes) -> the ExportedProgram, kept unmodified.
_EXPORTS: contextvars.ContextVar = contextvars.ContextVar("autoshard_exports", default=None)


@contextlib.contextmanager
def reuse_exports():
    """Within the block, tracing one model and loss at the same input shapes exports once, and folding a model
    gives one folded copy (frontend/fold.py `reuse_folds`): the pipeline search and the hand-plan search plan
    several candidates whose programs often share their shapes. Each trace still gets its own copy of the graph
    (the passes rewrite it in place). `parallelize` opens one block per call; nothing is kept after it.

    >>> with reuse_exports():
    ...     first, second = trace(model, inputs, loss_fn), trace(model, inputs, loss_fn)
    >>> first.gm is not second.gm and first.gm.code == second.gm.code
    True
    """
    token = _EXPORTS.set(_EXPORTS.get() if _EXPORTS.get() is not None else {})
    try:
        with reuse_folds():
            yield
    finally:
        _EXPORTS.reset(token)


def trace(model, example_inputs, loss_fn=None, policy=None) -> Traced:
    """Export `loss_fn(model(*inputs), *inputs)` (or the default loss) at ATen level; every placeholder
    gets `autoshard.kind` and `autoshard.path`, every op its module path. With a mixed-precision `policy`
    the forward casts parameters and inputs to its compute dtype (the placeholders keep theirs).

    >>> for node in list(traced.gm.graph.nodes)[3:7]:
    ...     print(node.name, node.meta["autoshard.kind"], repr(node.meta["autoshard.path"]))
    p_model_layers_1_bias param 'layers.1.bias'
    inputs_0 input 'input:0'
    linear op 'layers.0'
    gelu op ''
    >>> trace(model, (inputs[0].tolist(),))
    Traceback (most recent call last):
    ...
    autoshard.ir.errors.UserInputError: example_inputs[0] is of type list, not a torch.Tensor; ...
    """
    check_model(model)
    example_inputs = check_inputs(example_inputs)
    check_loss_fn(loss_fn, len(example_inputs))
    key = (id(model), id(loss_fn), policy, tuple((tuple(v.shape), v.dtype, str(v.device)) for v in example_inputs))
    exports = _EXPORTS.get()
    exported = exports.get(key) if exports is not None else None
    if exported is None:
        step = _TrainStep(model, loss_fn, policy)
        functions: list = []
        try:
            with custom_functions_seen(functions):
                exported = torch.export.export(step, tuple(example_inputs), strict=False)
        except AutoshardError:  # a check inside the traced code (e.g. the loss's value) already says what to do
            raise
        except Exception as exc:  # re-raised with what to do; the original stays chained
            culprit = f"the loss function {loss_name(loss_fn)}" if step.failed_in_loss(exc) else "the model"
            raise ExportError.from_exception(exc, culprit) from exc
        if functions:
            names = ", ".join(sorted({f"{cls.__module__}.{cls.__qualname__}" for cls in functions}))
            warn_once(f"autoshard: the model applies torch.autograd.Function {names}, whose own backward torch.export "
                      "does not keep: the parallel program differentiates its forward instead, so its gradients "
                      "differ from the model's wherever that backward is not the forward's exact derivative (an "
                      "approximate or straight-through gradient); `python -m autoshard verify` shows whether they "
                      "do", key=f"custom autograd function {names}")
        if exports is not None:
            exports[key] = exported
    gm = copy.deepcopy(exported.graph_module) if exports is not None else exported.graph_module
    return _lift(exported, canonical_graph(gm), model, len(example_inputs))


@contextlib.contextmanager
def custom_functions_seen(found: list):
    """Within the block, every torch.autograd.Function subclass applied (outside torch itself) is appended to
    `found`: non-strict export inlines its forward and drops its backward.

    >>> class Twice(torch.autograd.Function):  # forward x, backward 2 x grad: not the forward's derivative
    ...     @staticmethod
    ...     def forward(ctx, x):
    ...         return x * 1.0
    ...     @staticmethod
    ...     def backward(ctx, grad):
    ...         return grad * 2.0
    >>> seen = []
    >>> with custom_functions_seen(seen):
    ...     _ = Twice.apply(torch.ones(2))
    >>> [cls.__name__ for cls in seen]
    ['Twice']
    """
    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        if not cls.__module__.startswith("torch."):
            found.append(cls)
        return original.__func__(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = original


def _owner(node) -> str:
    """The module of the parameter a top-level op works on alone (mixed precision's per-parameter cast runs
    outside the module that uses it, but belongs to it); '' for anything else."""
    inputs = node.all_input_nodes
    if not inputs or any(a.op != "placeholder" or a.meta.get(meta.KIND) not in ("param", "buffer") for a in inputs):
        return ""
    owners = {a.meta[meta.PATH].rpartition(".")[0] for a in inputs}
    return owners.pop() if len(owners) == 1 else ""


def _lift(exported, gm, model, n_inputs) -> Traced:
    sig = exported.graph_signature
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    to_param = {k: meta._strip_root(v) for k, v in sig.inputs_to_parameters.items()}
    to_buffer = {k: meta._strip_root(v) for k, v in sig.inputs_to_buffers.items()}
    to_const = dict(sig.inputs_to_lifted_tensor_constants)
    named_params = dict(model.named_parameters(remove_duplicate=False))
    named_buffers = dict(model.named_buffers(remove_duplicate=False))

    canonical_by_id: dict[int, fx.Node] = {}
    params, buffers, aliases, input_names = {}, {}, {}, []
    for node in placeholders:
        if node.name in to_param or node.name in to_buffer:
            is_param = node.name in to_param
            fqn = to_param[node.name] if is_param else to_buffer[node.name]
            tensor = named_params[fqn] if is_param else named_buffers.get(fqn, exported.constants.get(fqn))
            first = canonical_by_id.get(id(tensor)) if tensor is not None else None
            if first is not None:  # tied: reuse the first placeholder
                node.replace_all_uses_with(first)
                aliases.setdefault(first.meta[meta.PATH], []).append(fqn)
                gm.graph.erase_node(node)
                continue
            if tensor is not None:
                canonical_by_id[id(tensor)] = node
            node.meta[meta.KIND] = "param" if is_param else "buffer"
            node.meta[meta.PATH] = fqn
            (params if is_param else buffers)[fqn] = tensor
        elif node.name in to_const:
            fqn = to_const[node.name]
            node.meta[meta.KIND] = "buffer"
            node.meta[meta.PATH] = fqn
            buffers[fqn] = exported.constants[fqn]
        else:
            node.meta[meta.KIND] = "input"
            node.meta[meta.PATH] = f"input:{len(input_names)}"
            input_names.append(node.name)
    if len(input_names) != n_inputs:
        raise ExportError(f"export kept {len(input_names)} of {n_inputs} inputs (a non-tensor or unused input?); "
                          "pass only the tensors the model's forward uses")
    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.meta[meta.KIND] = "op"
            node.meta[meta.PATH] = meta.module_path(node) or _owner(node)
        elif node.op == "output":
            node.meta[meta.KIND] = "output"
    for fqn, names in aliases.items():
        for node in placeholders:
            if node.meta.get(meta.PATH) == fqn:
                node.meta[meta.ALIASES] = list(names)
    gm.graph.lint()
    gm.recompile()
    out_spec = exported.call_spec.out_spec.child(1) if exported.call_spec.out_spec else None
    non_persistent = frozenset(meta._strip_root(b) for b in sig.non_persistent_buffers) | frozenset(to_const.values())
    return Traced(gm, params, buffers, aliases, input_names, out_spec, non_persistent)
