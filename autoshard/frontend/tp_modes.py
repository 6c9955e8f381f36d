"""ColossalAI's tensor-parallel modes as hints: 1D (Megatron), 2D (SUMMA / Optimus, arXiv 2104.05343),
2.5D (Tesseract, arXiv 2105.14500) and 3D (arXiv 2105.14450).

No special layers: each mode is a placement of every linear's weight, input and output over two or
three mesh axes, and the solver/insert_comm derive the collectives. Activations are [batch, seq, hidden].

2D on (row, col), q x q: a weight [out, in] is split in q x q blocks (in over row, out over col); an
  activation has its batch over row and hidden over col. A linear all-gathers its input over col and
  its weight over row (SUMMA's row and column broadcasts), multiplies locally and needs no reduction;
  backward reduce-scatters both gradients (the duality of the gathers).
2.5D on (dep, row, col), d x q x q: 2D inside each depth slice, the batch further split over dep,
  weights replicated over dep (their gradients all-reduced there, like data parallelism).
3D on (x, y, z), q x q x q: a linear all-gathers its input over one axis, its weight over y, and
  reduce-scatters its output over the third axis; consecutive linears swap the roles of x and z (as
  ColossalAI's Linear3D does), so a column/row pair returns the activation to its layout:
  block activations [b@y, s@x, h@z] -> column output [b@y, s, h@(x,z)] -> row output [b@y, s@x, h@z].
  Why y carries the batch and the weight gathers: a dim split over two axes nests them in mesh order,
  and only the inner one can be gathered alone. The weights keep the gathered axis y inside x, and the
  batch keeps y outside z, so an attention that moves z from the heads to the batch (equal bytes, the
  solver's free choice) reduce-scatters directly instead of re-nesting the batch.

>>> tp = colossal_hints("gpt2", dict(tensor=dict(size=4, mode="2d")))
>>> tp.mesh_shape, tp.axis_names
((2, 2), ('row', 'col'))
>>> tp.hints["layers.*.attn.[qkv].weight"]
{'row': 'S(1)', 'col': 'S(0)'}
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from autoshard.frontend.megatron_layers import MEGATRON_LAYERS
from autoshard.ir.errors import UserInputError

MODES = ("1d", "2d", "2.5d", "3d")


@dataclass(frozen=True)
class TensorParallelPlan:
    """What a ColossalAI `parallel=` config means here: hints plus the mesh they are written for.

    >>> colossal_hints("llama", dict(tensor=dict(size=8, mode="2.5d", depth=2))).mesh_shape
    (2, 2, 2)
    """

    mode: str
    mesh_shape: tuple
    axis_names: tuple
    hints: dict


# Where the residual stream is pinned to the mode's activation layout (hidden split, not batch: the
# papers' layout, whose norms reduce statistics across the hidden split). Zoo models only; GPT-2's
# fused layer_norm cannot split the hidden dim, so it is pinned at the sub-blocks' outputs instead.
_RESIDUAL = {"gpt2": [("layers.*.attn", "output"), ("layers.*.mlp", "output")],
             "llama": [("layers.*.attn_norm", "input"), ("layers.*.ffn_norm", "input"), ("norm", "input"),
                       ("layers.*.attn_norm.weight", "hidden"), ("layers.*.ffn_norm.weight", "hidden"),
                       ("norm.weight", "hidden")]}
_RESIDUAL_LAYOUT = {"2d": {"row": "S(0)", "col": "S(2)"}, "2.5d": {"dep": "S(0)", "row": "S(0)", "col": "S(2)"},
                    "3d": {"x": "S(1)", "y": "S(0)", "z": "S(2)"}}


def _layouts(mode: str):
    """(weight, input) placements of column and row linears, and the model input's, per mode. Outputs
    follow (the linear's strategy is fixed by its operands); where the partial sums are reduced, and
    whether by reduce-scatter, is the solver's choice."""
    if mode == "1d":  # Megatron: the weights alone fix the plan
        return ({"tp": "S(0)"}, None), ({"tp": "S(1)"}, None), {}
    if mode == "2d":
        summa = ({"row": "S(1)", "col": "S(0)"}, {"row": "S(0)", "col": "R"})
        return summa, summa, {"row": "S(0)"}
    if mode == "2.5d":
        tesseract = ({"dep": "R", "row": "S(1)", "col": "S(0)"}, {"dep": "S(0)", "row": "S(0)", "col": "R"})
        return tesseract, tesseract, {"dep": "S(0)", "row": "S(0)"}
    column = ({"x": "S(0)", "y": "S(0)", "z": "S(1)"}, {"x": "R", "y": "S(0)", "z": "S(2)"})
    row = ({"x": "S(1)", "y": "S(1)", "z": "S(0)"}, {"x": "S(2)", "y": "S(0)", "z": "R"})
    return column, row, {"y": "S(0)"}


def mesh_for(mode: str, size: int, depth: int | None = None) -> tuple[tuple, tuple]:
    """Mesh shape and axis names of a ColossalAI tensor config (errors say which sizes are valid).

    >>> mesh_for("3d", 8), mesh_for("2.5d", 8, depth=2)
    (((2, 2, 2), ('x', 'y', 'z')), ((2, 2, 2), ('dep', 'row', 'col')))
    """
    if mode == "1d":
        return (size,), ("tp",)
    if mode == "2d":
        q = math.isqrt(size)
        if q * q != size or q < 2:
            raise UserInputError(f"tensor mode '2d' needs a square size (4, 9, 16, ...), got size={size}")
        return (q, q), ("row", "col")
    if mode == "2.5d":
        if not depth or size % depth or math.isqrt(size // depth) ** 2 != size // depth:
            raise UserInputError(f"tensor mode '2.5d' needs depth= with size = depth * q * q (e.g. size=8, "
                                 f"depth=2), got size={size}, depth={depth}")
        q = math.isqrt(size // depth)
        return (depth, q, q), ("dep", "row", "col")
    q = round(size ** (1 / 3))
    if q ** 3 != size or q < 2:
        raise UserInputError(f"tensor mode '3d' needs a cubic size (8, 27, 64, ...), got size={size}")
    return (q, q, q), ("x", "y", "z")


def linear_roles(model) -> tuple[list[str], list[str]]:
    """Module globs of the column (first of a pair) and row (second) linears of a zoo model.

    >>> linear_roles("gpt2")
    (['layers.*.attn.[qkv]', 'layers.*.mlp.fc1'], ['layers.*.attn.proj', 'layers.*.mlp.fc2'])
    """
    name = model if isinstance(model, str) else type(model).__name__.lower()
    if name not in MEGATRON_LAYERS or name == "resnet":
        raise UserInputError(f"colossal_hints knows the linear layers of the zoo models {sorted(set(MEGATRON_LAYERS) - {'resnet'})}"
                             f", not {name!r}; pass column=[module globs] and row=[module globs] (the first and "
                             "second linear of each pair, e.g. column=['layers.*.mlp.fc1'], row=['layers.*.mlp.fc2'])")
    table = MEGATRON_LAYERS[name]
    column = [k[: -len(".weight")] for k, p in table.items() if k.endswith(".weight") and p == "S(0)"]
    row = [k[: -len(".weight")] for k, p in table.items() if k.endswith(".weight") and p == "S(1)"]
    return column, row


def colossal_hints(model, parallel: dict, column=None, row=None) -> TensorParallelPlan:
    """ColossalAI's `parallel=dict(data=N, tensor=dict(size=S, mode='1d'|'2d'|'2.5d'|'3d', depth=D))`
    as autoshard hints and the mesh they need (a data axis "dp" goes first when data > 1).

    `model` is a zoo model (name or instance) or any model with `column`/`row` module globs given.

    >>> plan = colossal_hints("gpt2", dict(data=2, tensor=dict(size=4, mode="2d")))
    >>> plan.axis_names, plan.hints["input:0"]
    (('dp', 'row', 'col'), {'dp': 'S(0)', 'row': 'S(0)'})
    """
    if not isinstance(parallel, dict) or not isinstance(parallel.get("tensor"), dict):
        raise UserInputError(f"parallel= must look like dict(tensor=dict(size=8, mode='3d')), got {parallel!r:.80}")
    unknown = set(parallel) - {"data", "tensor", "pipeline"}
    if unknown or parallel.get("pipeline", 1) not in (1, None):
        raise UserInputError(f"parallel= supports data= and tensor= here (got keys {sorted(parallel)}); give "
                             "pipeline stages with ':stage' hints or pipeline= instead")
    tensor = parallel["tensor"]
    mode, size, depth = str(tensor.get("mode", "1d")), tensor.get("size"), tensor.get("depth")
    if mode not in MODES or not isinstance(size, int) or size < 1:
        raise UserInputError(f"tensor=dict(size=..., mode=...) needs an int size and mode in {MODES}, got {tensor!r}")
    shape, names = mesh_for(mode, size, depth)
    if column is None or row is None:
        column, row = linear_roles(model)
    col_layout, row_layout, batch = _layouts(mode)
    hints: dict = {}
    for globs, (weight, inp) in ((column, col_layout), (row, row_layout)):
        for glob in globs:
            hints[f"{glob}.weight"] = dict(weight)
            if inp is not None:
                hints[f"{glob}:input"] = dict(inp)
    name = model if isinstance(model, str) else type(model).__name__.lower()
    for glob, where in _RESIDUAL.get(name, []) if mode in _RESIDUAL_LAYOUT else []:
        layout = _RESIDUAL_LAYOUT[mode]
        if where == "hidden":  # a norm's weight [hidden] is split like the residual's hidden dim
            hints[glob] = {axis: "S(0)" if p == "S(2)" else "R" for axis, p in layout.items()}
        else:
            hints[f"{glob}:{where}"] = dict(layout)
    data = parallel.get("data") or 1
    if data > 1:
        shape, names = (data, *shape), ("dp", *names)
        batch = {"dp": "S(0)", **batch}
    if batch:
        hints["input:0"] = batch
    return TensorParallelPlan(mode, tuple(shape), tuple(names), hints)


def apply_parallel_config(model, parallel: dict, mesh, axis_names, hints):
    """`parallelize(..., parallel=...)`: the mesh, axis names and hints (user hints win) of the config.

    >>> mesh, names, hints = apply_parallel_config("gpt2", dict(tensor=dict(size=2, mode="1d")), None, None,
    ...                                            {"layers.*.mlp.fc1.weight": {"tp": "R"}})
    >>> mesh, names, hints["layers.*.mlp.fc1.weight"]
    ((2,), ('tp',), {'tp': 'R'})
    """
    tp = colossal_hints(model, parallel)
    if mesh is not None and tuple(mesh) != tp.mesh_shape:
        raise UserInputError(f"parallel={parallel!r} needs mesh {tp.mesh_shape} (axes {tp.axis_names}), but mesh="
                             f"{tuple(mesh)} was given; pass mesh=None (or the matching shape)")
    if axis_names is not None and tuple(axis_names) != tp.axis_names:
        raise UserInputError(f"parallel={parallel!r} names the mesh axes {tp.axis_names}; drop axis_names="
                             f"{tuple(axis_names)} or rename them to match")
    merged = {**tp.hints, **(hints or {})}
    return tp.mesh_shape, tp.axis_names, merged


def llama_layer_linears(dim: int, ffn_dim: int, kv_dim: int):
    """(H_in, H_out) of a Llama block's linears, grouped by the activation they gather: q/k/v share the
    attention norm's output, w1/w3 the FFN norm's; wo and w2 are the second linear of their pair.

    >>> llama_layer_linears(dim=32, ffn_dim=64, kv_dim=16)["row"]
    [(32, 32), (64, 32)]
    """
    return {"column": [[(dim, dim), (dim, kv_dim), (dim, kv_dim)], [(dim, ffn_dim), (dim, ffn_dim)]],
            "row": [(dim, dim), (ffn_dim, dim)]}


def layer_comm_formula(mode: str, linears: dict, tokens: int, q: int, depth: int = 1, elem: int = 8,
                       norms: int = 2) -> dict:
    """Bytes per transformer layer and mesh axis {"fwd", "bwd", "sync"} that the papers' algorithms move,
    in the runtime's counting convention (all-gather: the gathered tensor; reduce-scatter/all-reduce:
    the tensor reduced); "sync" is the parameters' gradient reduction after backward. Derivation, per
    linear Y = X W with X [T, H_in], W [H_in, H_out]:
      2D SUMMA (2104.05343): processor (i, j) receives q-1 blocks of X [T/q, H_in/q] along its row and
        q-1 blocks of W [H_in/q, H_out/q] along its column = an all-gather of X over col (T/q x H_in)
        and of W over row (H_in x H_out/q); backward reduces dX and dW the same way (reduce-scatter).
      2.5D Tesseract (2105.14500): the same inside each of `depth` slices with T split d*q ways, plus
        the weight gradient's all-reduce over depth on the q x q block (H_in/q x H_out/q).
      3D (2105.14450): all-gather X over the input axis (a [T/q^2, H_in] block in our layout), W over the
        weight axis y (to H_in x H_out/q^2), reduce-scatter Y over the output axis (from T/q^2 x H_out);
        consecutive linears swap input and output axes x and z; backward is the dual.
    Norm statistics ([T/(rows), 1] per norm) are all-reduced over the hidden split (and back in bwd); the
    norms' weights (hidden split like the activations) have their gradients summed where tokens are split.

    >>> linears = llama_layer_linears(dim=32, ffn_dim=64, kv_dim=16)
    >>> layer_comm_formula("2.5d", linears, tokens=128, q=2, depth=2)["dep"]
    {'fwd': 0, 'bwd': 0, 'sync': 18688}
    """
    ws = [w for group in linears["column"] for w in group] + list(linears["row"])
    weights = sum(i * o for i, o in ws)
    hidden = linears["row"][0][1]
    norm_sync = elem * norms * hidden // q  # norm weights: hidden split q ways, summed over the token split
    if mode in ("2d", "2.5d"):
        rows = tokens // (q * depth)
        acts = sum(group[0][0] for group in linears["column"]) + sum(i for i, _ in linears["row"])
        col = elem * (rows * acts + norms * rows)
        out = {"row": {"fwd": elem * weights // q, "bwd": elem * weights // q, "sync": norm_sync},
               "col": {"fwd": col, "bwd": col, "sync": 0}}
        if mode == "2.5d":  # Tesseract's depth all-reduce of weight blocks: after backward, like dp
            out["dep"] = {"fwd": 0, "bwd": 0, "sync": elem * weights // (q * q) + norm_sync}
        return out
    block = tokens // (q * q)  # tokens in one [T/q^2, ...] block
    gathered_in = sum(group[0][0] for group in linears["column"]) + sum(o for _, o in linears["row"])
    x = elem * block * gathered_in  # column inputs gathered over x, row outputs reduce-scattered over x
    col_out = sum(o for group in linears["column"] for _, o in group)
    row_in = sum(i for i, _ in linears["row"])
    z_fwd = elem * block * (col_out + row_in)  # column outputs reduce-scattered, row inputs gathered
    z = z_fwd + elem * norms * block  # plus the norms' statistics over the hidden split (z)
    return {"x": {"fwd": x, "bwd": x, "sync": norm_sync}, "z": {"fwd": z, "bwd": z, "sync": 0},
            "y": {"fwd": elem * weights // (q * q), "bwd": elem * weights // (q * q), "sync": norm_sync}}
