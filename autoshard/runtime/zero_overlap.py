"""ZeRO-3 overlap: parameter all-gathers prefetched one layer ahead, gradient reduce-scatters started in
backward and finished in `sync_grads` (FSDP2's two overlaps).

`Zero3Overlap` sits behind `ParamAllGather` while the rank module runs forward (`zero_gather.overlapping`):
- gathers: the calls of the last forward are remembered (parameter, axis, dim, dtype) with the layer of each
  parameter (its name up to the first numbered module: `layers.3`); at call i the gathers of the rest of
  i's layer and of the next layer are started, one collective for all of them (`start_gathers`), so that
  they travel while this layer computes; call i then only waits for its own. A call that differs from what was started
  (another forward) drops the prefetch and gathers now. The same calls are started on every rank.
- re-gathers in backward: the order in which the last backward re-gathered parameters is remembered; each
  re-gather starts those up to the end of the next layer in that order (one layer ahead in backward).
- gradients: the reduce-scatter of a parameter's partial gradient is started in backward, one collective
  per layer (`start_reduce_scatters`, when backward moves on to the next layer), at most
  REDUCE_SCATTERS_IN_FLIGHT layers' at once (the oldest is then waited for and only its shards kept), and the
  shards reach `param.grad` in `finish` (called first in `sync_grads`), summed per backward pass in arrival order
  and added to the gradient already there exactly as autograd would. Only parameters used by nothing but
  their gathers are deferred so (another use would reach the gradient through autograd in between).
With `module.overlap = False` nothing is prefetched and the same per-layer reduce-scatters start in
`finish`, after backward: bitwise the same gradients as overlapped, also on native collectives whose sums
depend on the layout (gloo's and NCCL's), and on the exact path bitwise what one reduce-scatter per
parameter gives.

The examples train a ZeRO-3 data-parallel MLP on two simulated ranks with and without overlap:

>>> import torch
>>> import autoshard
>>> from autoshard.runtime.simulator import run_ranks
>>> from autoshard.runtime.zero import ZeroOptimizer
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=3)
>>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
...                              hints={"input:0": {"dp": "S(0)"}}, zero=3)
>>> def train(module, overlap=True):
...     module.overlap = overlap
...     opt = ZeroOptimizer(module, torch.optim.SGD(module.parameters(), lr=0.1))
...     for _ in range(2):
...         module(*module.local_inputs(*inputs))[0].backward()
...         module.sync_grads()
...         opt.step()
...         opt.zero_grad()
...     return module
"""
from __future__ import annotations

import torch

from autoshard.runtime.collectives import param_all_gather
from autoshard.runtime.zero_gather import compact


def layer_of(fqn: str) -> str:
    """The layer a parameter belongs to: its name up to the first numbered module, else its module.

    >>> layer_of("layers.3.attn.q.weight"), layer_of("embed.weight"), layer_of("bias")
    ('layers.3', 'embed', '')
    """
    parts = fqn.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return ".".join(parts[:-1])


def _same(a, b) -> bool:
    return a[0] is b[0] and a[1:] == b[1:]


def horizons(layers: list) -> list:
    """For each position of a sequence of calls, the last position of the next layer's run (of the own run
    for the last layer): how far ahead the gathers are started.

    >>> horizons(["a", "a", "b", "c", "c"])
    [2, 2, 4, 4, 4]
    """
    ends, end = [0] * len(layers), len(layers) - 1
    for i in reversed(range(len(layers))):  # the last call of each run of one layer
        if i < len(layers) - 1 and layers[i] != layers[i + 1]:
            end = i
        ends[i] = end
    return [ends[ends[i] + 1] if ends[i] + 1 < len(layers) else ends[i] for i in range(len(layers))]


class _Coalesced:
    """One started all-gather carrying several flattened shards; waited for once."""

    def __init__(self, pending):
        self.pending, self.parts = pending, None

    def result(self) -> list:
        if self.parts is None:
            self.parts = self.pending.wait()
        return self.parts


class _Piece:
    """One shard's gather inside a coalesced one: `wait()` gives what `comm.all_gather` would."""

    __slots__ = ("dim", "group", "numel", "offset", "shape")

    def __init__(self, group, offset, shard, dim):
        self.group, self.offset, self.numel, self.shape, self.dim = group, offset, shard.numel(), shard.shape, dim

    def wait(self) -> torch.Tensor:
        parts = self.group.result()
        return torch.cat([p[self.offset:self.offset + self.numel].view(self.shape) for p in parts], self.dim)


