"""recompute: activation checkpointing — choose regions whose activations are recomputed in backward.

Reads `state.options.checkpoint` (or, when it is None, the regions a saved plan's hints list under
"recompute"): None, a list of module globs (`["layers.*"]`: every matching
module instance is one region), or "auto" (checkpoint repeated layers — modules at `<list>.<index>` —
while the predicted memory per rank exceeds `state.options.checkpoint_budget`, most bytes saved
per second of recompute first; the choice is recorded in the plan's hints). Writes `autoshard.recompute` = the region's module path on every op
and collective inside a region, and `state.recompute_regions` (paths, graph order).
Runs after insert_comm/fuse_comm, so a region holds its collectives: recomputing the whole region
re-runs them, in the same order on every rank (every rank has the same regions).
`wrap_regions(gm)` (called by codegen on each rank's module) moves each region into a submodule
called through `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`: only its inputs are
saved for backward. predict counts the recompute (forward compute and forward collectives again) and
the dropped activations.

>>> import autoshard
>>> from autoshard.zoo import gpt2
>>> model, inputs, loss_fn = gpt2(n_layers=2)
>>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
...                              hints={"input:0": {"dp": "S(0)"}}, checkpoint=["layers.*"])
>>> prog.state.recompute_regions
['layers.0', 'layers.1']
>>> ops = [n for n in prog.state.gm.graph.nodes if n.op == "call_function"]
>>> gm = prog.graph(0)  # codegen wrapped each region in a Recomputed submodule
"""
from __future__ import annotations

import fnmatch
import re

import torch
import torch.utils.checkpoint
from torch import fx

from autoshard.cost.recompute_cost import region_savings
from autoshard.frontend.hints import Hints
from autoshard.ir import meta
from autoshard.ir.errors import PlanError, UserInputError
from autoshard.ir.graph_utils import copy_node
from autoshard.ir.meta import RECOMPUTE
from autoshard.passes.contract import compiler_pass
from autoshard.passes.predict import predict
from autoshard.runtime.collectives import current, use_communicator
from autoshard.runtime.rng import at_position, current_position

_LAYER_RE = re.compile(r"^(.*\.)?[A-Za-z_]\w*\.[0-9]+$")  # an element of a ModuleList / Sequential


@compiler_pass("recompute", reads=(meta.COMM, meta.SPEC),
               writes=(meta.RECOMPUTE, "state.recompute_regions", "state.hints"))
def recompute(state) -> None:
    """The pass: mark every op of each region with `autoshard.recompute` = the region's path.

    >>> sorted({n.meta.get(RECOMPUTE, "-") for n in ops})
    ['-', 'layers.0', 'layers.1']
    """
    hints = state.hints = state.hints if isinstance(state.hints, Hints) else Hints.parse(state.hints)
    option = state.options.checkpoint or hints.recompute  # a saved plan's hints carry the regions it chose
    state.recompute_regions = []
    if not option:
        return
    ops = [n for n in state.gm.graph.nodes if n.op == "call_function"]
    if option == "auto":
        regions = _auto_regions(state, ops, sorted(p for p in _module_paths(ops) if _LAYER_RE.match(p)))
    else:
        regions = checkpoint_regions(option, ops)
    regions = [r for r in regions if not any(r != o and r.startswith(o + ".") for o in regions)]  # outermost wins
    # The plan records the regions, chosen or asked for: applying the saved plan recomputes the same layers.
    hints.recompute = list(regions)
    for node in ops:
        region = region_of(node, regions)
        if region is not None:
            node.meta[RECOMPUTE] = region
    state.recompute_regions = [r for r in dict.fromkeys(n.meta.get(RECOMPUTE) for n in ops) if r]



def _module_paths(ops) -> set[str]:
    paths = set()
    for node in ops:
        parts = node.meta.get(meta.PATH, "").split(".")
        paths.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    paths.discard("")
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


def region_of(node, regions):
    """The region (of `checkpoint_regions`) whose module holds `node`, or None.

    >>> region_of(ops[0], ["layers.0"]) in ("layers.0", None)
    True
    """
    path = node.meta.get(meta.PATH, "")
    return next((r for r in regions if path == r or path.startswith(r + ".")), None)


