"""What the cost model's compute terms use, measured on the device at hand (`python -m autoshard calibrate` runs it
on every rank at once, so the rates include the contention of ranks sharing the machine).

Each kernel class is timed forward + backward through autograd, as training runs it, at a few sizes, and the
cost model's own formula is fitted to the times (`axis_cost.compute_time`: 3 x forward FLOPs for matmuls and
attention, 3 x output bytes for the rest, plus a fixed cost per op):

- matmuls (`torch.nn.functional.linear`) per dtype: seconds = overhead + 3 x 2mnk / rate;
- attention (`scaled_dot_product_attention`): seconds = overhead + 3 x 4 b h s^2 d / rate;
- memory-bound ops (GELU): seconds = overhead + 3 x output bytes / bandwidth (the bandwidth is kept);
- the fixed cost of an op whatever its size (the dispatcher, autograd, a kernel launch), which every op of a plan
  pays: each of the ops graphs are mostly made of (`_probes`: elementwise, reductions, norms, matmuls, attention,
  embedding, losses, integer ops) timed on small tensors forward without autograd, forward recorded by it, and
  forward + backward (`op_overheads`); an op not timed pays their medians; views their own (`view_overheads`).
  (One op does not stand for all: on this CPU a small GELU's forward takes 13 us, a mul's 1.6 us, a view's 1-4 us;
  and a fitted intercept under large sizes is mostly their noise.)

Sizes are small on a CPU and large on a GPU (CUDA events time the kernels there); the fit is least squares on
the median of `repeats` timings of each size.

>>> fit_affine([(1e6, 1e-5 + 1e6 / 1e9), (1e7, 1e-5 + 1e7 / 1e9), (1e8, 1e-5 + 1e8 / 1e9)])  # 10 us + 1 GB/s
(1e-05, 1000000000.0)
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from autoshard.cost.axis_cost import compute_parts
from autoshard.cost.profiles import HardwareProfile
from autoshard.ir.warn_once import warn_once

# (m, n, k) of the matmuls, (batch, heads, sequence, head dim) of attention, elements of the memory-bound op
CPU_SIZES = {"matmul": [(64, 64, 64), (128, 256, 256), (256, 512, 512), (512, 1024, 512)],
             "attention": [(1, 2, 64, 32), (2, 4, 128, 32), (2, 4, 256, 64)],
             "elementwise": [2**10, 2**14, 2**17, 2**20]}
GPU_SIZES = {"matmul": [(1024, 1024, 1024), (2048, 4096, 4096), (4096, 8192, 4096), (8192, 8192, 8192)],
             "attention": [(1, 16, 1024, 128), (2, 16, 2048, 128), (2, 32, 4096, 128)],
             "elementwise": [2**16, 2**22, 2**26, 2**28]}


@dataclass(frozen=True)
class ComputeRates:
    """Fitted rates: matmul FLOP/s per dtype name, attention FLOP/s, bytes/s of memory-bound ops, and the seconds a
    small op's forward and its backward take whatever its size.

    >>> ComputeRates({"float32": 2e10}, 1e10, 5e9, 2e-5, 3e-5).to_json()["op_overhead_s"]
    2e-05
    """

    matmul_flops: dict
    attention_flops: float
    memory_bandwidth: float
    op_overhead_s: float
    grad_op_overhead_s: float = 0.0
    recorded_op_overhead_s: float = 0.0
    view_overhead_s: float = 0.0
    view_grad_overhead_s: float = 0.0
    op_overheads: tuple = ()
    split_backward_factor: float = 1.0

    def scaled(self, forward: float, backward: float) -> ComputeRates:
        """These rates with every fixed cost of a forward times `forward` and of a backward times `backward`.

        >>> ComputeRates({"float32": 2e10}, 1e10, 5e9, 2e-5, 3e-5).scaled(2.0, 0.5).grad_op_overhead_s
        1.5e-05
        """
        return dataclasses.replace(
            self, op_overhead_s=self.op_overhead_s * forward, recorded_op_overhead_s=self.recorded_op_overhead_s *
            forward, view_overhead_s=self.view_overhead_s * forward, grad_op_overhead_s=self.grad_op_overhead_s *
            backward, view_grad_overhead_s=self.view_grad_overhead_s * backward,
            op_overheads=tuple((name, f * forward, r * forward, b * backward) for name, f, r, b in self.op_overheads))

    def profile(self):
        """A HardwareProfile with these rates (float32's matmul rate as its peak) and the default's other figures.

        >>> ComputeRates({"float32": 2e10}, 1e10, 5e9, 2e-5).profile().matmul_flops("float32")
        20000000000.0
        """
        fields = self.to_json()
        fields["dtype_flops"] = tuple((name, rate) for name, rate in fields["dtype_flops"])
        fields["op_overheads"] = self.op_overheads
        peak = self.matmul_flops.get("float32", max(self.matmul_flops.values()))
        return HardwareProfile(peak_flops=peak, **fields)

    def to_json(self) -> dict:
        """The rates as a JSON object (the HardwareProfile fields they become).

        >>> sorted(ComputeRates({"float32": 2e10}, 1e10, 5e9, 2e-5).to_json())[2:]
        ['grad_op_overhead_s', 'memory_bandwidth', 'op_overhead_s', 'op_overheads', 'recorded_op_overhead_s', 'split_backward_factor', 'view_grad_overhead_s', 'view_overhead_s']
        """
        return {"dtype_flops": sorted([name, rate] for name, rate in self.matmul_flops.items()),
                "attention_flops": self.attention_flops, "memory_bandwidth": self.memory_bandwidth,
                "op_overhead_s": self.op_overhead_s, "grad_op_overhead_s": self.grad_op_overhead_s,
                "recorded_op_overhead_s": self.recorded_op_overhead_s, "view_overhead_s": self.view_overhead_s,
                "view_grad_overhead_s": self.view_grad_overhead_s,
                "op_overheads": [list(row) for row in self.op_overheads],
                "split_backward_factor": self.split_backward_factor}


def fit_affine(samples) -> tuple[float, float]:
    """(intercept seconds, rate) of the least-squares line seconds = intercept + work / rate through
    [(work, seconds)]; the intercept is at least 0 and the rate positive.

    >>> fit_affine([(0.0, 2.0), (4.0, 4.0)])  # 2 s + 2 units per second
    (2.0, 2.0)
    """
    a = np.array([[1.0, float(w)] for w, _ in samples])
    t = np.array([float(s) for _, s in samples])
    (intercept, inverse), *_ = np.linalg.lstsq(a, t, rcond=None)
    if inverse <= 0:  # noise swamped the size effect: the largest size's rate, with no intercept
        work, seconds = max(samples)
        return 0.0, float(work) / max(float(seconds), 1e-12)
    return round(max(float(intercept), 0.0), 12), round(1.0 / float(inverse), 3)


def _timer(device: torch.device):
    """A function timing `fn()` on `device`, in seconds: CUDA events there, the wall clock on a CPU."""
    if device.type == "cuda":
        def timed(fn) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            return start.elapsed_time(end) / 1e3
        return timed

    def timed(fn) -> float:
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started
    return timed


def _median_seconds(fn, timed, repeats: int) -> float:
    fn()  # warm up (allocator, kernel selection)
    return statistics.median(timed(fn) for _ in range(repeats))


DEPTH = 8  # ops chained in one forward + backward: one autograd engine start is shared by them, as in a model


def _chain_step(op, first, leaves, mode: str = "train"):
    """A step running `op` DEPTH times, each on the last one's output: forward and backward (`mode` "train"), the
    forward alone with autograd recording it ("forward"), or without autograd ("no_grad")."""
    def step():
        with torch.set_grad_enabled(mode != "no_grad"):
            out = first
            for _ in range(DEPTH):
                out = op(out)
        if mode == "train":
            out.backward(torch.ones_like(out))
            for leaf in leaves:
                leaf.grad = None
    return step


def _leaf(shape, dtype, device):
    return (torch.randn(shape, dtype=dtype, device=device) / shape[-1] ** 0.5).requires_grad_()


def _per_op(samples_of_steps) -> tuple[float, float]:
    """The fit of [(work of one op, seconds of a DEPTH-op step)] per op."""
    return fit_affine([(work, seconds / DEPTH) for work, seconds in samples_of_steps])


def matmul_rate(dtype: torch.dtype, device: torch.device, sizes, repeats: int) -> tuple[float, float]:
    """(overhead s, FLOP/s) of linear's forward + backward in `dtype` (work: 3 x 2mnk; n = k, chained).

    >>> overhead, rate = matmul_rate(torch.float32, torch.device("cpu"), [(16, 16, 16), (64, 64, 64)], 3)
    >>> rate > 0
    True
    """
    timed, samples = _timer(device), []
    for m, n, _ in sizes:
        x, w = _leaf((m, n), dtype, device), _leaf((n, n), dtype, device)
        step = _chain_step(lambda y, w=w: F.linear(y, w), x, [x, w])
        samples.append((3 * 2.0 * m * n * n, _median_seconds(step, timed, repeats)))
    return _per_op(samples)


def attention_rate(dtype: torch.dtype, device: torch.device, sizes, repeats: int) -> tuple[float, float]:
    """(overhead s, FLOP/s) of causal scaled_dot_product_attention's forward + backward (work: 3 x 4 b h s^2 d,
    what `flops.node_flops` counts).

    >>> attention_rate(torch.float32, torch.device("cpu"), [(1, 1, 8, 8), (1, 2, 16, 8)], 3)[1] > 0
    True
    """
    timed, samples = _timer(device), []
    for b, h, s, d in sizes:
        q, k, v = (_leaf((b, h, s, d), dtype, device) for _ in range(3))
        step = _chain_step(lambda y, k=k, v=v: F.scaled_dot_product_attention(y, k, v, is_causal=True), q, [q, k, v])
        samples.append((3 * 4.0 * b * h * s * s * d, _median_seconds(step, timed, repeats)))
    return _per_op(samples)


def elementwise_rate(dtype: torch.dtype, device: torch.device, sizes, repeats: int) -> tuple[float, float]:
    """(overhead s, bytes/s) of GELU's forward + backward (work: 3 x its output bytes).

    >>> elementwise_rate(torch.float32, torch.device("cpu"), [256, 4096], 3)[1] > 0
    True
    """
    timed, samples = _timer(device), []
    for n in sizes:
        x = _leaf((n,), dtype, device)
        step = _chain_step(F.gelu, x, [x])
        samples.append((3.0 * n * x.element_size(), _median_seconds(step, timed, repeats)))
    return _per_op(samples)


def view_overheads(dtype: torch.dtype, device: torch.device, repeats: int) -> tuple[float, float, float]:
    """Seconds of a view's forward without autograd, with it, and of its backward (forward + backward less the
    recorded forward): a chain of transposes (what a view costs does not depend on its size).

    >>> unrecorded, recorded, backward = view_overheads(torch.float32, torch.device("cpu"), 3)
    >>> 0 < unrecorded and 0 < backward
    True
    """
    timed, x = _timer(device), _leaf((4, 4), dtype, device)
    times = [_median_seconds(_chain_step(lambda t: t.transpose(0, 1), x, [x], mode), timed, max(repeats, 25)) / DEPTH
             for mode in ("no_grad", "forward", "train")]
    return times[0], max(times[1], times[0]), max(times[2] - times[1], 0.0)


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
    calls (`_graph_of`) timed without autograd, with it, and with one backward over their outputs (less the
    backward's seed gradients)."""
    op, args, kwargs, has_grad = probe
    module, inputs = _graph_of(op, args, kwargs, DEPTH)

    def run(mode: str):
        with torch.set_grad_enabled(mode != "no_grad"):
            outs = [o for o in module(*inputs) if isinstance(o, torch.Tensor) and o.requires_grad]
        if mode == "train":
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    modes = ("no_grad", "forward", "train") if has_grad else ("no_grad",)
    times = [_median_seconds(lambda mode=mode: run(mode), timed, repeats) / DEPTH for mode in modes]
    if not has_grad:
        return times[0], 0.0, 0.0
    out = module(*inputs)[0]
    seeds = _median_seconds(lambda: [torch.ones_like(out) for _ in range(DEPTH)], timed, repeats) / DEPTH
    return times[0], max(times[1] - times[0], 0.0), max(times[2] - times[1] - seeds, 0.0)


