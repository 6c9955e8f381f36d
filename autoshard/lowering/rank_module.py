"""A rank's GraphModule, lowered from the compiled graph: only that rank's parameter shards, local shapes.

`build_rank_module(state, rank)` returns a new GraphModule where parameters and buffers are `get_attr`s of
local shards (copied from the model's weights, or given), shape arguments of view/expand-like ops are the local
shapes, `autoshard.constrain` calls are dropped, collectives stay visible call nodes naming their mesh axis,
random ops become `random_op(index, op, ...)` calls drawn from the rank's stream, a context-parallel attention
becomes its ring or shifted form (autoshard/lowering/attention.py) and checkpoint regions recomputed submodules
(autoshard/lowering/recompute_regions.py).

>>> import autoshard
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("tp",),
...                              hints={"layers.0.weight": {"tp": "S(0)"}, "layers.0.bias": {"tp": "S(0)"},
...                                     "layers.1.weight": {"tp": "S(1)"}, "layers.1.bias": {"tp": "R"}})
"""
from __future__ import annotations

import torch
from torch import fx

from autoshard.ir import meta
from autoshard.ir.graph_utils import copy_node
from autoshard.ir.placement import local_shape, shard_tensor
from autoshard.lowering.attention import lower_attention
from autoshard.lowering.recompute_regions import wrap_regions
from autoshard.runtime.rng import random_op
from autoshard.strategies.base import REGISTRY


def attr_names(state) -> dict[str, str]:
    """Parameter/buffer FQN -> attribute name on the rank module (unique, deterministic).

    >>> attr_names(prog.state)["layers.0.weight"]
    'layers_0_weight'
    """
    names, used = {}, set()
    for node in state.gm.graph.nodes:
        if node.op == "placeholder" and node.meta.get(meta.KIND) in ("param", "buffer"):
            base = node.meta[meta.PATH].replace(".", "_")
            name, i = base, 1
            while name in used:
                name, i = f"{base}_{i}", i + 1
            used.add(name)
            names[node.meta[meta.PATH]] = name
    return names


def build_rank_module(state, rank: int, keep=None, local=None) -> fx.GraphModule:
    """Rank `rank`'s GraphModule; with `keep` (a set of FQNs) only those parameters and buffers get real
    storage, the others meta tensors of the local shape (a pipeline rank holds only its stages' weights).
    `local` ({FQN: this rank's block}, autoshard.weights.rank_weights) supplies the kept tensors; without
    it they are cut from the model's own tensors (meta tensors of a meta-device model stay meta).

    >>> gm = build_rank_module(prog.state, 1)
    >>> gm.layers_0_weight.shape, gm.layers_1_weight.shape  # rank 1's halves of [128, 32] and [32, 128]
    (torch.Size([64, 32]), torch.Size([32, 64]))
    >>> [line.strip() for line in gm.code.splitlines() if "collectives" in line]
    ["all_reduce = autoshard_runtime_collectives_all_reduce(linear_default_1, 'tp');  linear_default_1 = None"]
    """
    mesh = state.mesh
    coord = mesh.coord(rank)
    traced = state.traced
    root = torch.nn.Module()
    names = attr_names(state)
    graph = fx.Graph()
    env: dict = {}
    constrain = getattr(getattr(torch.ops, "autoshard", None), "constrain", None)
    for node in state.gm.graph.nodes:
        kind = node.meta.get(meta.KIND)
        if node.op == "placeholder" and kind in ("param", "buffer"):
            fqn = node.meta[meta.PATH]
            source = traced.params[fqn] if kind == "param" else traced.buffers[fqn]
            kept = keep is None or fqn in keep
            if kept and local is not None:
                block = local[fqn]
            elif kept and source.device.type != "meta":
                block = shard_tensor(source.detach(), node.meta[meta.SPEC], coord, mesh.shape).clone()
            else:
                shape = local_shape(source.shape, node.meta[meta.SPEC], mesh.shape)
                block = torch.empty(shape, dtype=source.dtype, device="meta")
            if kind == "param":
                root.register_parameter(names[fqn], torch.nn.Parameter(block, requires_grad=source.requires_grad))
            else:
                root.register_buffer(names[fqn], block)
            new = graph.get_attr(names[fqn])
        elif node.op == "call_function" and constrain is not None and node.target is constrain.default:
            env[node] = env[node.args[0]]
            continue
        else:
            new = copy_node(graph, node, lambda n: env[n])
            if node.op == "call_function":
                _localize_args(new, node, mesh)
                lower_attention(new, node, mesh, coord)  # context parallelism: a ring, or shifted causal rows
                if local is not None:
                    _off_meta(new)
                if meta.RNG_INDEX in node.meta:  # drawn from the rank's stream (autoshard/runtime/rng.py)
                    new.target = random_op
                    new.args = (node.meta[meta.RNG_INDEX], node.target, *new.args)
        new.meta = dict(node.meta)
        env[node] = new
    gm = fx.GraphModule(root, graph, class_name=f"Rank{rank}")
    gm.meta["autoshard.rank"] = rank
    return wrap_regions(gm)  # activation checkpointing: regions become recomputed submodules


def _off_meta(new: fx.Node) -> None:
    """A model traced on the meta device spells `device="meta"` in ops (`x.to(ids.device)`, `arange(...,
    device=...)`); with real weights the rank runs on the CPU, so those arguments name it instead."""
    def retarget(arg):
        return torch.device("cpu") if isinstance(arg, torch.device) and arg.type == "meta" else arg
    new.args = fx.node.map_aggregate(new.args, retarget)
    new.kwargs = fx.node.map_aggregate(new.kwargs, retarget)


def _localize_args(new: fx.Node, node: fx.Node, mesh) -> None:
    """Ops whose arguments spell the output shape get the rank's local shape."""
    rule = REGISTRY.lookup(node.target)
    if rule is None or rule.shape_arg is None or meta.SPEC not in node.meta:
        return
    shape = list(local_shape(node.meta["val"].shape, node.meta[meta.SPEC], mesh.shape))
    args = list(new.args)
    args[rule.shape_arg] = shape
    new.args = tuple(args)
