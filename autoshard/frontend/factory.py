"""What the user hands autoshard, checked before anything is traced: the model, the example inputs, the
loss function, and a FACTORY (`MODULE:FACTORY` on the command line) returning them. A mistake is named as
itself (a loss function of the wrong arity, a string where the model belongs) instead of surfacing later
as a torch.export failure or an AttributeError deep inside the planner.

>>> model, inputs, loss_fn = make_case("autoshard.zoo:mlp")
>>> type(model).__name__, inputs[0].dtype, loss_fn.__name__
('MLP', torch.float32, 'mlp_loss')
"""
from __future__ import annotations

import importlib
import inspect

import torch

from autoshard.ir.errors import UserInputError

_FORM = "(model, example_inputs) or (model, example_inputs, loss_fn)"


def load_factory(spec: str):
    """'package.module:factory' -> the zero-argument callable (errors say what to fix).

    >>> load_factory("autoshard.zoo:mlp").__name__
    'mlp'
    >>> load_factory("autoshard.zoo.mlp")
    Traceback (most recent call last):
    ...
    autoshard.ir.errors.UserInputError: factory 'autoshard.zoo.mlp' must look like MODULE:FACTORY, e.g. ...
    """
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


def make_case(spec: str):
    """Call the FACTORY `spec` and check what it returned: (model, example_inputs as a tuple, loss_fn or
    None), in the model's own dtype.

    >>> make_case("autoshard.zoo.mlp:MLPConfig")  # callable with no arguments, but not a factory
    Traceback (most recent call last):
    ...
    autoshard.ir.errors.UserInputError: factory 'autoshard.zoo.mlp:MLPConfig' returned a MLPConfig, not a tuple; ...
    """
    factory = load_factory(spec)
    try:
        made = factory()
    except Exception as exc:  # the user's code: say whose, keep the original chained
        raise UserInputError(f"factory {spec!r} raised {type(exc).__name__}: {exc}{where_defined(factory)}\n"
                             f"What to do: fix the factory; it must run with no arguments and return {_FORM}"
                             ) from exc
    return check_factory_result(made, spec, where_defined(factory))


def check_factory_result(made, spec: str, where: str = ""):
    """(model, inputs, loss_fn) from what a factory returned, or a UserInputError listing what it returned
    and what is expected.

    >>> check_factory_result("gpt2", "my_models:build")
    Traceback (most recent call last):
    ...
    autoshard.ir.errors.UserInputError: factory 'my_models:build' returned a str ('gpt2'), not a tuple; it must return ...
    """
    origin = f"factory {spec!r}"
    if isinstance(made, torch.nn.Module):
        raise UserInputError(f"{origin} returned the model alone ({type(made).__name__}); return it with its "
                             f"example inputs: {_FORM}, e.g. `return model, (x,)`{where}")
    if not isinstance(made, (tuple, list)):
        raise UserInputError(f"{origin} returned {describe(made)}, not a tuple; it must return {_FORM}, e.g. "
                             f"`return model, (x,), loss_fn`{where}")
    kinds = ", ".join(type(item).__name__ for item in made)
    if len(made) not in (2, 3):
        raise UserInputError(f"{origin} returned {len(made)} items ({kinds}); expected {_FORM}{where}")
    if not isinstance(made[0], torch.nn.Module):
        at = next((i for i, item in enumerate(made) if isinstance(item, torch.nn.Module)), None)
        hint = f" (item {at} is an nn.Module: are the items in the wrong order?)" if at is not None else ""
        raise UserInputError(f"{origin} returned ({kinds}): item 0 must be the model, a torch.nn.Module (or an "
                             f"fx.GraphModule), but is {describe(made[0])}{hint}; return {_FORM}{where}")
    loss_fn = made[2] if len(made) == 3 else None
    if loss_fn is not None and not callable(loss_fn):
        raise UserInputError(f"{origin} returned ({kinds}): item 2 must be the loss function loss_fn(outputs, "
                             f"*example_inputs) -> scalar tensor, but is {describe(loss_fn)}; return "
                             f"(model, example_inputs) for the default loss (the sum of the outputs' means){where}")
    inputs = check_inputs(made[1], f"{origin}: ")
    check_loss_fn(loss_fn, len(inputs), f"{origin}: ")
    return made[0], inputs, loss_fn