def op_overheads(dtype: torch.dtype, device: torch.device, repeats: int) -> dict:
    """ATen op name -> (forward, added when autograd records it, backward) seconds of the op on small tensors
    (`_probes`): what it costs whatever its size.

    >>> costs = op_overheads(torch.float32, torch.device("cpu"), 3)
    >>> forward, recorded, backward = costs["aten.add.Tensor"]
    >>> forward > 0 and backward > 0, costs["aten.ne.Scalar"][2]
    (True, 0.0)
    """
    timed = _timer(device)
    out = {}
    for name, probe in _probes(dtype, device).items():
        try:
            out[name] = _fixed_cost(probe, timed, repeats)
        except (RuntimeError, NotImplementedError):  # e.g. no kernel for this dtype on this device
            continue
    return out


def _median_row(rows) -> tuple[float, float, float]:
    """The median of each column of the ops with a gradient (the figures an op not timed pays)."""
    rows = [row for row in rows if row[2] > 0] or list(rows)
    return tuple(statistics.median(row[i] for row in rows) for i in range(3))


def split_backward_factor(dtype: torch.dtype, device: torch.device, repeats: int) -> float:
    """How much longer a backward takes split as a zero-bubble schedule runs it (input gradients first, then the
    weights' from the saved intermediates: torch.distributed.pipelining's own functions) than fused, on a small MLP
    (measured on this CPU: ~1.5; the zero-bubble schedules' W actions took twice the planned half backward).

    >>> split_backward_factor(torch.float32, torch.device("cpu"), 3) > 0
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
    timed, params = _timer(device), list(model.parameters())

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

    forward_s = _median_seconds(forward, timed, repeats)
    fused_s = _median_seconds(fused, timed, repeats) - forward_s
    split_s = _median_seconds(split, timed, repeats) - forward_s
    return max(split_s, 0.0) / max(fused_s, 1e-12)


class _Block(torch.nn.Module):
    """A pre-norm transformer block (attention, GELU MLP, residuals): the op sequence `sequence_scales` times."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.up, self.down = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2)
                   for t in self.qkv(self.norm1(x)).split(d, dim=-1))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(attended)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class _Stack(torch.nn.Module):
    """A small language model of `_Block`s: embedding, blocks, head, cross-entropy."""

    def __init__(self, layers: int, dim: int, heads: int, vocab: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())


