"""Activation checkpointing on a rank's module: each region the recompute pass chose (`autoshard.recompute` on its
ops) becomes a submodule called through `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`: only its
inputs are saved for backward, and backward runs the whole region again, collectives and random draws included.

>>> import autoshard
>>> from autoshard.zoo import gpt2
>>> model, inputs, loss_fn = gpt2(n_layers=2)
>>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
...                              hints={"input:0": {"dp": "S(0)"}}, checkpoint=["layers.*"])
>>> gm = prog.graph(0)  # build_rank_module wrapped each region in a Recomputed submodule
"""
from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import fx

from autoshard.ir import meta
from autoshard.ir.errors import PlanError
from autoshard.ir.graph_utils import copy_node
from autoshard.ir.meta import RECOMPUTE
from autoshard.runtime.collectives import current, use_communicator
from autoshard.runtime.rng import at_position, current_position
from autoshard.strategies import mutated_positions, tensor_inputs


def wrap_regions(gm: fx.GraphModule) -> fx.GraphModule:
    """Move each checkpoint region of a rank's module into a submodule run under torch.utils.checkpoint.

    >>> gm.checkpointed_0  # build_rank_module called it for the module docstring's gm
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

    def __init__(self, body: fx.GraphModule, region: str, snapshot: tuple = ()):
        super().__init__()
        self.body = body
        self.region = region
        self.snapshot = snapshot  # positions of inputs written in place after the region (see _written_later)

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
        # an input the graph writes in place later (a BatchNorm's running statistics, updated at the step's end) is
        # saved as it was here: the recompute must see what the forward saw, and autograd refuses a changed input
        inputs = tuple(x.clone() if i in self.snapshot else x for i, x in enumerate(inputs))
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
    # In-place writes into values from outside the region (a BatchNorm's running statistics) run once, after it:
    # replayed in backward they would update the statistics twice
    region_nodes = set(inside)
    writes = [n for n in inside if n.op == "call_function" and not n.users
              and any(tensor_inputs(n)[pos] not in region_nodes for pos in mutated_positions(n))]
    inside = [n for n in inside if n not in writes]
    if not inside:
        return
    members = set(inside)
    inputs = list(dict.fromkeys(a for n in inside for a in n.all_input_nodes if a not in members))
    outputs = [n for n in inside if any(u not in members for u in n.users)]
    order = {n: i for i, n in enumerate(graph.nodes)}
    first, last = order[inside[0]], inside[-1]
    between = [n for n in graph.nodes if first < order[n] < order[last] and n not in members and n not in writes]
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
    module = Recomputed(fx.GraphModule(gm, body, class_name="Region"), region)
    gm.add_submodule(name, module)
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
    for write in writes:  # after the region's outputs they read
        anchor.append(write)
        anchor = write
    for node in reversed(inside):
        graph.erase_node(node)
    written = _written_later(graph, call)
    module.snapshot = tuple(i for i, value in enumerate(inputs) if value in written)


def _written_later(graph: fx.Graph, last: fx.Node) -> set:
    """The values an op after `last` writes in place (e.g. `copy_` of a buffer's new running statistics)."""
    after, written = False, set()
    for node in graph.nodes:
        if after and node.op == "call_function":
            inputs = tensor_inputs(node)
            written.update(inputs[pos] for pos in mutated_positions(node))
        after = after or node is last
    return written


def _item(values, index):
    return values[index]