def _auto_regions(state, ops, layers) -> list[str]:
    """Repeated layers to checkpoint until the predicted memory fits the budget (greedy by bytes saved
    per recompute second); none when it already fits."""
    budget = state.options.checkpoint_budget
    if budget is None or not layers:
        return []
    predict(state)
    memory = state.predicted["memory_bytes_per_rank"]
    members: dict = {layer: [] for layer in layers}  # each layer's ops, in one walk over their paths' prefixes
    for node in ops:
        parts = node.meta.get(meta.PATH, "").split(".")
        for end in range(1, len(parts) + 1):
            prefix = ".".join(parts[:end])
            if prefix in members:
                members[prefix].append(node)
    scored = []
    for layer in layers:
        saved, seconds = region_savings(state, members[layer])
        scored.append((-saved / max(seconds, 1e-12), layer, saved))
    chosen, savings = [], []
    for _, layer, saved in sorted(scored):
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


def wrap_regions(gm: fx.GraphModule) -> fx.GraphModule:
    """Move each checkpoint region of a rank's module into a submodule run under torch.utils.checkpoint.

    >>> gm.checkpointed_0  # codegen called it for the module docstring's gm
    Recomputed(
      region='layers.0'
      (body): Region()
    )
    """
    # A region is wrapped per pipeline stage (split_stages then gives each stage its own part).
    regions = list(dict.fromkeys((n.meta[RECOMPUTE], n.meta.get(meta.STAGE)) for n in gm.graph.nodes
                                 if RECOMPUTE in n.meta))
    for index, (region, stage) in enumerate(regions):
        _wrap_one(gm, region, stage, f"checkpointed_{index}")
    gm.graph.lint()
    gm.recompile()
    return gm


class Recomputed(torch.nn.Module):
    """A region's subgraph; forward saves only the region's inputs and recomputes the rest in backward.

    >>> type(gm.checkpointed_1).__name__, gm.checkpointed_1.region
    ('Recomputed', 'layers.1')
    """

    def __init__(self, body: fx.GraphModule, region: str):
        super().__init__()
        self.body = body
        self.region = region

    def forward(self, *inputs):
        """The region's outputs; run by the rank module (its communicator is current), as here:

        >>> loss, _ = prog.simulate(*inputs)
        >>> torch.allclose(loss, loss_fn(model(*inputs), *inputs), atol=1e-5)
        True
        """
        comm = current()  # the recompute runs in backward, outside the rank module's forward
        position = current_position()  # and draws the forward's random masks again

        def run(*args):
            with use_communicator(comm), at_position(position):
                return self.body(*args)
        # The whole region re-runs (no early stop), so every rank repeats every collective in it.
        # Random ops draw from the rank's stream at the captured position, not from torch's generator, so
        # its state need not be kept (restoring it would race with simulated ranks' seeded draws).
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            return torch.utils.checkpoint.checkpoint(run, *inputs, use_reentrant=False, preserve_rng_state=False)

    def extra_repr(self) -> str:
        """The region's module path, in the module's repr.

        >>> gm.checkpointed_0.extra_repr()
        "region='layers.0'"
        """
        return f"region={self.region!r}"


def _wrap_one(gm, region, stage, name):
    graph = gm.graph
    inside = [n for n in graph.nodes if n.meta.get(RECOMPUTE) == region and n.meta.get(meta.STAGE) == stage]
    members = set(inside)
    inputs = list(dict.fromkeys(a for n in inside for a in n.all_input_nodes if a not in members))
    outputs = [n for n in inside if any(u not in members for u in n.users)]
    order = {n: i for i, n in enumerate(graph.nodes)}
    first, last = order[inside[0]], inside[-1]
    between = [n for n in graph.nodes if first < order[n] < order[last] and n not in members]
    if any(a in members for n in between for a in n.all_input_nodes):
        raise PlanError(f"checkpoint region {region!r} is not contiguous in the graph (an op outside it uses its "
                        "values before it ends); checkpoint a smaller or a larger module")
    body = fx.Graph()
    env = {}
    for value in inputs:
        env[value] = body.placeholder(value.name)
        env[value].meta = dict(value.meta)
    for node in inside:
        env[node] = copy_node(body, node, lambda n: env[n])
    body.output(tuple(env[n] for n in outputs))
    gm.add_submodule(name, Recomputed(fx.GraphModule(gm, body, class_name="Region"), region))
    with graph.inserting_after(last):
        call = graph.call_module(name, tuple(inputs))
    if stage is not None:
        call.meta[meta.STAGE] = stage
    anchor = call
    for i, out in enumerate(outputs):
        with graph.inserting_after(anchor):
            anchor = graph.call_function(_item, (call, i))
        anchor.meta = dict(out.meta)
        out.replace_all_uses_with(anchor, delete_user_cb=lambda user: user not in members)
    for node in reversed(inside):
        graph.erase_node(node)


def _item(values, index):
    return values[index]
