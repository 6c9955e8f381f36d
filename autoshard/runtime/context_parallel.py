"""Context parallelism at run time: attention whose query rows are split over a mesh axis.

autoshard/strategies/attention.py offers the strategies and autoshard/lowering/attention.py puts these
functions into the rank programs:
- "allgather" (keys and values gathered whole, Llama 3's form): a rank's query rows attend to every key;
  a causal mask is shifted by the rank's first row (`causal_rows_mask`).
- "ring" (`ring_attention`): keys and values stay sharded and travel around the axis, one block per step,
  each block merged into the output by the online softmax (running log-sum-exp). Each shift is started
  before the block is computed, so it travels meanwhile. The backward runs the ring again; the key and
  value gradients travel with their blocks and arrive home after the last step. Nothing of size
  rows x keys is kept for backward: only the output and the log-sum-exp of each row.
- Causal rings are load balanced (zigzag): the sequence is cut in 2k chunks and rank r computes on chunks r
  and 2k-1-r, so every rank has the same share of the causal triangle. The placements stay contiguous (every
  other op, checkpoints and the data loader are unchanged); the attention reorders its query, key and
  value blocks on entry and its output on exit (`_Permute`), one exchange each way, priced by the cost model.
- "alltoall" (DeepSpeed-Ulysses) needs nothing here: it is the head-sharded attention with all-to-all
  conversions on both sides, which the solver already places.

Messages are counted in the rank's log as "send_recv" (a ring shift: the bytes sent) and "permute" (a zigzag
reordering: the rank's input, as all_to_all counts it).

>>> import torch
>>> from autoshard.ir.mesh import Mesh
>>> from autoshard.runtime.simulator import run_on_mesh
>>> _ = torch.manual_seed(0)
>>> q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.float64) for _ in range(3))
>>> whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
>>> def rank_part(comm):
...     r = comm.axis_rank("cp")
...     rows = slice(4 * r, 4 * r + 4)
...     return ring_attention(q[..., rows, :], k[..., rows, :], v[..., rows, :], is_causal=True, axis="cp")
>>> parts = run_on_mesh(Mesh((2,), ("cp",)), rank_part)
>>> torch.allclose(torch.cat([parts[0], parts[1]], -2), whole)
True
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from autoshard.ir.errors import UserInputError
from autoshard.runtime.collectives import current


def causal_rows_mask(query: torch.Tensor, key: torch.Tensor, row_offset: int) -> torch.Tensor:
    """The causal mask of query rows `row_offset`... against every key: row i may see keys j <= i (torch's
    top-left causal alignment, as `is_causal=True` on the whole sequence).

    >>> causal_rows_mask(torch.zeros(2, 3), torch.zeros(4, 3), 2).int()
    tensor([[1, 1, 1, 0],
            [1, 1, 1, 1]], dtype=torch.int32)
    """
    rows = torch.arange(query.size(-2), device=query.device).unsqueeze(-1) + row_offset
    return torch.arange(key.size(-2), device=query.device) <= rows


def causal_rows_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=True, scale=None,
                          enable_gqa=False, *, row_offset: int):
    """Causal attention of query rows `row_offset`... against whole keys and values ("allgather"): the keys before
    the rows in full and the rows' own block causally, each through the fused kernel and merged by log-sum-exp,
    so no rows x keys mask or matrix is made (codegen uses `causal_rows_mask` instead with attention dropout).

    >>> rows = causal_rows_attention(q[..., 4:, :], k, v, row_offset=4)
    >>> torch.allclose(rows, whole[..., 4:, :])
    True
    """
    if attn_mask is not None or dropout_p or not is_causal:
        raise UserInputError("causal_rows_attention takes a causal attention without mask or dropout; codegen passes "
                             "the others an explicit mask (causal_rows_mask)")
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    return _RowsAttention.apply(query, key, value, row_offset, scale)


class _RowsAttention(torch.autograd.Function):
    """`causal_rows_attention`: two chunk pairs (the keys before the rows, the diagonal block)."""

    @staticmethod
    def forward(ctx, q, k, v, offset, scale):
        dtype, rows, heads = _compute_dtype(q), q.size(-2), q.size(-3)
        qc = q.to(dtype)
        kc, vc = (_repeat_heads(t.to(dtype), heads) for t in (k, v))
        out = torch.zeros_like(qc)
        lse = torch.full((*q.shape[:-1], 1), float("-inf"), dtype=dtype, device=q.device)
        for cols, mask in _row_pairs(offset, rows):
            out, lse = _merge(out, lse, *_pair_forward(qc, kc[..., cols, :], vc[..., cols, :], mask, scale))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.offset, ctx.scale = offset, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dtype, heads = out.dtype, q.size(-3)
        qc, do = q.to(dtype), grad_out.to(dtype)
        kc, vc = (_repeat_heads(t.to(dtype), heads) for t in (k, v))
        delta = (do * out).sum(-1, keepdim=True)
        dq, dk, dv = torch.zeros_like(qc), torch.zeros_like(kc), torch.zeros_like(vc)
        for cols, mask in _row_pairs(ctx.offset, q.size(-2)):
            got = _pair_backward(do, qc, kc[..., cols, :], vc[..., cols, :], out, lse, delta, mask, ctx.scale)
            dq += got[0]
            dk[..., cols, :] += got[1]
            dv[..., cols, :] += got[2]
        return (dq.to(q.dtype), _fold_heads(dk, k.size(-3)).to(k.dtype), _fold_heads(dv, v.size(-3)).to(v.dtype),
                None, None)


def _row_pairs(offset: int, rows: int):
    """The key ranges rows offset..offset+rows see: those before them whole, their own block causally."""
    if offset:
        yield slice(0, offset), None
    yield slice(offset, offset + rows), _DIAGONAL


def ring_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                   *, axis: str):
    """scaled_dot_product_attention of this rank's query rows, with keys and values sharded like the rows over
    mesh axis `axis`: the ring (see the module docstring). Causal rings run in zigzag order. Fewer key/value heads
    than query heads are repeated per block, as `enable_gqa` asks (the shapes say it).

    >>> out = run_on_mesh(Mesh((2,), ("cp",)), lambda comm: ring_attention(q[..., :4, :], k[..., :4, :],
    ...                                                                    v[..., :4, :], axis="cp"))
    >>> out[0].shape  # each rank holds its rows of the output
    torch.Size([1, 2, 4, 4])
    """
    if dropout_p:
        raise UserInputError("ring attention has no attention dropout: plan the attention with the 'allgather' or "
                             "'alltoall' context-parallel strategy, or set the attention's dropout to 0")
    if attn_mask is not None and attn_mask.requires_grad:
        raise UserInputError("ring attention takes a constant attention mask; this one requires a gradient (a "
                             "learned bias): plan the attention with 'allgather' or 'alltoall'")
    comm = current()
    k = comm.axis_size(axis)
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    if not is_causal:
        return _RingAttention.apply(query, key, value, attn_mask, _Ring(comm, axis, [[j] for j in range(k)], False, scale))
    contiguous, zigzag = [[2 * j, 2 * j + 1] for j in range(k)], [[j, 2 * k - 1 - j] for j in range(k)]
    q, kk, v = (_Permute.apply(t, comm, axis, contiguous, zigzag) for t in (query, key, value))
    out = _RingAttention.apply(q, kk, v, None, _Ring(comm, axis, zigzag, True, scale))
    return _Permute.apply(out, comm, axis, zigzag, contiguous)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _permute(x: torch.Tensor, comm, axis: str, before: list, after: list, phase: str) -> torch.Tensor:
    """Move chunks of dim -2 between the ranks of `axis`: rank j holds chunks `before[j]` (in order) and will hold
    `after[j]`. A rank sends each peer, in one message, the chunks it will hold, in their new order."""
    comm.log.record(axis, "permute", _nbytes(x), phase)
    r = comm.axis_rank(axis)
    pieces = dict(zip(before[r], x.chunk(len(before[r]), -2)))
    where = {c: j for j, chunks in enumerate(after) for c in chunks}
    outgoing: dict = {}
    for c in sorted(pieces, key=lambda c: after[where[c]].index(c)):
        outgoing.setdefault(where[c], []).append(pieces[c])
    outgoing = {j: torch.cat(parts, -2) for j, parts in outgoing.items()}
    holder = {c: j for j, chunks in enumerate(before) for c in chunks}
    sources: dict = {}
    for c in after[r]:
        sources.setdefault(holder[c], []).append(c)
    chunk = pieces[before[r][0]]
    incoming = {i: chunk.new_empty(*chunk.shape[:-2], chunk.size(-2) * len(cs), chunk.size(-1))
                for i, cs in sources.items()}
    got = comm.exchange(outgoing, incoming, axis, "zigzag reordering")
    parts = {}
    for i, cs in sources.items():
        parts.update(zip(cs, got[i].chunk(len(cs), -2)))
    return torch.cat([parts[c] for c in after[r]], -2).contiguous()


class _Permute(torch.autograd.Function):
    """A chunk reordering over the axis; its backward is the reverse reordering."""

    @staticmethod
    def forward(ctx, x, comm, axis, before, after):
        ctx.comm, ctx.axis, ctx.before, ctx.after = comm, axis, before, after
        return _permute(x, comm, axis, before, after, "fwd")

    @staticmethod
    def backward(ctx, grad):
        return _permute(grad.contiguous(), ctx.comm, ctx.axis, ctx.after, ctx.before, "bwd"), None, None, None, None


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype


def _repeat_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.size(-3) == heads else t.repeat_interleave(heads // t.size(-3), -3)


def _fold_heads(grad: torch.Tensor, heads: int) -> torch.Tensor:
    """The gradient of `_repeat_heads`: sum each group of repeated heads."""
    if grad.size(-3) == heads:
        return grad
    return grad.unflatten(-3, (heads, grad.size(-3) // heads)).sum(-3)


@dataclass(frozen=True)
class _Ring:
    """One ring attention: the communicator and mesh `axis` its key/value blocks travel on, the sequence chunks
    each rank of the axis holds (`owned[j]`; zigzag order when causal), whether it is causal, the softmax scale."""

    comm: object
    axis: str
    owned: list
    causal: bool
    scale: float

    def pairs(self, visitor: int, mask, q_len: int, kv_len: int):
        """This rank's query chunks against the key/value block of rank `visitor`: (rows, cols, mask) of each chunk
        pair to compute (causal: skip chunks after the query's, mask the diagonal; else the given mask's columns)."""
        q_ids, kv_ids = self.owned[self.comm.axis_rank(self.axis)], self.owned[visitor]
        qc, kc = q_len // len(q_ids), kv_len // len(kv_ids)
        for a, x in enumerate(q_ids):
            for b, y in enumerate(kv_ids):
                if self.causal and y > x:
                    continue
                rows, cols = slice(a * qc, (a + 1) * qc), slice(b * kc, (b + 1) * kc)
                yield rows, cols, self._mask(mask, rows, y, x, kc)

    def _mask(self, mask, rows, y, x, kc):
        if self.causal:
            return _DIAGONAL if x == y else None
        if mask is None:
            return None
        m = mask[..., rows, :] if mask.size(-2) > 1 else mask
        return m.narrow(-1, y * kc, kc) if m.size(-1) > 1 else m


def _scores(q, k, scale, mask):
    s = (q @ k.transpose(-2, -1)) * scale
    if mask is None:
        return s
    if mask.dtype == torch.bool:
        return s.masked_fill(~mask, float("-inf"))
    return s + mask.to(s.dtype)


_DIAGONAL = "diagonal"  # a causal chunk pair on the diagonal: `_Ring.pairs` marks it so the fused kernel can take it


def _fused(q, mask) -> bool:
    """torch's CPU flash kernel takes a chunk pair without a mask, or the diagonal's causal one: it keeps no
    rows x keys matrix (the math below holds one per pair)."""
    return q.device.type == "cpu" and q.dim() == 4 and (mask is None or isinstance(mask, str))


def _pair_forward(q, k, v, mask, scale):
    """One query chunk against one key/value chunk: (output, log-sum-exp [..., rows, 1]); rows that see no key
    give 0 and -inf."""
    if _fused(q, mask):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, mask is not None, scale=scale)
        return out.to(q.dtype), lse.unsqueeze(-1).to(q.dtype)
    s = _scores(q, k, scale, _dense(mask, q, k))
    top = s.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    p = torch.exp(s - top)
    total = p.sum(-1, keepdim=True)
    o = torch.where(total > 0, (p @ v) / total, torch.zeros_like(q[..., :1]).expand_as(p @ v))
    return o, top + torch.log(total)


def _pair_backward(do, q, k, v, out, lse, delta, mask, scale):
    """The pair's share of dq, dk, dv, from the whole row's output and log-sum-exp."""
    if _fused(q, mask):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse.squeeze(-1), 0.0, mask is not None, scale=scale)
    lse = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("inf")))  # rows that see nothing: p = 0
    p = torch.exp(_scores(q, k, scale, _dense(mask, q, k)) - lse)
    ds = p * (do @ v.transpose(-2, -1) - delta)
    return (ds @ k) * scale, (ds.transpose(-2, -1) @ q) * scale, p.transpose(-2, -1) @ do


def _merge(out, lse, block_out, block_lse):
    """The online softmax: the output and log-sum-exp of rows seen so far merged with one more key block's (rows
    that saw no key yet keep -inf and 0)."""
    new = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
    return out * torch.exp(lse - safe) + block_out * torch.exp(block_lse - safe), new


def _dense(mask, q, k):
    if isinstance(mask, str):  # the diagonal
        return torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
    return mask


class _RingAttention(torch.autograd.Function):
    """The ring (see the module docstring and `_Ring`)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, ring: _Ring):
        n, r = ring.comm.axis_size(ring.axis), ring.comm.axis_rank(ring.axis)
        dtype = _compute_dtype(q)
        heads = q.size(-3)
        qc = q.to(dtype)
        out = torch.zeros_like(qc)
        lse = torch.full((*q.shape[:-1], 1), float("-inf"), dtype=dtype, device=q.device)
        block = torch.stack([k, v])
        for step in range(n):
            j = (r - step) % n
            pending = _shift(ring.comm, ring.axis, block, "fwd") if step < n - 1 else None
            kb, vb = (_repeat_heads(t.to(dtype), heads) for t in block)
            for rows, cols, m in ring.pairs(j, mask, q.size(-2), kb.size(-2)):
                o, block_lse = _pair_forward(qc[..., rows, :], kb[..., cols, :], vb[..., cols, :], m, ring.scale)
                out[..., rows, :], lse[..., rows, :] = _merge(out[..., rows, :], lse[..., rows, :], o, block_lse)
            if pending is not None:
                block = pending.wait()
        ctx.save_for_backward(q, k, v, out, lse, *([mask] if mask is not None else []))
        ctx.ring = ring
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, *mask = ctx.saved_tensors
        mask = mask[0] if mask else None
        ring = ctx.ring
        n, r = ring.comm.axis_size(ring.axis), ring.comm.axis_rank(ring.axis)
        dtype, heads = out.dtype, q.size(-3)
        qc, do = q.to(dtype), grad_out.to(dtype)
        delta = (do * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(qc)
        block = torch.stack([k, v])
        grads = torch.zeros(block.shape, dtype=dtype, device=q.device)
        for step in range(n):
            j = (r - step) % n
            pending = _shift(ring.comm, ring.axis, block, "bwd") if step < n - 1 else None
            kb, vb = (_repeat_heads(t.to(dtype), heads) for t in block)
            dk, dv = torch.zeros_like(kb), torch.zeros_like(vb)
            for rows, cols, m in ring.pairs(j, mask, q.size(-2), kb.size(-2)):
                got = _pair_backward(do[..., rows, :], qc[..., rows, :], kb[..., cols, :], vb[..., cols, :],
                                     out[..., rows, :], lse[..., rows, :], delta[..., rows, :], m, ring.scale)
                dq[..., rows, :] += got[0]
                dk[..., cols, :] += got[1]
                dv[..., cols, :] += got[2]
            grads = grads + torch.stack([_fold_heads(dk, k.size(-3)), _fold_heads(dv, v.size(-3))])
            grads = _shift(ring.comm, ring.axis, grads, "bwd").wait()  # the gradients travel with their block, home at last
            if pending is not None:
                block = pending.wait()
        dk, dv = grads
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _shift(comm, axis: str, block: torch.Tensor, phase: str):
    """Start sending `block` to the next rank of the axis and receiving the previous rank's."""
    n, r = comm.axis_size(axis), comm.axis_rank(axis)
    comm.log.record(axis, "send_recv", _nbytes(block), phase)
    pending = comm.start_exchange({(r + 1) % n: block.contiguous()}, {(r - 1) % n: block}, axis, "ring attention shift")
    return pending.then(lambda got: got[(r - 1) % n])