STACK = {"layers": 4, "batch": 4, "seq": 16, "dim": 32, "heads": 2, "vocab": 64}  # small: the fixed costs dominate
STACK_REPEATS = 21  # one step of the stack is ~1 ms on a CPU


def _graph_grads(graph, params: set) -> dict:
    """Node -> whether its output has a gradient (it depends on a parameter: placeholders named in `params`) in an
    exported graph."""
    flags = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            flags[node] = node.name in params
        elif node.op == "call_function":
            vals = node.meta.get("val")
            vals = vals if isinstance(vals, (tuple, list)) else [vals]
            floating = any(isinstance(v, torch.Tensor) and v.dtype.is_floating_point for v in vals)
            flags[node] = floating and any(flags.get(a, False) for a in node.all_input_nodes)
    return flags


def sequence_scales(device: torch.device, dtype: torch.dtype, rates: ComputeRates, repeats: int) -> tuple:
    """(forward, backward) factors from the fixed costs of ops timed one by one to those of ops run in a model's
    sequence: a `_Stack` of STACK's size exported to ATen, its forward (autograd recording) and backward timed,
    less their work, over the fixed costs `rates` give its ops (`axis_cost.compute_parts`). Measured on this CPU:
    ~2 (ops of one kind back to back keep their code and data in the caches; a graph's sequence does not).

    >>> rates = ComputeRates({"float32": 1e12}, 1e12, 1e12, 1e-6, 2e-6, 0.0, 1e-6, 2e-6)
    >>> forward, backward = sequence_scales(torch.device("cpu"), torch.float32, rates, 3)
    >>> forward >= 0 and backward >= 0  # 0 where the measured time is all work (noise on a loaded machine)
    True
    """
    g = STACK
    model = _Stack(g["layers"], g["dim"], g["heads"], g["vocab"]).to(device, dtype)
    x = torch.randint(0, g["vocab"], (g["batch"], g["seq"]), device=device)
    exported = torch.export.export(model, (x,))
    module, graph = exported.module(), exported.graph_module.graph
    grads = _graph_grads(graph, set(exported.graph_signature.inputs_to_parameters))
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    full, bare = rates.profile(), dataclasses.replace(rates, op_overhead_s=0.0, grad_op_overhead_s=0.0,
                                                      recorded_op_overhead_s=0.0, view_overhead_s=0.0,
                                                      view_grad_overhead_s=0.0, op_overheads=()).profile()
    priced = [compute_parts(n, 1, full, grads[n]) for n in nodes]
    work = [compute_parts(n, 1, bare, grads[n]) for n in nodes]
    fixed_forward = sum(f for f, _ in priced) - sum(f for f, _ in work)
    fixed_backward = sum(b for _, b in priced) - sum(b for _, b in work)
    timed, params = _timer(device), list(model.parameters())

    def forward():
        module(x)

    def train():
        module(x).backward()
        for p in params:
            p.grad = None

    forward_s = _median_seconds(forward, timed, repeats)
    backward_s = _median_seconds(train, timed, repeats) - forward_s
    return (max(forward_s - sum(f for f, _ in work), 0.0) / max(fixed_forward, 1e-12),
            max(backward_s - sum(b for _, b in work), 0.0) / max(fixed_backward, 1e-12))


