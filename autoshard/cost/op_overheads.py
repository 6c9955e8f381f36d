"""The fixed costs of an op whatever its size, measured on the device at hand (`compute_rates.measure_compute`
uses them): each of the ops graphs are mostly made of timed on small tensors as rank programs run them, forward
without autograd, forward recorded by it, and backward (`op_overheads`); a view's (`view_overheads`); and how much
longer a zero-bubble schedule's split backward takes than the fused one (`split_backward_factor`).
"""
from __future__ import annotations

import statistics

import torch

from autoshard.cost.kernel_timing import DEPTH, chain_step, leaf, median_seconds, timer
from autoshard.ir.warn_once import warn_once


def view_overheads(dtype: torch.dtype, device: torch.device, repeats: int) -> tuple[float, float, float]:
    """Seconds of a view's forward without autograd, with it, and of its backward (the marginal cost of one more
    view in a chain's backward, `marginal_backward`): a chain of transposes (what a view costs does not depend on
    its size).

    >>> unrecorded, recorded, backward = view_overheads(torch.float32, torch.device("cpu"), 3)
    >>> 0 < unrecorded and 0 <= backward
    True
    """
    timed, x = timer(device), leaf((4, 4), dtype, device)
    repeats = max(repeats, 25)

    def seconds(mode: str, depth: int = DEPTH) -> float:
        return median_seconds(chain_step(lambda t: t.transpose(0, 1), x, [x], mode, depth), timed, repeats)
    recorded = {depth: seconds("forward", depth) for depth in (DEPTH, 3 * DEPTH)}
    unrecorded = seconds("no_grad") / DEPTH
    backward = marginal_backward(lambda depth: seconds("train", depth) - recorded[depth])
    return unrecorded, max(recorded[DEPTH] / DEPTH, unrecorded), backward


def marginal_backward(backward_of) -> float:
    """Seconds one more op adds to a backward: `backward_of(depth)` (the backward of `depth` ops, seconds) at
    DEPTH and 3 x DEPTH ops, the difference per op. What a backward pays once however many ops it runs (the
    engine's start and its thread hand-off, ~50 us on a CPU) cancels: a model's backward runs hundreds of ops,
    and that start spread over a probe's DEPTH ops had priced every op's backward ~5 us long (the transformers
    models' 3 ms steps predicted 1.3x, their backward 1.5-1.8x).

    >>> round(marginal_backward(lambda depth: 50e-6 + depth * 2e-6) * 1e6, 6)
    2.0
    """
    return max((backward_of(3 * DEPTH) - backward_of(DEPTH)) / (2 * DEPTH), 0.0)


FIXED_REPEATS = 15  # a probe of DEPTH small ops takes ~0.1 ms on a CPU: repeats are cheap


