"""What a context-parallel attention costs beyond its placements (autoshard/strategies/attention.py), in one home
for the ILP (autoshard/cost/axis_cost.py) and predict.

"allgather" and "alltoall" are placements: their all-gathers, reduce-scatters and all-to-alls are the solver's
conversions, priced like any other. The ring's messages happen inside the op (autoshard/runtime/context_parallel.py),
per rank, with kv = the rank's key + value block bytes and k the axis size:
- forward: k - 1 shifts of kv; backward: k - 1 shifts of kv and k shifts of their gradients (kv x g, g = 2 when
  a 16-bit block's gradients travel in float32, else 1). Each key/value shift is started before the block is
  computed, so only what the block's compute does not cover is exposed; the gradient shifts wait at once.
- causal rings reorder q, k, v and the output in zigzag order: one exchange of each in forward (q + kv + out)
  and of each gradient in backward, priced as all-to-alls of those bytes.
- compute: a causal ring skips the key chunks after each query chunk: (2k + 1) / 4k of the rows x keys work
  (the other strategies compute the masked product whole, as torch's math kernel does).
- memory of the score blocks: without a fused attention kernel (a profile with `fused_attention=False`) torch
  keeps the attention weights for backward: rows x keys per head; a ring holds one chunk pair at a time and
  keeps only the output and each row's log-sum-exp.

>>> from autoshard.cost.profiles import Link
>>> link = Link(alpha=1e-5, bandwidth=1e9)
>>> ring_cost(k=4, causal=False, blocks=RingBlocks(q=1e6, kv=2e6, out=1e6), compute_s=0.0, link=link)
RingCost(fwd_bytes=6000000, bwd_bytes=14000000, seconds=0.0201)
"""
from __future__ import annotations

from dataclasses import dataclass

from autoshard.cost.collective_time import all_to_all_time
from autoshard.ir.op_schema import argument


@dataclass(frozen=True)
class RingCost:
    """Bytes one rank sends (forward, backward; the runtime's counting) and the exposed seconds of a ring.

    >>> RingCost(1, 2, 0.5).seconds
    0.5
    """

    fwd_bytes: int
    bwd_bytes: int
    seconds: float


@dataclass(frozen=True)
class RingBlocks:
    """The bytes of one rank's blocks in a ring: its query rows, its key + value block (what travels) and its output
    rows; `grad_scale`: how much bigger the travelling gradients are (`grad_scale()`).

    >>> RingBlocks(q=1e6, kv=2e6, out=1e6).grad_scale
    1.0
    """

    q: float
    kv: float
    out: float
    grad_scale: float = 1.0


def ring_cost(k: int, causal: bool, blocks: RingBlocks, compute_s: float, link, with_backward: bool = True) -> RingCost:
    """The ring on an axis of `k` ranks (module docstring); `compute_s`: the attention's forward + backward compute
    on a rank (one third forward), which hides the key/value shifts.

    >>> ring_cost(2, True, RingBlocks(1e6, 2e6, 1e6), 0.0, Link(0.0, 1e9), with_backward=False)  # 1 shift + reordering
    RingCost(fwd_bytes=6000000, bwd_bytes=0, seconds=0.004)
    """
    def shift(nbytes):
        return link.alpha + nbytes / link.bandwidth

    q_bytes, kv_bytes, out_bytes, grad_scale = blocks.q, blocks.kv, blocks.out, blocks.grad_scale

    fwd = (k - 1) * kv_bytes
    seconds = max(0.0, (k - 1) * shift(kv_bytes) - compute_s / 3)
    bwd = 0.0
    if with_backward:
        bwd = (k - 1) * kv_bytes + k * kv_bytes * grad_scale
        seconds += max(0.0, (k - 1) * shift(kv_bytes) - 2 * compute_s / 3) + k * shift(kv_bytes * grad_scale)
    if causal:
        moved = q_bytes + kv_bytes + out_bytes
        fwd += moved
        seconds += sum(all_to_all_time(b, k, link) for b in (q_bytes, kv_bytes / 2, kv_bytes / 2, out_bytes))
        if with_backward:
            bwd += moved
            seconds += sum(all_to_all_time(b, k, link) for b in (q_bytes, kv_bytes / 2, kv_bytes / 2, out_bytes))
    return RingCost(int(fwd), int(bwd), seconds)


