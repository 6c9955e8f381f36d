"""`weights="init"`: a model's own initialisation replayed module by module, on a model whose tensors may
all be on the meta device, handing each full tensor to a callback that keeps only what it needs.

The replay is `torch.manual_seed(seed); model.apply(init)` on one device, where `init(module)` is
`init_fn(module)` when given and otherwise the module's default (`module_inits`): the `_init_weights`
of the innermost transformers model (`PreTrainedModel`) holding it, as transformers' own
`initialize_weights` dispatches, so a transformers model wrapped in any module keeps its rule (rotary
tables included); outside one, the module's own `reset_parameters()`. Modules are visited children first
(Module.apply's order), and only modules that hold parameters or buffers of their own are initialised.
Each is initialised on a shallow copy whose own tensors are fresh CPU tensors, so the user's model is
never changed and at most one module's full tensors (plus tied ones until their last owner is done)
exist at a time. A module's initialisation may set only its own tensors (torch's and transformers' do).

Every floating tensor starts as NaN: one the initialisation leaves untouched is an error naming it, not
a silent garbage weight. Tensors of the model that are real (not meta) start from their values.

>>> import torch
>>> with torch.device("meta"):
...     net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))
>>> kept = {}
>>> replay_init(net, lambda name, tensor: kept.update({name: tensor.clone()}), seed=0)
>>> reference = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))
>>> _ = torch.manual_seed(0); _ = reference.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
>>> all(torch.equal(kept[k], v) for k, v in reference.state_dict().items())
True
"""
from __future__ import annotations

import copy

import torch

from autoshard.weights.training_checkpoint import CheckpointError


def module_inits(model) -> dict:
    """{module FQN: its default initialisation} for the modules inside a transformers model: the
    `_init_weights` of the innermost one holding it (a module with a `config` and an `_init_weights`, as
    every `PreTrainedModel` has), found anywhere in `model`; the others are absent (their
    `reset_parameters()` initialises them).

    >>> class Pretrained(torch.nn.Module):   # shaped like a transformers PreTrainedModel
    ...     config = {}
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.proj = torch.nn.Linear(2, 2)
    ...     def _init_weights(self, module):
    ...         pass
    >>> wrapper = torch.nn.Sequential(Pretrained(), torch.nn.Linear(2, 2))
    >>> {fqn: init.__qualname__ for fqn, init in module_inits(wrapper).items()}
    {'0': 'Pretrained._init_weights', '0.proj': 'Pretrained._init_weights'}
    """
    inits: dict = {}
    _assign(model, "", None, inits, set())
    return inits


def _assign(module, prefix: str, init, inits: dict, seen: set) -> None:
    if id(module) in seen:
        return
    seen.add(id(module))
    own = getattr(module, "_init_weights", None)
    if callable(own) and hasattr(module, "config"):
        init = own
    if init is not None:
        inits[prefix] = init
    for name, child in module._modules.items():
        if child is not None:
            _assign(child, f"{prefix}.{name}" if prefix else name, init, inits, seen)


def replay_init(model, take, seed: int = 0, init_fn=None, modules=None) -> None:
    """Initialise `model` module by module (see the module docstring) and call `take(fqn, full_tensor)`
    once per parameter and buffer FQN (every name of a tied tensor) when its last owner is done.
    `init_fn(module)` initialises every module when given, else each module's default (`module_inits`).
    With `modules` (a set of module FQNs) only those are initialised (e.g. to compute buffers).

    >>> shapes = {}
    >>> replay_init(net, lambda name, tensor: shapes.update({name: tuple(tensor.shape)}), modules={"1"})
    >>> shapes
    {'1.weight': (8,), '1.bias': (8,)}
    """
    order = list(_post_order(model))
    names = _names_by_tensor(model)
    owners: dict = {}
    for prefix, module in order:
        if modules is None or prefix in modules:
            for _, tensor in _own_tensors(module):
                owners[id(tensor)] = owners.get(id(tensor), 0) + 1
    full: dict = {}  # id(model tensor) -> the real tensor standing in for it
    inits = module_inits(model) if init_fn is None else {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for prefix, module in order:
            own = _own_tensors(module)
            if not own or (modules is not None and prefix not in modules):
                continue
            init = init_fn if init_fn is not None else inits.get(prefix)
            _initialise(_materialize(module, full), init)
            for name, tensor in own:
                owners[id(tensor)] -= 1
                if owners[id(tensor)] == 0:
                    value = full.pop(id(tensor))
                    if value.is_floating_point() and value.numel() and torch.isnan(value).all():
                        raise CheckpointError(_untouched(prefix, name, module, init))
                    for fqn in names.get(id(tensor), []):
                        take(fqn, value)


def _initialise(clone, init) -> None:
    if init is not None:
        init(clone)
    elif hasattr(clone, "reset_parameters"):
        clone.reset_parameters()


def _untouched(prefix: str, name: str, module, init) -> str:
    where = f"{prefix}.{name}" if prefix else name
    by = "" if init is None else f", by {getattr(init, '__qualname__', repr(init))}"
    return (f"weights='init': the initialisation of {prefix or 'the model'} ({type(module).__name__}{by}) does not "
            f"set {where!r}: give the module a reset_parameters(), pass init_fn= (for a transformers model its "
            "_init_weights), or load the weights from a file")


def _own_tensors(module) -> list:
    tensors = [(n, p) for n, p in module._parameters.items() if p is not None]
    return tensors + [(n, b) for n, b in module._buffers.items() if b is not None]


def _materialize(module, full: dict):
    """A shallow copy of `module` whose own tensors are real CPU tensors (shared through `full` when tied)."""
    clone = copy.copy(module)
    params, buffers = {}, {}
    for name, p in module._parameters.items():
        params[name] = None if p is None else torch.nn.Parameter(_real(p, full), requires_grad=p.requires_grad)
    for name, b in module._buffers.items():
        buffers[name] = None if b is None else _real(b, full)
    clone.__dict__["_parameters"] = params
    clone.__dict__["_buffers"] = buffers
    return clone


def _real(tensor, full: dict) -> torch.Tensor:
    if id(tensor) not in full:
        if tensor.device.type == "meta":
            value = torch.empty(tensor.shape, dtype=tensor.dtype)
            if value.is_floating_point():
                value.fill_(float("nan"))  # so that a tensor no initialisation sets is caught
        else:
            value = tensor.detach().to("cpu", copy=True)
        full[id(tensor)] = value
    return full[id(tensor)]


def _post_order(model, prefix: str = "", seen=None):
    """(FQN, module) children first, each module once (Module.apply's order)."""
    seen = set() if seen is None else seen
    if id(model) in seen:
        return
    seen.add(id(model))
    for name, child in model._modules.items():
        if child is not None:
            yield from _post_order(child, f"{prefix}.{name}" if prefix else name, seen)
    yield prefix, model


def _names_by_tensor(model) -> dict:
    """id(tensor) -> every FQN under which `model` holds it (tied tensors have several)."""
    by_id: dict = {}
    for fqn, t in list(model.named_parameters(remove_duplicate=False)) + list(
            model.named_buffers(remove_duplicate=False)):
        by_id.setdefault(id(t), []).append(fqn)
    return by_id
