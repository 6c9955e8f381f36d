"""What the cost model's compute terms use, measured on the device at hand (`python -m autoshard calibrate` runs it
on every rank at once, so the rates include the contention of ranks sharing the machine).

Each kernel class is timed forward + backward through autograd, as training runs it, at a few sizes, and the
cost model's own formula is fitted to the times (`axis_cost.compute_time`: 3 x forward FLOPs for matmuls and
attention, 3 x output bytes for the rest, plus a fixed cost per op):

- matmuls (`torch.nn.functional.linear`) per dtype: seconds = overhead + 3 x 2mnk / rate;
- attention (`scaled_dot_product_attention`): seconds = overhead + 3 x 4 b h s^2 d / rate;
- memory-bound ops (GELU): seconds = overhead + 3 x output bytes / bandwidth (the bandwidth is kept);
- the optimizer's update (torch's SGD and AdamW, `optimizer_updates`): seconds = tensors x a cost per tensor +
  (3 + 2 state factor) x parameter bytes / bandwidth, timed on many small tensors and a few large ones (an update
  is not GELU: on this CPU SGD moves 38 GB/s where GELU's forward + backward moves 2.4);
- the fixed cost of an op whatever its size (the dispatcher, autograd, a kernel launch), which every op of a plan
  pays: ~40 ops timed one by one on small tensors and views apart (autoshard/cost/op_overheads.py; an op not timed
  pays their medians), scaled to what a small exported language model's measured sequence says
  (autoshard/cost/sequence_scale.py); and the zero-bubble split backward's cost over the fused one. Last, the
  work itself is scaled to what a model's sequence takes (`sequence_scale.work_scale`: chained on one weight, a
  kernel keeps its data in the caches; a model's layers each bring their own). (One op does
  not stand for all: on this CPU a small GELU's forward takes 13 us, a mul's 1.6 us, a view's 1-4 us; and a fitted
  intercept under large sizes is mostly their noise.)

Sizes are small on a CPU and large on a GPU (CUDA events time the kernels there); the fit is least squares on
the median of `repeats` timings of each size.

>>> fit_affine([(1e6, 1e-5 + 1e6 / 1e9), (1e7, 1e-5 + 1e7 / 1e9), (1e8, 1e-5 + 1e8 / 1e9)])  # 10 us + 1 GB/s
(1e-05, 1000000000.0)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from autoshard.cost.kernel_timing import DEPTH, chain_step, leaf, median_seconds, timer
from autoshard.cost.op_overheads import (
    median_fixed_costs,
    op_overheads,
    split_backward_factor,
    view_overheads,
)
from autoshard.cost.profiles import HardwareProfile
from autoshard.cost.sequence_scale import STACK_REPEATS, sequence_scales, work_scale

# (m, n, k) of the matmuls, (batch, heads, sequence, head dim) of attention, elements of the memory-bound op
CPU_SIZES = {"matmul": [(64, 64, 64), (128, 256, 256), (256, 512, 512), (512, 1024, 512)],
             "attention": [(1, 2, 64, 32), (2, 4, 128, 32), (2, 4, 256, 64)],
             "elementwise": [2**10, 2**14, 2**17, 2**20]}
GPU_SIZES = {"matmul": [(1024, 1024, 1024), (2048, 4096, 4096), (4096, 8192, 4096), (8192, 8192, 8192)],
             "attention": [(1, 16, 1024, 128), (2, 16, 2048, 128), (2, 32, 4096, 128)],
             "elementwise": [2**16, 2**22, 2**26, 2**28]}
# (tensors, elements each) the optimizers update: many small (the cost per tensor), a few large (the bytes' rate)
CPU_UPDATES, GPU_UPDATES = [(64, 2**10), (8, 2**20)], [(64, 2**12), (8, 2**24)]
OPTIMIZERS = ((0.0, torch.optim.SGD), (2.0, torch.optim.AdamW))  # by optimizer state factor: none, two moments


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
    optimizer_updates: tuple = ()  # (state factor, seconds per tensor, bytes/s): HardwareProfile.optimizer_updates

    def scaled(self, forward: float, backward: float) -> ComputeRates:
        """These rates with every fixed cost of a forward times `forward` and of a backward times `backward`.

        >>> ComputeRates({"float32": 2e10}, 1e10, 5e9, 2e-5, 3e-5).scaled(2.0, 0.5).grad_op_overhead_s
        1.5e-05
        """
        return dataclasses.replace(
            self, op_overhead_s=self.op_overhead_s * forward, recorded_op_overhead_s=self.recorded_op_overhead_s *
            forward, view_overhead_s=self.view_overhead_s * forward, grad_op_overhead_s=self.grad_op_overhead_s *
            backward, view_grad_overhead_s=self.view_grad_overhead_s * backward,
            op_overheads=tuple((name, f * forward, r * forward, b * backward) for name, f, r, b in self.op_overheads),
            optimizer_updates=tuple((f, per_tensor * forward, rate) for f, per_tensor, rate in self.optimizer_updates))

    def work_scaled(self, factor: float) -> ComputeRates:
        """These rates with every kernel's work taking `factor` times as long (its fixed cost unchanged).

        >>> ComputeRates({"float32": 2e10}, 1e10, 5e9, 2e-5).work_scaled(2.0).matmul_flops
        {'float32': 10000000000.0}
        """
        return dataclasses.replace(self, matmul_flops={k: v / factor for k, v in self.matmul_flops.items()},
                                   attention_flops=self.attention_flops / factor,
                                   memory_bandwidth=self.memory_bandwidth / factor,
                                   optimizer_updates=tuple((f, t, rate / factor)
                                                           for f, t, rate in self.optimizer_updates))

    def profile(self):
        """A HardwareProfile with these rates (float32's matmul rate as its peak) and the default's other figures.

        >>> ComputeRates({"float32": 2e10}, 1e10, 5e9, 2e-5).profile().matmul_flops("float32")
        20000000000.0
        """
        fields = self.to_json()
        fields["dtype_flops"] = tuple((name, rate) for name, rate in fields["dtype_flops"])
        fields["op_overheads"] = self.op_overheads
        fields["optimizer_updates"] = self.optimizer_updates
        peak = self.matmul_flops.get("float32", max(self.matmul_flops.values()))
        return HardwareProfile(peak_flops=peak, **fields)

    def to_json(self) -> dict:
        """The rates as a JSON object (the HardwareProfile fields they become).

        >>> sorted(ComputeRates({"float32": 2e10}, 1e10, 5e9, 2e-5).to_json())[2:]
        ['grad_op_overhead_s', 'memory_bandwidth', 'op_overhead_s', 'op_overheads', 'optimizer_updates', 'recorded_op_overhead_s', 'split_backward_factor', 'view_grad_overhead_s', 'view_overhead_s']
        """
        return {"dtype_flops": sorted([name, rate] for name, rate in self.matmul_flops.items()),
                "attention_flops": self.attention_flops, "memory_bandwidth": self.memory_bandwidth,
                "op_overhead_s": self.op_overhead_s, "grad_op_overhead_s": self.grad_op_overhead_s,
                "recorded_op_overhead_s": self.recorded_op_overhead_s, "view_overhead_s": self.view_overhead_s,
                "view_grad_overhead_s": self.view_grad_overhead_s,
                "op_overheads": [list(row) for row in self.op_overheads],
                "split_backward_factor": self.split_backward_factor,
                "optimizer_updates": [list(row) for row in self.optimizer_updates]}


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


def _per_op(samples_of_steps) -> tuple[float, float]:
    """The fit of [(work of one op, seconds of a DEPTH-op step)] per op."""
    return fit_affine([(work, seconds / DEPTH) for work, seconds in samples_of_steps])


def matmul_rate(dtype: torch.dtype, device: torch.device, sizes, repeats: int) -> tuple[float, float]:
    """(overhead s, FLOP/s) of linear's forward + backward in `dtype` (work: 3 x 2mnk; n = k, chained).

    >>> overhead, rate = matmul_rate(torch.float32, torch.device("cpu"), [(16, 16, 16), (64, 64, 64)], 3)
    >>> rate > 0
    True
    """
    timed, samples = timer(device), []
    for m, n, _ in sizes:
        x, w = leaf((m, n), dtype, device), leaf((n, n), dtype, device)
        step = chain_step(lambda y, w=w: F.linear(y, w), x, [x, w])
        samples.append((3 * 2.0 * m * n * n, median_seconds(step, timed, repeats)))
    return _per_op(samples)


def attention_rate(dtype: torch.dtype, device: torch.device, sizes, repeats: int) -> tuple[float, float]:
    """(overhead s, FLOP/s) of causal scaled_dot_product_attention's forward + backward (work: 3 x 4 b h s^2 d,
    what `flops.node_flops` counts).

    >>> attention_rate(torch.float32, torch.device("cpu"), [(1, 1, 8, 8), (1, 2, 16, 8)], 3)[1] > 0
    True
    """
    timed, samples = timer(device), []
    for b, h, s, d in sizes:
        q, k, v = (leaf((b, h, s, d), dtype, device) for _ in range(3))
        step = chain_step(lambda y, k=k, v=v: F.scaled_dot_product_attention(y, k, v, is_causal=True), q, [q, k, v])
        samples.append((3 * 4.0 * b * h * s * s * d, median_seconds(step, timed, repeats)))
    return _per_op(samples)


def elementwise_rate(dtype: torch.dtype, device: torch.device, sizes, repeats: int) -> tuple[float, float]:
    """(overhead s, bytes/s) of GELU's forward + backward (work: 3 x its output bytes).

    >>> elementwise_rate(torch.float32, torch.device("cpu"), [256, 4096], 3)[1] > 0
    True
    """
    timed, samples = timer(device), []
    for n in sizes:
        x = leaf((n,), dtype, device)
        step = chain_step(F.gelu, x, [x])
        samples.append((3.0 * n * x.element_size(), median_seconds(step, timed, repeats)))
    return _per_op(samples)


def optimizer_updates(dtype: torch.dtype, device: torch.device, counts, repeats: int) -> tuple:
    """((state factor, seconds per tensor, bytes/s), ...) of torch's SGD (factor 0) and AdamW (2) stepping `counts`
    ([(tensors, elements each)]) parameters with gradients, then `zero_grad` as a training loop does: seconds =
    tensors x per tensor + (3 + 2 factor) x parameter bytes / rate, fitted (what `zero_cost.optimizer_step_time`
    prices; after a real backward the update runs about 1.4x slower here, its gradients no longer in the caches).

    >>> [row[0] for row in optimizer_updates(torch.float32, torch.device("cpu"), [(8, 16), (2, 4096)], 3)]
    [0.0, 2.0]
    """
    timed, out = timer(device), []
    for factor, make in OPTIMIZERS:
        samples = []
        for tensors, numel in counts:
            params = [torch.nn.Parameter(torch.randn(numel, dtype=dtype, device=device)) for _ in range(tensors)]
            grads = [torch.randn_like(p) for p in params]
            optimizer = make(params, lr=1e-3)

            def step(params=params, grads=grads, optimizer=optimizer):  # a loop's update and zero_grad
                for p, g in zip(params, grads):
                    p.grad = g
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            samples.append((tensors, (3 + 2 * factor) * tensors * numel * params[0].element_size(),
                            median_seconds(step, timed, repeats)))
        # the two sizes' equations solved: the small tensors' leave the cost per tensor, the large ones' the rate
        (n_small, b_small, t_small), (n_large, b_large, t_large) = sorted(samples, key=lambda s: s[1])
        ratio = n_large / n_small
        per_byte = max((t_large - t_small * ratio) / (b_large - b_small * ratio), 1e-15) \
            if b_large != b_small * ratio else t_large / b_large
        out.append((factor, max((t_small - b_small * per_byte) / n_small, 0.0), 1.0 / per_byte))
    return tuple(out)


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
    per_op = op_overheads(first, device, repeats)
    forward, recorded, backward = median_fixed_costs(per_op.values())
    rates = ComputeRates(matmul, attention, bandwidth, forward, backward, recorded, views[1], views[2],
                         tuple(sorted((name, *costs) for name, costs in per_op.items())),
                         split_backward_factor(first, device, max(repeats, STACK_REPEATS)))
    rates = rates.scaled(*sequence_scales(device, first, rates, max(repeats, STACK_REPEATS)))
    rates = rates.work_scaled(work_scale(device, first, rates))  # a model's kernels; an update is timed as it runs
    counts = sizes.get("updates") or (GPU_UPDATES if device.type == "cuda" else CPU_UPDATES)
    return dataclasses.replace(rates, optimizer_updates=optimizer_updates(first, device, counts, repeats))