def _probes(dtype: torch.dtype, device: torch.device) -> dict:
    """ATen op name -> (op, args, kwargs, whether its output has a gradient) on small leaves: the ops transformer,
    vision and audio graphs are mostly made of (what is not here pays the median)."""
    x = (torch.rand(4, 16, dtype=dtype, device=device) + 0.5).requires_grad_()
    w = torch.randn(16, 16, dtype=dtype, device=device).requires_grad_()
    v = torch.rand(16, dtype=dtype, device=device).requires_grad_()
    q = torch.randn(1, 2, 8, 8, dtype=dtype, device=device).requires_grad_()
    ids = torch.randint(0, 16, (4, 8), device=device)
    mask, labels = ids[:, :1] > 3, torch.randint(0, 16, (4,), device=device)
    image = torch.randn(1, 4, 8, 8, dtype=dtype, device=device).requires_grad_()
    kernel = torch.randn(4, 4, 3, 3, dtype=dtype, device=device).requires_grad_()
    aten = torch.ops.aten
    unary = ("neg.default", "rsqrt.default", "exp.default", "tanh.default", "sigmoid.default", "silu.default",
             "gelu.default", "relu.default", "cos.default", "sin.default", "clone.default")
    probes = {f"aten.{name}": (getattr(aten, name.split(".")[0]).default, (x,), {}, True) for name in unary}
    probes.update({f"aten.{name}.Tensor": (getattr(aten, name).Tensor, (x, x), {}, True)
                   for name in ("add", "sub", "mul", "div")})
    probes.update({  # name: (op, args, kwargs, has a gradient)
        "aten.pow.Tensor_Scalar": (aten.pow.Tensor_Scalar, (x, 2), {}, True),
        "aten.where.self": (aten.where.self, (mask, x, x), {}, True),
        "aten.sum.dim_IntList": (aten.sum.dim_IntList, (x, [-1], True), {}, True),
        "aten.sum.default": (aten.sum.default, (x,), {}, True),
        "aten.mean.dim": (aten.mean.dim, (x, [-1], True), {}, True),
        "aten.cat.default": (aten.cat.default, ([x, x], -1), {}, True),
        "aten.linear.default": (aten.linear.default, (x, w, v), {}, True),
        "aten.mm.default": (aten.mm.default, (x, w), {}, True),
        "aten.layer_norm.default": (aten.layer_norm.default, (x, [16], v, v), {}, True),
        "aten._softmax.default": (aten._softmax.default, (x, -1, False), {}, True),
        "aten.log_softmax.int": (aten.log_softmax.int, (x, -1), {}, True),
        "aten.dropout.default": (aten.dropout.default, (x, 0.1, True), {}, True),
        "aten.embedding.default": (aten.embedding.default, (w, ids), {}, True),
        "aten.index.Tensor": (aten.index.Tensor, (w, [ids]), {}, True),
        "aten.nll_loss_nd.default": (aten.nll_loss_nd.default, (x, labels), {}, True),
        "aten.cumsum.default": (aten.cumsum.default, (x, -1), {}, True),
        "aten.scaled_dot_product_attention.default":
            (aten.scaled_dot_product_attention.default, (q, q, q), {"is_causal": True}, True),
        "aten.conv2d.default": (aten.conv2d.default, (image, kernel, None, [1, 1], [1, 1]), {}, True),
        "aten._to_copy.default": (aten._to_copy.default, (x,), {"dtype": torch.float16}, True),
        "aten.arange.default": (aten.arange.default, (16,), {"device": device}, False),
        "aten.ne.Scalar": (aten.ne.Scalar, (ids, 0), {}, False),
        "aten.eq.Tensor": (aten.eq.Tensor, (ids, ids), {}, False),
        "aten.le.Tensor": (aten.le.Tensor, (ids, ids), {}, False),
        "aten.__and__.Tensor": (aten.__and__.Tensor, (mask, mask), {}, False),
        "aten._assert_tensor_metadata.default": (aten._assert_tensor_metadata.default, (x,), {"dtype": dtype}, False),
    })
    return probes


def _graph_of(op, args, kwargs, depth: int):
    """(a GraphModule calling `op` `depth` times on its inputs and returning every output, those inputs): the op
    runs as a rank program runs it (generated code, one call per node)."""
    graph, tensors = torch.fx.Graph(), []

    def lift(arg):
        if isinstance(arg, torch.Tensor):
            tensors.append(arg)
            return graph.placeholder(f"t{len(tensors)}")
        return type(arg)(lift(a) for a in arg) if isinstance(arg, (list, tuple)) else arg
    fx_args, fx_kwargs = lift(args), {k: lift(v) for k, v in kwargs.items()}
    graph.output(tuple(graph.call_function(op, fx_args, fx_kwargs) for _ in range(depth)))
    return torch.fx.GraphModule(torch.nn.Module(), graph), tensors


def _fixed_cost(probe, timed, repeats: int) -> tuple[float, float, float]:
    """(forward, added by autograd's recording, backward) seconds of one call of a probe's op: a graph of DEPTH
    calls (`_graph_of`) timed without autograd and with it; the backward is one more call's share of a backward over
    the calls' outputs (`marginal_backward`, less the backward's seed gradients)."""
    op, args, kwargs, has_grad = probe
    graphs = {depth: _graph_of(op, args, kwargs, depth) for depth in (DEPTH, 3 * DEPTH)}

    def run(mode: str, depth: int = DEPTH):
        module, inputs = graphs[depth]
        with torch.set_grad_enabled(mode != "no_grad"):
            outs = [o for o in module(*inputs) if isinstance(o, torch.Tensor) and o.requires_grad]
        if mode == "train":
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    def seconds(mode: str, depth: int = DEPTH) -> float:
        return median_seconds(lambda: run(mode, depth), timed, repeats)
    forward = seconds("no_grad") / DEPTH
    if not has_grad:
        return forward, 0.0, 0.0
    recorded = {depth: seconds("forward", depth) for depth in graphs}
    module, inputs = graphs[DEPTH]
    out = module(*inputs)[0]
    seed = median_seconds(lambda: [torch.ones_like(out) for _ in range(DEPTH)], timed, repeats) / DEPTH
    backward = marginal_backward(lambda depth: seconds("train", depth) - recorded[depth])
    return forward, max(recorded[DEPTH] / DEPTH - forward, 0.0), max(backward - seed, 0.0)