def check_model(model) -> None:
    """A UserInputError unless `model` is an nn.Module (an fx.GraphModule is one).

    >>> check_model(lambda x: x)
    Traceback (most recent call last):
    ...
    autoshard.ir.errors.UserInputError: model must be a torch.nn.Module (or an fx.GraphModule), got function; wrap ...
    """
    if not isinstance(model, torch.nn.Module):
        raise UserInputError(f"model must be a torch.nn.Module (or an fx.GraphModule), got {type(model).__name__}; "
                             "wrap a plain function in an nn.Module whose forward() calls it")


def check_inputs(example_inputs, origin: str = "") -> tuple:
    """The example inputs as a tuple of tensors (one tensor is accepted alone); `origin` prefixes messages.

    >>> check_inputs(torch.ones(2)), check_inputs([torch.ones(1), torch.zeros(1)])
    ((tensor([1., 1.]),), (tensor([1.]), tensor([0.])))
    >>> check_inputs((torch.ones(2), "mask"))
    Traceback (most recent call last):
    ...
    autoshard.ir.errors.UserInputError: example_inputs[1] is of type str ('mask'), not a torch.Tensor; ...
    """
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)):
        extra = " (keyword inputs are not supported)" if isinstance(example_inputs, dict) else ""
        raise UserInputError(f"{origin}example_inputs must be a tuple (or list) of tensors, one per positional "
                             f"argument of forward(), got {describe(example_inputs)}{extra}; pass e.g. (ids, mask)")
    for i, value in enumerate(example_inputs):
        if isinstance(value, torch.Tensor):
            continue
        if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
            todo = (f"pass its {len(value)} tensors as separate example inputs (forward() then takes them as "
                    "separate arguments)")
        else:
            todo = ("autoshard shards tensor inputs only. Bind other arguments into the model (e.g. functools.partial "
                    "or module attributes) and pass only tensors.")
        raise UserInputError(f"{origin}example_inputs[{i}] is of type {type(value).__name__}{_value(value)}, not a "
                             f"torch.Tensor; {todo}")
    return tuple(example_inputs)


