"""recompute: activation checkpointing — choose regions whose activations are recomputed in backward.

Reads `state.options.checkpoint` (when it is None: "auto" if solve's memory ladder planned for recomputation,
`state.memory_savers`, else the regions a saved plan's hints list under "recompute"): None, a list of module
globs (`["layers.*"]`: every matching module instance is one region), or "auto" (checkpoint repeated layers —
modules at `<list>.<index>` — while the predicted memory per rank exceeds the budget, `state.options.checkpoint_budget`
or for the ladder's recomputation the memory budget, most bytes saved per second of recompute first; the choice is
recorded in the plan's hints). Writes `autoshard.recompute` = the region's module path on every op
and collective inside a region, and `state.recompute_regions` (paths, graph order).
Runs after insert_comm/fuse_comm, so a region holds its collectives: recomputing the whole region
re-runs them, in the same order on every rank (every rank has the same regions); and after predict, whose memory the
"auto" choice reads, and whose prediction it then settles for the regions (`settle_prediction`: the recompute time,
the activations not kept).
`autoshard.lowering.recompute_regions.wrap_regions(gm)` (on each rank's module) moves each region into a submodule
called through `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`: only its inputs are
saved for backward.

>>> import autoshard
>>> from autoshard.zoo import gpt2
>>> model, inputs, loss_fn = gpt2(n_layers=2)
>>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
...                              hints={"input:0": {"dp": "S(0)"}}, checkpoint=["layers.*"])
>>> prog.state.recompute_regions
['layers.0', 'layers.1']
>>> ops = [n for n in prog.state.gm.graph.nodes if n.op == "call_function"]
"""
from __future__ import annotations

import fnmatch
import re

from autoshard.cost.pipeline_schedule import pre_cut_memory
from autoshard.cost.recompute_cost import region_savings
from autoshard.frontend.hints import Hints
from autoshard.ir import meta
from autoshard.ir.errors import PlanError, UserInputError
from autoshard.ir.meta import RECOMPUTE
from autoshard.passes.contract import compiler_pass
from autoshard.passes.predict import settle_prediction
from autoshard.solver.layers import layer_key

_LAYER_RE = re.compile(r"^(.*\.)?[A-Za-z_]\w*\.[0-9]+$")  # an element of a ModuleList / Sequential


@compiler_pass("recompute", reads=(meta.COMM, meta.SPEC, meta.NODE_COST, "state.memory_savers", "state.predicted"),
               writes=(meta.RECOMPUTE, "state.recompute_regions", "state.hints", "state.predicted"))
def recompute(state) -> None:
    """The pass: mark every op of each region with `autoshard.recompute` = the region's path.

    >>> sorted({n.meta.get(RECOMPUTE, "-") for n in ops})
    ['-', 'layers.0', 'layers.1']
    """
    hints = state.hints = state.hints if isinstance(state.hints, Hints) else Hints.parse(state.hints)
    # The memory ladder's recomputation rung recomputes as the budget needs; a saved plan's hints carry the regions
    # it chose.
    option = state.options.checkpoint or ("auto" if _ladder_recomputes(state) else None) or hints.recompute
    state.recompute_regions = []
    if not option:
        return
    ops = [n for n in state.gm.graph.nodes if n.op == "call_function"]
    if option == "auto":
        # in model order: a pipeline spreads the layers left without recomputation by their place (_spread_order)
        regions = _auto_regions(state, ops, [p for p in _module_paths(ops) if _LAYER_RE.match(p)])
    else:
        regions = checkpoint_regions(option, ops)
    regions = [r for r in regions if not any(r != o and r.startswith(o + ".") for o in regions)]  # outermost wins
    # The plan records the regions, chosen or asked for: applying the saved plan recomputes the same layers.
    hints.recompute = list(regions)
    outermost = set(regions)
    for node in ops:
        region = region_of(node, outermost)
        if region is not None:
            node.meta[RECOMPUTE] = region
    state.recompute_regions = [r for r in dict.fromkeys(n.meta.get(RECOMPUTE) for n in ops) if r]
    if state.recompute_regions:
        settle_prediction(state)  # predict ran before the regions were chosen



def _module_paths(ops) -> dict[str, None]:
    """Every module path of the ops and their parents, in the order the graph first reaches them (model order:
    layers.2 before layers.10)."""
    paths: dict = {}
    for node in ops:
        parts = node.meta.get(meta.PATH, "").split(".")
        paths.update(dict.fromkeys(".".join(parts[:i]) for i in range(1, len(parts) + 1)))
    paths.pop("", None)
    return paths