def op_overheads(dtype: torch.dtype, device: torch.device, repeats: int) -> dict:
    """ATen op name -> (forward, added when autograd records it, backward) seconds of the op on small tensors
    (`_probes`): what it costs whatever its size.

    >>> costs = op_overheads(torch.float32, torch.device("cpu"), 3)
    >>> forward, recorded, backward = costs["aten.add.Tensor"]
    >>> forward > 0, backward >= 0.0, costs["aten.ne.Scalar"][2]  # a backward under load can time as 0: not > 0
    (True, True, 0.0)
    """
    timed = timer(device)
    out = {}
    repeats = max(repeats, FIXED_REPEATS)  # the backward is a difference of two medians: fewer repeats, noise
    for name, probe in _probes(dtype, device).items():
        try:
            out[name] = _fixed_cost(probe, timed, repeats)
        except (RuntimeError, NotImplementedError):  # e.g. no kernel for this dtype on this device
            continue
    return out


def median_fixed_costs(rows) -> tuple[float, float, float]:
    """The median of each column of the ops with a gradient (the figures an op not timed pays).

    >>> median_fixed_costs([(1.0, 0.0, 0.0), (2.0, 1.0, 3.0), (4.0, 1.0, 5.0)])  # the first has no backward
    (3.0, 1.0, 4.0)
    """
    rows = [row for row in rows if row[2] > 0] or list(rows)
    return tuple(statistics.median(row[i] for row in rows) for i in range(3))


def split_backward_factor(dtype: torch.dtype, device: torch.device, repeats: int) -> float:
    """How much longer a backward takes split as a zero-bubble schedule runs it (input gradients first, then the
    weights' from the saved intermediates: torch.distributed.pipelining's own functions) than fused, on a small MLP
    (measured on this CPU: ~1.5; the zero-bubble schedules' W actions took twice the planned half backward).

    >>> split_backward_factor(torch.float32, torch.device("cpu"), 3) >= 1.0  # never under the fused backward
    True
    """
    # private to torch, but what its zero-bubble schedules call: the split priced is the one that runs
    try:
        from torch.distributed.pipelining._backward import (
            stage_backward_input,
            stage_backward_weight,
        )
    except ImportError:  # a torch without them: the split is priced as the fused backward (the default)
        warn_once("autoshard: this torch has no torch.distributed.pipelining._backward: calibrate prices a "
                  "zero-bubble schedule's split backward as the fused one")
        return 1.0

    layers = [torch.nn.Linear(128, 128) for _ in range(4)]
    model = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.GELU())]).to(device, dtype)
    x = torch.randn(64, 128, device=device, dtype=dtype, requires_grad=True)
    timed, params = timer(device), list(model.parameters())

    def forward():
        return model(x)

    def fused():
        out = model(x)
        out.backward(torch.ones_like(out))
        model.zero_grad(set_to_none=True)
        x.grad = None

    def split():
        out = model(x)
        _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], iter(params))
        stage_backward_weight(iter(params), groups)
        model.zero_grad(set_to_none=True)
        x.grad = None

    forward_s = median_seconds(forward, timed, repeats)
    fused_s = median_seconds(fused, timed, repeats) - forward_s
    split_s = median_seconds(split, timed, repeats) - forward_s
    # the split does the fused backward's work and more: a figure under 1 (even 0, on a loaded machine with few
    # repeats) is the timer's noise, and would price zero bubble's backward as free
    return max(split_s / max(fused_s, 1e-12), 1.0)