def check_loss_fn(loss_fn, n_inputs: int, origin: str = "") -> None:
    """A UserInputError unless `loss_fn` is None or callable as loss_fn(outputs, *example_inputs) with
    `n_inputs` example inputs (checked on its signature, before any tracing).

    >>> def loss(out):
    ...     return out.sum()
    >>> check_loss_fn(loss, 1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    autoshard.ir.errors.UserInputError: loss_fn loss(out) takes 1 positional argument, but autoshard calls it as ...
    """
    if loss_fn is None:
        return
    if not callable(loss_fn):
        raise UserInputError(f"{origin}loss_fn must be a function loss_fn(outputs, *inputs) -> scalar tensor, got "
                             f"{type(loss_fn).__name__}; leave it out to use the sum of the outputs' means")
    try:
        sig = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # builtins without a signature: their call will tell
        return
    kinds = inspect.Parameter
    positional = [p for p in sig.parameters.values() if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    varargs = any(p.kind is kinds.VAR_POSITIONAL for p in sig.parameters.values())
    keyword = [p.name for p in sig.parameters.values() if p.kind is kinds.KEYWORD_ONLY and p.default is p.empty]
    given = 1 + n_inputs
    name = f"loss_fn {loss_name(loss_fn)}{sig}"
    call = (f"autoshard calls it as loss_fn(outputs, *example_inputs) with {given} arguments: the model's outputs, "
            f"then the {n_inputs} example input{'s' if n_inputs != 1 else ''}")
    where = where_defined(loss_fn)
    if len(required) > given:
        raise UserInputError(f"{origin}{name} needs {len(required)} positional arguments, but {call}; give the extra "
                             f"parameters defaults or pass those values as example inputs{where}")
    if len(positional) < given and not varargs:
        params = ", ".join(["outputs"] + [f"x{i}" for i in range(n_inputs)])
        raise UserInputError(f"{origin}{name} takes {len(positional)} positional argument"
                             f"{'s' if len(positional) != 1 else ''}, but {call}; give it the parameters ({params}), "
                             f"or (outputs, *inputs) to ignore the inputs{where}")
    if keyword:
        raise UserInputError(f"{origin}{name} requires keyword argument(s) {keyword}, which are never passed: {call}; "
                             f"make them positional (they receive the example inputs in order) or give them defaults"
                             f"{where}")


def check_loss_value(loss, loss_fn) -> None:
    """A UserInputError unless what `loss_fn` returned is a floating-point scalar tensor (the front end calls
    this while tracing).

    >>> check_loss_value(torch.ones(8, 4), lambda out, x: out)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    autoshard.ir.errors.UserInputError: loss_fn <lambda> returned a tensor of shape (8, 4), not a scalar; reduce it ...
    """
    name = f"loss_fn {loss_name(loss_fn)}"
    where = where_defined(loss_fn)
    if isinstance(loss, (tuple, list)):
        raise UserInputError(f"{name} returned a {type(loss).__name__} of {len(loss)} items; return only the loss, a "
                             f"scalar tensor (autoshard keeps the model's outputs itself){where}")
    if not isinstance(loss, torch.Tensor):
        raise UserInputError(f"{name} returned {describe(loss)}, not a tensor; compute the loss with torch operations "
                             f"on the outputs so it has a gradient, e.g. outputs.pow(2).mean(){where}")
    if loss.dim() != 0:
        raise UserInputError(f"{name} returned a tensor of shape {tuple(loss.shape)}, not a scalar; reduce it to one "
                             f"number, e.g. with .mean() or .sum(){where}")
    if not loss.is_floating_point():
        raise UserInputError(f"{name} returned a {loss.dtype} scalar; the loss must be floating point to be "
                             f"differentiated (e.g. .float() the counts before dividing){where}")


def loss_name(loss_fn) -> str:
    """How messages name a loss function: its name (the Where: line says which file), or its class for a module
    or callable object.

    >>> loss_name(torch.nn.MSELoss()), loss_name(lambda out: out)
    ('MSELoss', '<lambda>')
    """
    return getattr(loss_fn, "__name__", None) or type(loss_fn).__name__


def where_defined(fn) -> str:
    """'\\nWhere: File "...", line N, in name' for a function, class instance or partial ('' if unknown).

    >>> where_defined(loss_name).endswith("in loss_name")
    True
    """
    target = getattr(fn, "func", fn)  # functools.partial
    if not inspect.isfunction(target) and not inspect.ismethod(target):
        target = getattr(type(target), "forward", None) or getattr(type(target), "__call__", None)
    target = inspect.unwrap(target) if target is not None else None
    code = getattr(target, "__code__", None)
    if code is None:
        return ""
    return f'\nWhere: File "{code.co_filename}", line {code.co_firstlineno}, in {code.co_name}'


def describe(value) -> str:
    """A value as messages show it: its type and, when short, its repr.

    >>> describe("gpt2"), describe(None), describe(torch.ones(2, 3))
    ("a str ('gpt2')", 'None', 'a tensor of shape (2, 3)')
    """
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}{_value(value)}"


def _value(value) -> str:
    """' (<repr>)' when the repr is short enough to help, else ''."""
    if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value):
        return f" of {len(value)} item{'s' if len(value) != 1 else ''}"
    text = repr(value)
    return f" ({text})" if len(text) <= 40 and " at 0x" not in text else ""  # no addresses: messages stay stable