def ring_compute_factor(k: int, causal: bool) -> float:
    """The share of the rows x keys work a ring rank computes, relative to its rows against every key.

    >>> ring_compute_factor(2, True), ring_compute_factor(4, False)
    (0.625, 1.0)
    """
    return (2 * k + 1) / (4 * k) if causal else 1.0


def grad_scale(itemsize: int) -> float:
    """How much bigger a block's travelling gradient is than the block: 16-bit blocks accumulate in float32.

    >>> grad_scale(2), grad_scale(8)
    (2.0, 1.0)
    """
    return 4 / itemsize if itemsize < 4 else 1.0


def score_bytes(out_bytes: float, head_dim: int, keys: int, method: str, k: int, causal: bool,
                fused: bool) -> float:
    """Bytes of attention weights a rank keeps (or, for a ring, holds at once) given its output block's bytes:
    rows x `keys` per head without a fused kernel, nothing with one (its tiles are negligible).

    >>> score_bytes(4096, head_dim=64, keys=1024, method="", k=1, causal=True, fused=False)  # 64 rows x 1024 keys
    65536.0
    >>> score_bytes(4096, 64, 1024, "ring", 4, causal=True, fused=False)  # one chunk pair: 32 rows x 128 keys
    4096.0
    """
    if fused:
        return 0.0
    rows_x_heads = out_bytes / head_dim
    if method != "ring":
        return rows_x_heads * keys
    chunks = 2 if causal else 1
    return rows_x_heads / chunks * (keys / k / chunks)


@dataclass(frozen=True)
class AttentionTerms:
    """An attention's compute (scaled for a causal ring), in-op communication (a ring's exposed seconds and
    bytes, on `ring_axis`) and the memory of its score blocks.

    >>> AttentionTerms(1.0, 0.0, 0.0).ring is None
    True
    """

    compute_s: float
    comm_s: float
    memory_bytes: float
    ring_axis: int | None = None
    ring: RingCost | None = None


def attention_terms(node, strategies: dict, mesh, profile, compute_s: float, in_bytes: list, out_bytes: float,
                    with_backward: bool) -> AttentionTerms:
    """The terms of `node` (a scaled_dot_product_attention) under `strategies` ({mesh axis: AxisStrategy}); sizes
    are local under them (`in_bytes` per tensor input: q, k, v, mask).

    >>> import torch
    >>> from autoshard.ir.mesh import Mesh
    >>> from autoshard.cost.profiles import CPU_PROFILE
    >>> from autoshard.strategies.attention import _attention
    >>> from autoshard.strategies.base import RuleContext
    >>> graph = torch.fx.Graph()
    >>> q, k, v = (graph.placeholder(n) for n in "qkv")
    >>> for p in (q, k, v):
    ...     p.meta["val"] = torch.empty(1, 2, 64, 16)
    >>> sdpa = graph.call_function(torch.ops.aten.scaled_dot_product_attention.default, (q, k, v), {"is_causal": True})
    >>> sdpa.meta["val"] = torch.empty(1, 2, 64, 16)
    >>> ring = next(c for c in _attention(RuleContext(sdpa, [(1, 2, 64, 16)] * 3, [(1, 2, 64, 16)], 2)) if c.method == "ring")
    >>> terms = attention_terms(sdpa, {0: ring}, Mesh((2,), ("cp",)), CPU_PROFILE, 1.0, [4096] * 3, 4096, True)
    >>> terms.compute_s, terms.ring_axis, terms.ring.fwd_bytes  # 5/8 of the work; one shift of k and v + the reordering
    (0.625, 0, 24576)
    """
    q, key = argument(node, "query").meta["val"], argument(node, "key").meta["val"]
    causal = bool(argument(node, "is_causal"))
    ring = [(axis, s) for axis, s in strategies.items() if s.method == "ring"]
    fused = getattr(profile, "fused_attention", True)
    if not ring:
        keys = key.shape[-2]
        return AttentionTerms(compute_s, 0.0, score_bytes(out_bytes, q.shape[-1], keys, "", 1, causal, fused))
    axis, _ = ring[0]
    k = mesh.shape[axis]
    compute_s *= ring_compute_factor(k, causal)
    blocks = RingBlocks(in_bytes[0], in_bytes[1] + in_bytes[2], out_bytes, grad_scale(key.element_size()))
    cost = ring_cost(k, causal, blocks, compute_s, profile.link(mesh.shape, axis), with_backward)
    memory = score_bytes(out_bytes, q.shape[-1], key.shape[-2], "ring", k, causal, fused)
    return AttentionTerms(compute_s, cost.seconds, memory, axis, cost)
