"""Special ops: each a short rule next to a one-line reason.

>>> REGISTRY.lookup(torch.ops.aten.layer_norm.default).note
'statistics over trailing dims: only leading dims shard'
"""
from __future__ import annotations

import torch

from autoshard.ir.placement import P, R, Shard
from autoshard.strategies.base import REGISTRY, AxisStrategy
from autoshard.strategies.pointwise import broadcast_strategies

aten = torch.ops.aten


def _leading_dims(ctx):
    """Norms over the trailing `normalized_shape` dims: shard leading dims; weight/bias replicated."""
    ndim = len(ctx.in_shapes[0])
    normalized = ctx.arg("normalized_shape")
    rest = (R,) * (len(ctx.in_shapes) - 1)
    return [AxisStrategy((Shard(d),) + rest, Shard(d)) for d in range(ndim - len(normalized))]


REGISTRY.register([aten.layer_norm.default, aten.rms_norm.default], _leading_dims,
                  note="statistics over trailing dims: only leading dims shard")


def _batch_norm(ctx):
    """Training batch norm reduces over every dim but channels (1); eval may shard the batch too."""
    training = ctx.arg("training")
    channel = AxisStrategy((Shard(1),) + tuple(Shard(0) for _ in ctx.in_shapes[1:]), Shard(1))
    found = [channel]
    if not training:
        found.append(AxisStrategy((Shard(0),) + (R,) * (len(ctx.in_shapes) - 1), Shard(0)))
    return found


REGISTRY.register([aten.batch_norm.default], _batch_norm, note="channels shard; batch only in eval")


def _nll_loss(ctx):
    """input [N, C, ...], target [N, ...]: sharded N or spatial dims make partial sums (reduction=sum)."""
    reduction = ctx.arg("reduction")
    ndim = len(ctx.in_shapes[0])
    rest = (R,) * (len(ctx.in_shapes) - 2)  # class weights
    found = []
    # A 1-D input [C] has no batch: its only dim is the classes.
    for d in ([0] if ndim >= 2 else []) + list(range(2, ndim)):
        target_dim = 0 if d == 0 else d - 1
        if reduction == 2:
            found.append(AxisStrategy((Shard(d), Shard(target_dim)) + rest, P))
        elif reduction == 0:
            found.append(AxisStrategy((Shard(d), Shard(target_dim)) + rest, Shard(target_dim)))
    if reduction in (0, 2):
        found.append(AxisStrategy((P, R) + rest, P))
    return found


REGISTRY.register([aten.nll_loss_nd.default, aten.nll_loss.default, aten.nll_loss2d.default], _nll_loss,
                  note="sum/none reductions shard the batch; mean is split into sum / count by normalize")


def _replicated_only(ctx):
    return [ctx.replicated()]


REGISTRY.register([aten.arange.default, aten.arange.start, aten.arange.start_step, aten.zeros.default,
                   aten.ones.default, aten.full.default, aten.empty.memory_format, aten.scalar_tensor.default,
                   aten.rand.default, aten.randn.default, aten.randint.low, aten.randint.default,
                   aten.tensor.default, aten.lift_fresh.default],
                  _replicated_only, note="creation ops: every rank makes the whole tensor")
def _new_tensor(ctx):
    """new_ones(x, size): only x's dtype and device are read, so x may come in any placement, and each rank
    makes its own block of a sharded output (codegen passes the local size)."""
    ins = [R, P] + [Shard(d) for d in range(len(ctx.in_shapes[0]))]
    outs = [R] + [Shard(d) for d in range(len(ctx.out_shape))]
    return [AxisStrategy((i,), o) for i in ins for o in outs]


REGISTRY.register([aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.new_empty.default],
                  _new_tensor, shape_arg=1, note="creation from x's dtype: any placement")
def _index(ctx):
    """x[..., ids] with one index tensor at dim p (MoE dispatch, expert-weight lookups, Falcon's k/v slots): the
    output is x.shape[:p] + ids.shape + x.shape[p + 1:]; every dim but p shards, so do the ids'; linear in x."""
    indices = ctx.arg("indices")
    tensors = [i for i, ids in enumerate(indices) if ids is not None]
    if len(tensors) != 1 or len(ctx.in_shapes) != 2:
        return []
    p, lead = tensors[0], len(ctx.in_shapes[1])
    found = [AxisStrategy((Shard(d), R), Shard(d if d < p else d - 1 + lead))
             for d in range(len(ctx.in_shapes[0])) if d != p]
    found += [AxisStrategy((R, Shard(j)), Shard(p + j)) for j in range(lead)]
    return found + [AxisStrategy((P, R), P)]


REGISTRY.register([aten.index.Tensor], _index, note="x[ids]: gathered dim whole")
def _repeat_interleave(ctx):
    """Element i becomes r neighbours, so a block of rows stays a block: every dim shards; linear."""
    ndim = len(ctx.in_shapes[0])
    if ctx.arg("dim") is None and ndim != 1:  # repeats of the flattened tensor
        return []
    return [AxisStrategy((Shard(d),), Shard(d)) for d in range(ndim)] + [AxisStrategy((P,), P)]


def _repeat(ctx):
    """x.repeat(sizes) tiles each dim: a tiled dim stays whole, the others shard (after new leading dims)."""
    sizes = ctx.arg("repeats")
    lead = len(sizes) - len(ctx.in_shapes[0])
    found = [AxisStrategy((Shard(d),), Shard(lead + d)) for d in range(len(ctx.in_shapes[0])) if sizes[lead + d] == 1]
    return found + [AxisStrategy((P,), P)]


REGISTRY.register([aten.repeat_interleave.self_int], _repeat_interleave, note="blocks of rows stay blocks")
REGISTRY.register([aten.repeat.default], _repeat, note="tiled dims stay whole")
def _gather(ctx):
    """gather(x, dim, ids): out[i] = x[i with ids[i] at dim]. A whole x serves a block of ids along `dim`;
    another dim (it addresses x by position) shards in both where their sizes agree; linear in x."""
    (x, ids), dim = ctx.in_shapes, ctx.arg("dim") % max(len(ctx.in_shapes[0]), 1)
    found = [AxisStrategy((R, Shard(dim)), Shard(dim))]
    found += [AxisStrategy((Shard(d), Shard(d)), Shard(d)) for d in range(len(ids)) if d != dim and x[d] == ids[d]]
    return found + [AxisStrategy((P, R), P)]


REGISTRY.register([aten.gather.default], _gather, note="the gathered dim stays whole")
REGISTRY.register([aten.scatter.src, aten.index_put.default, aten.index_put_.default, aten.item.default,
                   aten.cross_entropy_loss.default, aten._local_scalar_dense.default],
                  _replicated_only, note="scatters and fused losses run replicated")


def _in_place(ctx):
    """In-place updates shard like elementwise ops; solve never reshards the mutated operand."""
    return broadcast_strategies(ctx)


# normalize makes other in-place ops out-of-place where nothing aliases their operand; these remain on buffers
# and views (solve must not reshard the mutated operand: see mutated_positions there).
REGISTRY.register([aten.add_.Tensor, aten.copy_.default, aten.mul_.Tensor, aten.fill_.Scalar, aten.zero_.default,
                   aten.div_.Tensor, aten.div_.Scalar, aten.masked_fill_.Scalar],
                  _in_place, note="in-place update of a buffer, sharded like it")