def measure_compute(device="cpu", dtypes=("float32", "float64"), repeats: int = 7, sizes=None) -> ComputeRates:
    """Every rate the cost model's compute terms use, measured on `device` (see the module docstring); attention
    and memory-bound ops in the first dtype.

    >>> tiny = {"matmul": [(16, 16, 16), (32, 32, 32)], "attention": [(1, 1, 8, 8), (1, 2, 16, 8)],
    ...         "elementwise": [256, 4096]}
    >>> rates = measure_compute("cpu", ("float32",), repeats=3, sizes=tiny)
    >>> sorted(rates.matmul_flops), rates.op_overhead_s >= 0
    (['float32'], True)
    """
    device = torch.device(device)
    sizes = sizes or (GPU_SIZES if device.type == "cuda" else CPU_SIZES)
    matmul = {name: matmul_rate(getattr(torch, name), device, sizes["matmul"], repeats)[1] for name in dtypes}
    first = getattr(torch, dtypes[0])
    _, attention = attention_rate(first, device, sizes["attention"], repeats)
    _, bandwidth = elementwise_rate(first, device, sizes["elementwise"], repeats)
    views = view_overheads(first, device, repeats)
    per_op = op_overheads(first, device, max(repeats, FIXED_REPEATS))
    forward, recorded, backward = _median_row(per_op.values())
    rates = ComputeRates(matmul, attention, bandwidth, forward, backward, recorded, views[1], views[2],
                         tuple(sorted((name, *costs) for name, costs in per_op.items())),
                         split_backward_factor(first, device, max(repeats, STACK_REPEATS)))
    return rates.scaled(*sequence_scales(device, first, rates, max(repeats, STACK_REPEATS)))