def start_gathers(comm, shards: list) -> list:
    """Start the all-gathers of `shards` ([(tensor, axis, dim)]) as one collective per axis and dtype (a
    layer's parameters travel together, as FSDP's flat parameter does); each item's `wait()` gives what
    `comm.all_gather(tensor, axis, dim)` gives (the same bytes moved: bitwise equal).

    >>> from autoshard.ir.mesh import Mesh
    >>> from autoshard.runtime.simulator import run_on_mesh
    >>> def both(comm):
    ...     a, b = torch.ones(2, 2) * comm.rank, torch.arange(3.0) + comm.rank
    ...     return [p.wait() for p in start_gathers(comm, [(a, "dp", 1), (b, "dp", 0)])]
    >>> run_on_mesh(Mesh((2,), ("dp",)), both)[0]
    [tensor([[0., 0., 1., 1.],
            [0., 0., 1., 1.]]), tensor([0., 1., 2., 1., 2., 3.])]
    """
    groups: dict = {}
    for i, (t, axis, _) in enumerate(shards):
        groups.setdefault((axis, t.dtype, t.device), []).append(i)
    out = [None] * len(shards)
    for (axis, _, _), members in groups.items():
        flat = torch.cat([shards[i][0].reshape(-1) for i in members])
        group, offset = _Coalesced(comm.start_all_gather_list(flat, axis, "all_gather")), 0
        for i in members:
            out[i] = _Piece(group, offset, shards[i][0], shards[i][2])
            offset += shards[i][0].numel()
    return out


class _Row:
    """One gradient's reduce-scattered chunk inside a coalesced reduce-scatter of [k, chunks] rows."""

    __slots__ = ("group", "numel", "offset", "shape")

    def __init__(self, group, offset, shape, numel):
        self.group, self.offset, self.shape, self.numel = group, offset, shape, numel

    def wait(self) -> torch.Tensor:
        return self.group.result().reshape(-1)[self.offset:self.offset + self.numel].view(self.shape).clone()


def start_reduce_scatters(comm, grads: list) -> list:
    """Start the reduce-scatters of `grads` ([(tensor, axis, dim)], one axis and dtype) as one collective: row
    r holds every gradient's chunk r, as ZeRO's buckets lay them out; each item's `wait()` gives what
    `comm.reduce_scatter(tensor, axis, dim)` gives (the same sums: bitwise equal on the exact path).

    >>> from autoshard.ir.mesh import Mesh
    >>> from autoshard.runtime.simulator import run_on_mesh
    >>> def both(comm):
    ...     a, b = torch.arange(4.0).view(2, 2) * (comm.rank + 1), torch.arange(2.0) + comm.rank
    ...     return [p.wait() for p in start_reduce_scatters(comm, [(a, "dp", 1), (b, "dp", 0)])]
    >>> run_on_mesh(Mesh((2,), ("dp",)), both)[1]  # rank 1: column 1 of 3a, element 1 of 2b + 1
    [tensor([[3.],
            [9.]]), tensor([3.])]
    """
    axis = grads[0][1]
    k = comm.axis_size(axis)
    chunks = [g.chunk(k, dim) for g, _, dim in grads]
    rows = torch.cat([torch.stack([c.reshape(-1) for c in pieces]) for pieces in chunks], dim=1)
    group, offset, out = _Coalesced(comm.start_reduce_scatter(rows, axis, 0)), 0, []
    for pieces in chunks:
        out.append(_Row(group, offset, pieces[0].shape, pieces[0].numel()))
        offset += pieces[0].numel()
    return out


class _Started:
    """A layer's reduce-scatters, started: [(parameter, its started chunk)]."""

    __slots__ = ("items",)

    def __init__(self, items):
        self.items = items

    def settle(self) -> None:
        """Wait for the collectives and keep only this rank's shards: the layer's gradient rows and the buffers
        the reduce-scatter gathered are freed now, not at `finish`."""
        self.items = [(param, _Settled(compact(started.wait()))) for param, started in self.items]


class _Settled:
    """A reduce-scatter waited for: its shard."""

    __slots__ = ("shard",)

    def __init__(self, shard):
        self.shard = shard

    def wait(self) -> torch.Tensor:
        return self.shard


# Layers whose reduce-scatters may be in flight at once: backward computes the next layer while the last one's
# travels (FSDP2 bounds them likewise). Each holds the layer's gradient rows and, on the exact path, every rank's
# copy of them: left in flight until `sync_grads`, all layers' would be alive at once (the unsharded gradient of
# the whole model, (1 + k) times over on gloo).
REDUCE_SCATTERS_IN_FLIGHT = 2


