"""check_hints: say where a user's sharding hint is not realised, which op forced it and what it costs.

Reads the graph after insert_comm (collective nodes, `autoshard.spec`, `autoshard.hint`,
`autoshard.candidates`) and, when predict has run, each collective's `autoshard.comm_cost`. Writes
nothing; warns. A hinted value is one the user placed S(d) on a mesh axis (a parameter, an input, a
module output), or one the hint's sharding flowed to (an op that took a hinted value sharded on that axis
and shards its output there: `W.T`, a column-parallel linear's output). It is not realised when a
collective gathers it on that axis (all_gather, all_to_all) before an op (except an all-to-all that moves the
shard to another dim where the op meets a value another hint shards on that axis: expert parallelism's
tokens, sharded by group, moving to the experts' shards and back): that op
has no sharding rule, its rule has no strategy that keeps the sharding, or the planner found gathering
cheaper. One warning per op and reason, listing the values and the bytes and predicted seconds per step
of those gathers; each distinct warning is given once per `parallelize` call.

The example hints a column-parallel weight that an op without a rule (`i0e`) consumes:

>>> import torch
>>> import autoshard
>>> class Odd(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.w = torch.nn.Parameter(torch.randn(8, 4))
...     def forward(self, x):
...         return torch.nn.functional.linear(x, torch.special.i0e(self.w))
>>> import warnings
>>> with warnings.catch_warnings():
...     warnings.simplefilter("ignore")  # the strategies pass also warns that i0e has no rule
...     prog = autoshard.parallelize(Odd(), (2,), (torch.randn(4, 4),), axis_names=("tp",),
...                                  hints={"w": {"tp": "S(0)"}})
>>> [found] = unrealised_hints(prog.state)
>>> found.op, found.reason, found.values, found.collectives
('aten.special_i0e.default', 'has no sharding rule', ('w (node p_model_w)',), ('all_gather',))
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from autoshard.cost.flops import node_bytes
from autoshard.ir import meta
from autoshard.ir.meta import COMM_COST
from autoshard.ir.placement import Shard
from autoshard.ir.warn_once import warn_once
from autoshard.passes.contract import compiler_pass
from autoshard.strategies import tensor_inputs
from autoshard.strategies.base import REGISTRY

GATHERS = ("all_gather", "all_to_all")


@dataclass(frozen=True)
class UnrealisedHint:
    """Hinted values gathered on `axis` before one op, for one reason, with the cost of those gathers.

    >>> print(found)  # doctest: +ELLIPSIS
    autoshard: the hint S(0) on mesh axis 'tp' is not realised for w (node p_model_w): aten.special_i0e.default at <top level> (node special_i0e) has no sharding rule, so it is gathered first (all_gather on 'tp': 128 B per step, ... s predicted); register a rule ...
    """

    op: str
    reason: str
    axis: str
    hint: str
    values: tuple[str, ...]  # "path (node name)" of each hinted value gathered
    consumers: tuple[str, ...]  # "module path (node name)" of each op it was gathered for
    collectives: tuple[str, ...]
    bytes: int  # per step and rank, forward and backward
    seconds: float | None  # predicted per step; None when predict has not run

    def __str__(self) -> str:
        values = ", ".join(self.values[:3]) + (f" and {len(self.values) - 3} more" if len(self.values) > 3 else "")
        where = ", ".join(self.consumers[:3]) + (" ..." if len(self.consumers) > 3 else "")
        cost = f"{self.bytes} B per step" + (f", {self.seconds:.3g} s predicted" if self.seconds is not None else "")
        if self.reason == "has no sharding rule":
            fix = f"register a rule for {self.op} in autoshard/strategies"
        elif self.reason.startswith("has no strategy"):
            fix = f"give the rule of {self.op} a strategy that keeps the sharding, or change the hint"
        else:
            fix = f"prog.plan.explain({self.consumers[0].split(' (node')[0]!r}) lists the alternatives' costs"
        return (f"autoshard: the hint {self.hint} on mesh axis {self.axis!r} is not realised for {values}: {self.op} "
                f"at {where} {self.reason}, so it is gathered first ({'/'.join(sorted(set(self.collectives)))} on "
                f"{self.axis!r}: {cost}); {fix}")


def unrealised_hints(state) -> list[UnrealisedHint]:
    """Every gather of a hinted value, grouped by (op, reason, axis, hint); see the module docstring.

    >>> [(h.axis, h.hint, h.consumers, h.bytes) for h in unrealised_hints(prog.state)]  # 8 x 4 float32 gathered
    [('tp', 'S(0)', ('<top level> (node special_i0e)',), 128)]
    """
    graph = state.gm.graph
    names = state.mesh.names
    carried = _carried_hints(graph)
    groups: dict = {}
    for start in graph.nodes:
        if start.meta.get(meta.KIND) != "comm" or start.args[0].meta.get(meta.KIND) == "comm":
            continue
        root = start.args[0]
        chain = _chain(start)
        for axis, origin in carried.get(root, {}).items():
            gathers = [c for c in chain if c.meta[meta.COMM]["axis"] == names[axis] and c.meta[meta.COMM]["op"] in GATHERS]
            if not gathers:
                continue
            moved = all(isinstance(c.meta[meta.SPEC][axis], Shard) for c in chain)  # to another dim, not gathered
            for consumer, pos in _consumers(chain):
                if moved and _meets_another_hint(consumer, pos, axis, carried):
                    continue
                reason = _reason(consumer, pos, axis, root.meta[meta.SPEC][axis])
                key = (str(consumer.target), reason, names[axis], repr(origin.meta[meta.HINT][axis]))
                group = groups.setdefault(key, {"values": [], "consumers": [], "collectives": [], "bytes": 0,
                                                "seconds": 0.0, "predicted": True, "seen": set()})
                _add(group, f"{origin.meta.get(meta.PATH) or origin.name} (node {origin.name})", "values")
                _add(group, f"{consumer.meta.get(meta.PATH) or '<top level>'} (node {consumer.name})", "consumers")
                for comm in gathers:
                    if comm in group["seen"]:
                        continue
                    group["seen"].add(comm)
                    group["collectives"].append(comm.meta[meta.COMM]["op"])
                    cost = comm.meta.get(COMM_COST)
                    if cost is None:
                        group["predicted"] = False
                        group["bytes"] += _gathered_bytes(comm, state.mesh)
                    else:
                        group["bytes"] += cost["fwd_bytes"] + cost["bwd_bytes"]
                        group["seconds"] += cost["seconds"]
    return [UnrealisedHint(op, reason, axis, hint, tuple(g["values"]), tuple(g["consumers"]), tuple(g["collectives"]),
                           g["bytes"], g["seconds"] if g["predicted"] else None)
            for (op, reason, axis, hint), g in groups.items()]


@compiler_pass("check_hints", reads=(meta.SPEC, meta.HINT, meta.CANDIDATES, meta.COMM), writes=())
def check_hints(state) -> None:
    """The check: warn (once per `parallelize` call for each distinct message, autoshard/ir/warn_once.py) about
    every unrealised hint. Call it after predict, so the warnings carry predicted seconds.

    >>> from autoshard.ir.warn_once import warning_scope
    >>> with warnings.catch_warnings(record=True) as caught, warning_scope():
    ...     warnings.simplefilter("always")
    ...     check_hints(prog.state)
    ...     check_hints(prog.state)  # the same warning again in one call: quiet
    >>> len(caught), "aten.special_i0e.default" in str(caught[0].message)
    (1, True)
    """
    for found in unrealised_hints(state):
        warn_once(str(found))



def _carried_hints(graph: fx.Graph) -> dict:
    """node -> {axis: the hinted node}: nodes hinted S(d), and ops whose chosen strategy takes a carried input
    sharded and shards their output on that axis (the hint's sharding flowing through the graph)."""
    carried: dict = {}
    for node in graph.nodes:
        if node.meta.get(meta.KIND) == "comm" or meta.SPEC not in node.meta:
            continue
        own = {a: node for a, p in node.meta.get(meta.HINT, {}).items() if isinstance(p, Shard)}
        choice = node.meta.get(meta.CHOICE, [])
        inputs = tensor_inputs(node) if node.op == "call_function" else []
        for pos, producer in enumerate(inputs):
            for axis, origin in carried.get(producer, {}).items():
                if axis < len(choice) and isinstance(choice[axis].output, Shard) and len(choice[axis].inputs) > pos \
                        and isinstance(choice[axis].inputs[pos], Shard):
                    own.setdefault(axis, origin)
        if own:
            carried[node] = own
    return carried


def _meets_another_hint(consumer: fx.Node, pos: int, axis: int, carried: dict) -> bool:
    """Whether `consumer` takes, besides input `pos`, a value a hint shards on `axis` (sharded there)."""
    choice = consumer.meta.get(meta.CHOICE, [])
    if axis >= len(choice):
        return False
    inputs = choice[axis].inputs
    return any(q != pos and axis in carried.get(_source(producer), {}) and q < len(inputs)
               and isinstance(inputs[q], Shard) for q, producer in enumerate(tensor_inputs(consumer)))


def _source(node: fx.Node) -> fx.Node:
    """The value behind a chain of collectives (a ZeRO-3 parameter gather, a resharding)."""
    while node.meta.get(meta.KIND) == "comm":
        node = node.args[0]
    return node


def _chain(start: fx.Node) -> list[fx.Node]:
    """The collectives insert_comm chained from `start` (each feeds the next)."""
    chain = [start]
    while True:
        following = [u for u in chain[-1].users if u.meta.get(meta.KIND) == "comm" and u.args[0] is chain[-1]]
        if not following:
            return chain
        chain.append(following[0])


def _consumers(chain) -> list[tuple[fx.Node, int]]:
    """(op, tensor input position) of every non-collective use of the chain's values."""
    found = []
    for comm in chain:
        for user in comm.users:
            if user.meta.get(meta.KIND) != "comm":
                found += [(user, pos) for pos, n in enumerate(tensor_inputs(user)) if n is comm]
    return found


def _reason(consumer: fx.Node, pos: int, axis: int, placement) -> str:
    if REGISTRY.lookup(consumer.target) is None:
        return "has no sharding rule"
    candidates = consumer.meta.get(meta.CANDIDATES, [])
    if axis < len(candidates) and not any(len(c.inputs) > pos and c.inputs[pos] == placement
                                          for c in candidates[axis]):
        return f"has no strategy that takes this input as {placement!r}"
    blocker = _first_blocker(consumer, pos, axis, placement)
    later = f"{blocker.target} after it cannot keep that sharding" if blocker is not None else "ops after it need it whole"
    return f"could keep the sharding, but the plan found gathering first cheaper ({later})"


def _first_blocker(consumer: fx.Node, pos: int, axis: int, placement, limit: int = 5000):
    """Follow the sharding forward from `consumer` as if it had been kept: through every candidate on `axis` that
    takes an arriving S(d) and makes an S(d') (a partial or replicated output ends the flow). The first op (graph
    order) that no candidate lets take what arrives on some input is the one that makes the plan gather early."""
    reach = {consumer: set()}
    for c in consumer.meta.get(meta.CANDIDATES, [[]] * (axis + 1))[axis]:
        if len(c.inputs) > pos and c.inputs[pos] == placement and isinstance(c.output, Shard):
            reach[consumer].add(c.output)
    node, seen = consumer.next, 0
    while node.op != "output" and seen < limit:
        seen += 1
        arriving = [(q, reach[n]) for q, n in enumerate(tensor_inputs(node)) if reach.get(n)]
        candidates = node.meta.get(meta.CANDIDATES, [])
        if arriving and axis < len(candidates):
            outputs = set()
            for q, placements in arriving:
                taking = [c for c in candidates[axis] if len(c.inputs) > q and c.inputs[q] in placements]
                if not taking:
                    return node
                outputs |= {c.output for c in taking if isinstance(c.output, Shard)}
            reach[node] = outputs
        node = node.next
    return None


def _gathered_bytes(comm: fx.Node, mesh) -> int:
    split = 1
    for axis, placement in enumerate(comm.meta[meta.SPEC]):
        if isinstance(placement, Shard):
            split *= mesh.shape[axis]
    return node_bytes(comm) // split


def _add(group: dict, text: str, field: str) -> None:
    if text not in group[field]:
        group[field].append(text)