def checkpoint_regions(option, ops) -> list[str]:
    """The module paths `checkpoint=` globs (a string or a list) name among the ops' modules, outermost only.

    >>> checkpoint_regions(["layers.*", "layers.0.mlp"], ops)
    ['layers.0', 'layers.1']
    """
    paths = _module_paths(ops)
    regions = []
    for glob in [option] if isinstance(option, str) else list(option):
        matched = sorted(p for p in paths if fnmatch.fnmatchcase(p, glob))
        if not matched:
            raise UserInputError(f"checkpoint={glob!r} matches no module of the model; use module paths like "
                                 f"'layers.*' (modules: {sorted(paths)[:8]}...)")
        regions += matched
    return [r for r in regions if not any(r != o and r.startswith(o + ".") for o in regions)]


def region_of(node, regions: set):
    """The region whose module holds `node`, or None; `regions`: a set of module paths none of which is inside
    another (`checkpoint_regions`' outermost ones), so at most one holds it: its path or a parent's.

    >>> region_of(ops[0], {"layers.0"}) in ("layers.0", None)
    True
    """
    path = node.meta.get(meta.PATH, "")
    while path:
        if path in regions:
            return path
        path = path.rpartition(".")[0]
    return None


def _ladder_recomputes(state) -> bool:
    """Whether solve planned for recomputation because only it fits the memory budget (passes/memory_fit.py)."""
    return state.options.checkpoint is None and state.memory_savers is not None and state.memory_savers.recompute


def _whole_param_bytes(state) -> float:
    """Held bytes (with gradients and optimizer state) of the parameters outside the repeated layers, which a
    pipeline stage holds whole (cost/pipeline_schedule.param_share)."""
    return sum(node.meta[meta.NODE_COST].memory_bytes for node in state.gm.graph.nodes
               if node.op == "placeholder" and node.meta.get(meta.KIND) == "param" and meta.NODE_COST in node.meta
               and not layer_key(node.meta.get(meta.PATH, ""))[1])


def _spread_order(layers, pipeline) -> dict:
    """Where each layer (in model order) stands among layers of equal savings: in a pipeline, round-robin over
    the pp ranks' shares of the layers (each share's first layer, then each one's second...), so the layers left
    without recomputation are spread over the ranks as the pre-cut memory assumes (1F1B's first rank keeps p
    micro-batches of its own layers: a rank holding every kept layer would hold p times what was counted).

    >>> from autoshard.program.pipeline import PipelineConfig
    >>> order = _spread_order(["l.0", "l.1", "l.2", "l.3"], PipelineConfig("pp", 2, 4))
    >>> sorted(order, key=order.get)
    ['l.0', 'l.2', 'l.1', 'l.3']
    """
    if pipeline is None:
        return {layer: i for i, layer in enumerate(layers)}
    p, n = pipeline.pp_size, len(layers)
    block = [i * p // n for i in range(n)]  # the pp rank's share a layer falls in
    return {layer: (i - -(-block[i] * n // p), block[i]) for i, layer in enumerate(layers)}


def _auto_regions(state, ops, layers) -> list[str]:
    """Repeated layers to checkpoint until the predicted memory fits the budget (greedy by bytes saved
    per recompute second); none when it already fits."""
    options = state.options
    budget = options.memory_budget if _ladder_recomputes(state) else options.checkpoint_budget
    if budget is None or not layers:
        return []
    memory = pre_cut_memory(state.predicted, options.pipeline, _whole_param_bytes(state))  # a pp rank's, before the cut
    members: dict = {layer: [] for layer in layers}  # each layer's ops, in one walk over their paths' prefixes
    for node in ops:
        parts = node.meta.get(meta.PATH, "").split(".")
        for end in range(1, len(parts) + 1):
            prefix = ".".join(parts[:end])
            if prefix in members:
                members[prefix].append(node)
    scored = []
    spread = _spread_order(layers, options.pipeline)
    for layer in layers:
        saved, seconds = region_savings(state, members[layer])
        scored.append((float(f"{-saved / max(seconds, 1e-12):.6g}"), spread[layer], layer, saved))
    chosen, savings = [], []
    for _, _, layer, saved in sorted(scored):
        if memory - sum(savings) + max(savings, default=0) <= budget:
            break
        if any(layer.startswith(c + ".") or c.startswith(layer + ".") for c in chosen):
            continue  # nested layers (a Sequential inside a block): their savings overlap
        chosen.append(layer)
        savings.append(saved)
    memory += max(savings, default=0) - sum(savings)  # one region's activations are live during its recompute
    if memory > budget:
        raise PlanError(f"checkpointing every repeated layer ({len(layers)}) leaves a predicted {memory / 2**20:.1f} "
                        f"MiB per rank, above the memory budget {budget / 2**20:.1f} MiB; shard more (a larger "
                        "mesh, ZeRO) or raise memory_budget")
    return chosen