def _start_group(waiting) -> _Started:
    """One collective for the gradients that split evenly over the axis, one each for the others."""
    even = [w for w in waiting if w[1].shape[w[3]] % w[4].axis_size(w[2]) == 0]
    items = []
    if even:
        rows = start_reduce_scatters(even[0][4], [(g, axis, dim) for _, g, axis, dim, _ in even])
        items += [(w[0], row) for w, row in zip(even, rows)]
    items += [(p, comm.start_reduce_scatter(g, axis, dim)) for p, g, axis, dim, comm in waiting
              if g.shape[dim] % comm.axis_size(axis)]
    return _Started(items)


class Zero3Overlap:
    """One rank module's ZeRO-3 prefetches and deferred reduce-scatters (see the module docstring).

    >>> overlap = run_ranks(prog, lambda module: train(module)._zero3)[0]
    >>> len(overlap.previous), overlap.horizon  # 6 gathers; at call i, gather up to the next layer's end
    (6, [3, 3, 5, 5, 5, 5])
    """

    def __init__(self, module):
        names = {attr: fqn for fqn, attr in module.rank_program.attr_names.items()}
        params = dict(module.named_local_parameters())
        self.layer = {id(p): layer_of(fqn) for fqn, p in params.items()}
        self.deferrable = set()
        for node in module.gm.graph.nodes:
            if node.op == "get_attr" and node.users and all(u.target is param_all_gather for u in node.users):
                param = params.get(names.get(node.target))
                if param is not None:
                    self.deferrable.add(id(param))
        self.previous: list = []  # the last forward's gathers: (parameter, axis, dim, dtype)
        self.horizon: list = []  # per call: the last call whose gather is started by then
        self.current: list = []
        self.prefetched: dict = {}  # call index -> (call, its started gather)
        self.handles: list = []  # this forward's re-gather handles, by call
        self.passes: list = []  # deferred reduce-scatters per backward pass: [(parameter, started)]
        self.waiting: list = []  # gradients of the layer backward is in, not grouped yet
        self.overlap = True  # False: nothing prefetched, the reduce-scatters start in finish (after backward)
        self.waiting_key = None
        self.pass_open = False
        self.regather_order: list = []  # call indices in the order the last backward re-gathered them
        self.backward_horizon: list = []
        self.position: dict = {}  # call index -> its position in regather_order
        self.order_now: list = []
        self.started: list = []  # handles whose re-gather was started ahead
        self.in_flight: list = []  # started reduce-scatter groups not waited for yet, oldest first

    def gather(self, x, shard, comm, axis, dim, dtype):
        """`x`'s gathered value (shard `shard`): the prefetched one when this call was started earlier, then
        start the gathers up to the end of the next layer.

        >>> module = run_ranks(prog, train)[0]  # the second forward used prefetched gathers
        >>> module._zero3.prefetched  # each was waited for
        {}
        """
        i = len(self.current)
        call = (x, axis, dim, dtype)
        self.current.append(call)
        entry = self.prefetched.pop(i, None)
        if entry is not None and _same(entry[0], call):
            out = entry[1].wait()
        else:
            if entry is not None:
                entry[1].wait()  # this forward differs from the last: the prefetch is dropped
            out = comm.all_gather(shard, axis, dim)
        ahead = [j for j in range(i + 1, self.horizon[i] + 1 if self.overlap and i < len(self.horizon) else 0)
                 if j not in self.prefetched]
        values = [(c[0].detach() if c[3] is None else c[0].detach().to(c[3]), c[1], c[2])
                  for c in (self.previous[j] for j in ahead)]
        for j, piece in zip(ahead, start_gathers(comm, values)):
            self.prefetched[j] = (self.previous[j], piece)
        return out

    def track(self, handle, x) -> None:
        """Make `handle` (the re-gather handle of the gather of `x` just made) part of this forward's calls.

        >>> module = run_ranks(prog, train)[0]
        >>> [h.index for h in module._zero3.handles]  # cleared at the end of each forward
        []
        """
        handle.overlap, handle.siblings, handle.index = self, self.handles, len(self.handles)
        self.handles.append(handle)

    def regathered(self, handle) -> None:
        """Backward re-gathered `handle`'s parameter: start the re-gathers the last backward made next, up to
        the end of the next layer.

        >>> overlap = run_ranks(prog, lambda module: train(module)._zero3)[0]
        >>> overlap.regather_order, overlap.backward_horizon  # weights whose input needs a gradient, last first
        ([4, 2], [1, 1])
        """
        self._open_pass()
        self.order_now.append(handle.index)
        pos = self.position.get(handle.index) if self.overlap and self.regather_order else None
        if pos is None:
            return
        ahead = [handle.siblings[index] for index in self.regather_order[pos + 1:self.backward_horizon[pos] + 1]
                 if index < len(handle.siblings)]
        ahead = [h for h in ahead if h.full is None and h.pending is None]
        for h, piece in zip(ahead, start_gathers(handle.comm, [(h.shard, h.axis, h.dim) for h in ahead])):
            h.pending = piece
            self.started.append(h)

    def end_forward(self) -> None:
        """Drop what was started but not used, and remember this forward's gathers for the next.

        >>> module = run_ranks(prog, train)[1]
        >>> [layer_of(n) for n, p in module.named_local_parameters()][:3]
        ['layers.0', 'layers.0', 'layers.1']
        """
        for j in sorted(self.prefetched):
            self.prefetched[j][1].wait()
        self.prefetched.clear()
        self.previous, self.current, self.handles = self.current, [], []
        self.horizon = horizons([self.layer.get(id(call[0])) for call in self.previous])

    def defer(self, param, grad, comm, axis, dim) -> bool:
        """Start the reduce-scatter of `param`'s partial gradient `grad`; False when `param` must take its
        gradient through autograd (another use besides its gathers).

        >>> run_ranks(prog, lambda module: train(module)._zero3.deferrable == {id(p) for p in module.parameters()})[0]
        True
        """
        if id(param) not in self.deferrable:
            return False
        self._open_pass()
        key = (self.layer.get(id(param)), axis, grad.dtype)
        if self.waiting and key != self.waiting_key:  # a layer's gradients are reduce-scattered together
            self._flush()
        self.waiting.append((param, grad, axis, dim, comm))
        self.waiting_key = key
        return True

    def _flush(self) -> None:
        """Close the waiting gradients' group (a layer's) and, when overlapping, start it now."""
        if self.waiting:
            self.passes[-1].append(self.waiting if not self.overlap else self._start(self.waiting))
            self.waiting = []

    def _start(self, waiting) -> _Started:
        """Start a group's reduce-scatters, then settle the oldest in flight beyond REDUCE_SCATTERS_IN_FLIGHT
        (every rank starts and waits for the groups in the same order). After backward, before `sync_grads`:

        >>> def unsettled(module):
        ...     module(*module.local_inputs(*inputs))[0].backward()
        ...     groups = [g for p in module._zero3.passes for g in p]
        ...     return len(groups), sum(any(not isinstance(s, _Settled) for _, s in g.items) for g in groups)
        >>> run_ranks(prog, unsettled)[0]  # (layer groups, still in flight): the first was waited for
        (3, 2)
        """
        started = _start_group(waiting)
        self.in_flight.append(started)
        while len(self.in_flight) > REDUCE_SCATTERS_IN_FLIGHT:
            self.in_flight.pop(0).settle()
        return started

    def _open_pass(self) -> None:
        if not self.pass_open:  # the pass's end closes its group (summed as autograd sums one pass)
            torch.autograd.Variable._execution_engine.queue_callback(self._close_pass)
            self.passes.append([])
            self.pass_open = True

    def _close_pass(self) -> None:
        self._flush()
        self.pass_open = False
        if self.order_now:
            self.regather_order, self.order_now = self.order_now, []
            self.position = {index: pos for pos, index in enumerate(self.regather_order)}
            first = [self.layer.get(id(self.previous[i][0])) if i < len(self.previous) else None
                     for i in self.regather_order]
            self.backward_horizon = horizons(first)

    def finish(self) -> None:
        """Wait for the deferred reduce-scatters and add each pass's shards to the parameters' gradients.

        >>> on = run_ranks(prog, lambda module: dict(train(module).named_local_parameters()))
        >>> off = run_ranks(prog, lambda module: dict(train(module, overlap=False).named_local_parameters()))
        >>> all(torch.equal(on[r][f], off[r][f]) for r in on for f in on[r])  # bitwise the same training
        True
        """
        for handle in self.started:  # re-gathers started for a backward that went another way: dropped
            if handle.pending is not None:
                handle.pending.wait()
                handle.pending = None
        self.started = []
        self.passes = [[g if isinstance(g, _Started) else self._start(g) for g in p] for p in self.passes]
        self.in_flight = []
        for one_pass in self.passes:
            totals: dict = {}
            for param, started in (item for group in one_pass for item in group.items):
                shard = compact(started.wait())
                total = totals.get(id(param))
                totals[id(param)] = (param, shard if total is None else total[1] + shard)
            for param, total in totals.values():
                if param.grad is None:
                    param.grad = total
                else:
                    param.grad.add_(total)
        self.passes = []
