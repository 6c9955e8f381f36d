"""split_stages: one rank's GraphModule cut into one GraphModule per pipeline stage.

Reads `autoshard.stage` (cut_stages) on the nodes of a per-rank module built by codegen. Stage s
takes the values crossing into it as placeholders (stage 0: the user inputs) and returns the values
later stages use — values are carried through every stage in between, because pipeline schedules
connect stage s only to s + 1 — and the last stage returns the program's `(loss, *outputs)`.
Parameters are get_attrs of the same Parameter objects the rank module holds, so a parameter used
by two stages on one rank (tied weights with virtual stages) accumulates one gradient.

>>> import autoshard
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("pp",),
...                              pipeline={"microbatches": 2})
>>> import torch
>>> from autoshard.lowering.rank_module import build_rank_module
>>> stages = split_stages(build_rank_module(prog.state, 0), 2)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from autoshard.ir import meta
from autoshard.ir.graph_utils import copy_node


@dataclass
class StageGraph:
    """Stage `index` of one rank: its GraphModule and the names of the values it takes and returns.

    >>> stages[1].inputs
    ['linear_default_1']
    """

    index: int
    gm: fx.GraphModule
    inputs: list[str]
    outputs: list[str]

    def __repr__(self) -> str:
        return f"# stage {self.index}: ({', '.join(self.inputs)}) -> ({', '.join(self.outputs)})\n{self.gm.code.strip()}"


def split_stages(gm: fx.GraphModule, num_stages: int) -> list[StageGraph]:
    """`gm` (a rank module whose nodes carry `autoshard.stage`) as `num_stages` StageGraphs, in order.

    >>> [(s.index, s.outputs) for s in stages]
    [(0, ['linear_default_1']), (1, ['div_tensor', 'add_tensor_1'])]
    >>> mb = prog.microbatches(inputs)[0]  # the program was traced at the micro-batch shape
    >>> loss, out = stages[1].gm(*stages[0].gm(*mb))  # the last stage returns (loss, *outputs)
    >>> torch.allclose(loss, loss_fn(model(*mb), *mb))
    True
    """
    nodes = list(gm.graph.nodes)
    output = next(n for n in nodes if n.op == "output")
    inputs = [n for n in nodes if n.op == "placeholder"]
    ops = [n for n in nodes if n.op in ("call_function", "call_module")]  # call_module: a recomputed region

    def defined(node) -> int:
        return node.meta[meta.STAGE] if node.op in ("call_function", "call_module") else -1

    last_use = {}
    for node in inputs + ops:
        uses = [num_stages if u.op == "output" else u.meta[meta.STAGE] for u in node.users if u.op != "get_attr"]
        last_use[node] = max(uses, default=-1)
    carried = [[v for v in inputs + ops if defined(v) <= s < last_use[v]] for s in range(num_stages)]

    stages = []
    for s in range(num_stages):
        entering = inputs if s == 0 else carried[s - 1]
        leaving = list(output.args[0]) if s == num_stages - 1 else carried[s]
        stages.append(_build_stage(gm, s, entering, [n for n in ops if n.meta[meta.STAGE] == s], leaving))
    return stages


def _build_stage(gm, s, entering, body, leaving) -> StageGraph:
    graph = fx.Graph()
    root = torch.nn.Module()
    env: dict = {}
    for node in entering:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)

    def lookup(node):
        if node not in env and node.op == "get_attr":  # parameters and buffers: same objects as the rank's
            value = getattr(gm, node.target)
            if isinstance(value, torch.nn.Parameter):
                root.register_parameter(node.target, value)
            else:
                root.register_buffer(node.target, value)
            env[node] = graph.get_attr(node.target)
            env[node].meta = dict(node.meta)
        return env[node]

    for node in body:
        if node.op == "call_module":  # a recomputed region of this stage (autoshard/passes/recompute.py)
            root.add_module(node.target, gm.get_submodule(node.target))
        for src in node.all_input_nodes:
            lookup(src)
        env[node] = copy_node(graph, node, lookup)
        env[node].meta = dict(node.meta)
    graph.output(tuple(lookup(n) if isinstance(n, fx.Node) else n for n in leaving))
    stage_gm = fx.GraphModule(root, graph, class_name=f"Stage{s}")
    return StageGraph(s, stage_gm, [n.name for n in entering],
                      [n.name if isinstance(n, fx.Node) else repr(n) for n in leaving])

