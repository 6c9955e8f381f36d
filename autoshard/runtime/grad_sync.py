"""Gradient sync: partial gradients reduced on exactly their partial axes, in buckets, after or during backward.

The layout is the same either way: parameters grouped by the axes their gradient is partial on, in the
reverse of the module's parameter order (backward produces the last layers' gradients first; DDP's order
too), cut in buckets of one dtype up to BUCKET_BYTES; a bucket is flattened and all-reduced on each of its
axes in turn. `reduce_buckets` runs them after backward (`overlap=False`).
`OverlappedSync` (the default from the second step on, as DDP does) starts each bucket's reduction while
backward still runs: a post-accumulate-grad hook counts the bucket's gradients, and when all have arrived
the bucket is flattened and its first axis's reduction started (`Communicator.start_all_reduce`: gloo's
async_op on real ranks; the simulator completes it at once). Buckets start in the layout's order only, the
same on every rank; `finish` (in `sync_grads`) starts what backward did not, waits, runs the remaining axes and makes the gradients views of
the reduced buckets (no copy back, as DDP's gradient_as_bucket_view). Each bucket is reduced exactly as
after backward, so the gradients are bitwise the same.

The layout is learnt in the first `sync_grads` (which reduces after backward) and checked in each later one:
a different set of parameters with gradients (one unused this step, say) waits for the reductions in flight,
drops them and reduces after backward again. A bucket whose gradients change after it started (a second
backward before `sync_grads`: gradient accumulation) is reduced again from the final gradients; wrap every
pass but the last in `module.no_sync()` so that nothing is sent twice.

The examples sync the gradients of a data-parallel MLP on two simulated ranks:

>>> import torch
>>> import autoshard
>>> from autoshard.runtime.simulator import run_ranks
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
...                              hints={"input:0": {"dp": "S(0)"}})
>>> def backward(module):
...     module(*module.local_inputs(*inputs))[0].backward()
...     return module
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

BUCKET_BYTES = 25 << 20


def buckets(entries, tensor_of):
    """Runs of entries whose tensors share a dtype, up to BUCKET_BYTES each (same order on every rank).

    >>> tensors = [torch.zeros(2), torch.zeros(3), torch.zeros(1, dtype=torch.float64)]
    >>> [[t.numel() for t in bucket] for bucket in buckets(tensors, lambda t: t)]
    [[2, 3], [1]]
    """
    bucket, size = [], 0
    for e in entries:
        t = tensor_of(e)
        nbytes = t.numel() * t.element_size()
        if bucket and (size + nbytes > BUCKET_BYTES or t.dtype != tensor_of(bucket[0]).dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(e)
        size += nbytes
    if bucket:
        yield bucket


class SizedTensor:
    """What `buckets` reads of a tensor (its bytes and dtype), for laying out tensors that do not exist: the cost
    model's predicted gradients and buffers.

    >>> [[t.nbytes for t in bucket] for bucket in buckets([SizedTensor(BUCKET_BYTES, torch.float32)] * 2, lambda t: t)]
    [[26214400], [26214400]]
    """

    def __init__(self, nbytes: int, dtype: torch.dtype):
        self.nbytes, self.dtype = nbytes, dtype

    def numel(self) -> int:
        """Its bytes (`element_size` is 1).

        >>> SizedTensor(8, torch.float32).numel()
        8
        """
        return self.nbytes

    def element_size(self) -> int:
        """1: `numel` counts bytes.

        >>> SizedTensor(8, torch.float32).element_size()
        1
        """
        return 1


@dataclass(frozen=True)
class Bucket:
    """Parameters whose gradients are reduced together on `axes` (one flat tensor, one dtype).

    >>> layout = run_ranks(prog, lambda module: grad_buckets(backward(module)))[0]
    >>> [(b.axes, len(b.params)) for b in layout]
    [(('dp',), 4)]
    """

    axes: tuple
    params: tuple

    def start(self, comm):
        """Flatten the gradients and start the reduction on the first axis (the others follow in `wait`).

        >>> grads = run_ranks(prog, lambda module: grad_buckets(backward(module))[0].start(module.comm).wait())
        >>> grads[0].shape, torch.equal(grads[0], grads[1])
        (torch.Size([8352]), True)
        """
        flat = torch.cat([p.grad.reshape(-1) for p in self.params])
        for axis in self.axes:
            comm.log.record(axis, "all_reduce", flat.numel() * flat.element_size(), "sync", flat.dtype)
        pending = comm.start_all_reduce(flat, self.axes[0])
        for axis in self.axes[1:]:
            pending = pending.then(lambda t, axis=axis: comm.all_reduce(t, axis))
        return pending

    def finish(self, flat: torch.Tensor, views: bool = False) -> None:
        """Write the reduced `flat` into the parameters' gradients; with `views` make the gradients views of it
        instead (no copy back, DDP's gradient_as_bucket_view): bitwise the same values.

        >>> def reduce(module, views):
        ...     bucket = grad_buckets(backward(module))[0]
        ...     flat = bucket.start(module.comm).wait()
        ...     bucket.finish(flat, views)
        ...     return bucket.params[0].grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        >>> run_ranks(prog, lambda module: (reduce(module, False), reduce(module, True)))[0]
        (False, True)
        """
        for p, piece in zip(self.params, self._pieces(flat)):
            if views:
                p.grad = piece
            else:
                p.grad.copy_(piece)

    def _pieces(self, flat):
        offset = 0
        for p in self.params:
            n = p.grad.numel()
            yield flat[offset:offset + n].view_as(p.grad)
            offset += n


def grad_buckets(module, skip_axis: dict | None = None) -> list[Bucket]:
    """The buckets of `module`'s partial gradients now (parameters without a gradient left out); `skip_axis`
    maps parameters to an axis reduced elsewhere (ZeRO's reduce-scatter).

    >>> [len(b.params) for b in run_ranks(prog, lambda module: grad_buckets(backward(module)))[1]]
    [4]
    """
    skip_axis = skip_axis or {}
    groups: dict = {}
    for fqn, param in reversed(list(module.named_local_parameters())):
        axes = tuple(a for a in module.rank_program.grad_reduce.get(fqn, ()) if a != skip_axis.get(fqn))
        if axes and param.grad is not None:
            groups.setdefault(axes, []).append(param)
    return [Bucket(axes, tuple(bucket)) for axes, params in groups.items()
            for bucket in buckets(params, lambda p: p.grad)]


def reduce_buckets(layout: list, comm) -> None:
    """Reduce every bucket now, one after the other (the sync after backward). A bucket is anything with
    `params`, `start(comm)` and `finish(result)`: a Bucket, or ZeRO's (autoshard/runtime/zero.py).

    >>> def sync(module):
    ...     reduce_buckets(grad_buckets(backward(module)), module.comm)
    ...     return module.gm.layers_0_bias.grad
    >>> grads = run_ranks(prog, sync)
    >>> torch.equal(grads[0], grads[1])
    True
    """
    for bucket in layout:
        bucket.finish(bucket.start(comm).wait())


class OverlappedSync:
    """Buckets of `layout` reduced as backward produces their gradients (see the module docstring); `armed`
    says whether the current backward should start them (`RankModule.no_sync` disarms it).

    >>> def overlapped(module):
    ...     sync = OverlappedSync(grad_buckets(backward(module)), module.comm)
    ...     module.zero_grad()
    ...     backward(module)  # the hooks start the bucket during this backward
    ...     started = sync.pending[0] is not None
    ...     sync.finish()
    ...     sync.close()
    ...     return started, module.gm.layers_0_bias.grad
    >>> result = run_ranks(prog, overlapped)
    >>> result[0][0], torch.equal(result[0][1], result[1][1])
    (True, True)
    """

    def __init__(self, layout: list, comm, late=frozenset()):
        self.layout, self.comm = layout, comm
        # Buckets holding a parameter whose gradient arrives only after backward (`late`: ZeRO-3's deferred
        # reduce-scatters put the shard there in sync_grads) start in `finish`, on every rank alike.
        self.late = [any(id(p) in late for p in b.params) for b in layout]
        self.bucket_of = {id(p): i for i, b in enumerate(layout) for p in b.params}
        # The hooks hold this object weakly: a strong reference from a parameter back to the object that holds the
        # parameters is a cycle through autograd's C++ hooks, which Python's GC cannot see, so the module, its
        # communicator and its process groups would live until the interpreter exits (and a gloo worker thread
        # still releasing its last collective then aborts the process).
        arrived = weakref.WeakMethod(self._arrived)
        self.handles = [p.register_post_accumulate_grad_hook(lambda param: _call_alive(arrived, param))
                        for b, is_late in zip(layout, self.late) if not is_late for p in b.params]
        weakref.finalize(self, _remove_hooks, self.handles)
        self.armed = True
        self._reset()

    def _reset(self):
        n = len(self.layout)
        self.arrived, self.pending, self.stale, self.next = [0] * n, [None] * n, [False] * n, 0

    def matches(self, layout: list) -> bool:
        """Whether `layout` (this step's) is the one the hooks watch.

        >>> def same(module):
        ...     layout = grad_buckets(backward(module))
        ...     sync = OverlappedSync(layout, module.comm)
        ...     sync.close()
        ...     return sync.matches(grad_buckets(module)), sync.matches(layout[:0])
        >>> run_ranks(prog, same)[0]
        (True, False)
        """
        return len(layout) == len(self.layout) and all(
            a.axes == b.axes and len(a.params) == len(b.params) and all(p is q for p, q in zip(a.params, b.params))
            for a, b in zip(layout, self.layout))

    def _arrived(self, param) -> None:
        if not self.armed:
            return
        i = self.bucket_of[id(param)]
        if self.arrived[i] == len(self.layout[i].params):
            self.stale[i] = True  # a later backward changed a gradient after the bucket was complete
            return
        self.arrived[i] += 1
        while self.next < len(self.layout):  # start complete buckets in the layout's order only
            j = self.next
            if self.late[j]:
                self.next += 1
                continue
            if self.arrived[j] < len(self.layout[j].params):
                break
            if not self.stale[j]:  # a stale one is reduced from its final gradients in finish
                self.pending[j] = self.layout[j].start(self.comm)
            self.next += 1

    def finish(self) -> None:
        """Start the buckets backward did not (in the same order), re-reduce stale ones, wait, adopt the results.

        >>> def sync_twice(module):  # gradient accumulation without no_sync: correct, sent twice
        ...     sync = OverlappedSync(grad_buckets(backward(module)), module.comm)
        ...     module.zero_grad()
        ...     backward(backward(module))
        ...     sync.finish()
        ...     sync.close()
        ...     return module.comm.log.summary()["dp"]["all_reduce"]["sync"]
        >>> run_ranks(prog, sync_twice)[0]
        2
        """
        for j in range(len(self.layout)):
            if self.pending[j] is not None and self.stale[j]:
                self.pending[j].wait()
                self.pending[j] = None
            if self.pending[j] is None:
                self.pending[j] = self.layout[j].start(self.comm)
        for j in range(len(self.layout)):
            self.layout[j].finish(self.pending[j].wait(), views=True)
        self._reset()

    def close(self) -> None:
        """Wait for the reductions in flight (their results are dropped) and remove the hooks.

        >>> def closed(module):
        ...     sync = OverlappedSync(grad_buckets(backward(module)), module.comm)
        ...     sync.close()
        ...     return sync.handles
        >>> run_ranks(prog, closed)[0]
        []
        """
        for pending in self.pending:
            if pending is not None:
                pending.wait()
        _remove_hooks(self.handles)
        self._reset()


def _call_alive(method: weakref.WeakMethod, param) -> None:
    bound = method()
    if bound is not None:
        bound(param)


def _remove_hooks(handles: list) -> None:
    while handles:
        handles.pop().remove()
