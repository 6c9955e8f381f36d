"""Timing small kernels as training runs them (`compute_rates`, `op_overheads`, `sequence_scale`): a timer per
device (CUDA events on a GPU, the wall clock on a CPU), the median of repeated calls, and chains of one op.
"""
from __future__ import annotations

import statistics
import time

import torch


def timer(device: torch.device):
    """A function timing `fn()` on `device`, in seconds: CUDA events there, the wall clock on a CPU.

    >>> timer(torch.device("cpu"))(lambda: None) >= 0
    True
    """
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


def median_seconds(fn, timed, repeats: int) -> float:
    """The median of `repeats` timings (`timed`, a `timer`) of `fn()` after one untimed call (the allocator, kernel
    selection).

    >>> median_seconds(lambda: None, timer(torch.device("cpu")), 3) >= 0
    True
    """
    fn()  # warm up (allocator, kernel selection)
    return statistics.median(timed(fn) for _ in range(repeats))


DEPTH = 8  # ops chained in one forward + backward: one autograd engine start is shared by them, as in a model


def chain_step(op, first, leaves, mode: str = "train", depth: int = DEPTH):
    """A step running `op` `depth` times (DEPTH unless given), each on the last one's output: forward and backward (`mode` "train"), the
    forward alone with autograd recording it ("forward"), or without autograd ("no_grad").

    >>> x = leaf((2, 2), torch.float32, torch.device("cpu"))
    >>> chain_step(torch.tanh, x, [x])()  # forward and backward; the leaves' gradients cleared after
    """
    def step():
        with torch.set_grad_enabled(mode != "no_grad"):
            out = first
            for _ in range(depth):
                out = op(out)
        if mode == "train":
            out.backward(torch.ones_like(out))
            for leaf in leaves:
                leaf.grad = None
    return step


def leaf(shape, dtype, device):
    """A random leaf tensor that requires a gradient, scaled by its last dim (chained matmuls stay bounded).

    >>> leaf((2, 3), torch.float32, torch.device("cpu")).requires_grad
    True
    """
    return (torch.randn(shape, dtype=dtype, device=device) / shape[-1] ** 0.5).requires_grad_()
