"""What a pipeline schedule does on each pp rank, for the cost model: the order of its actions and the
memory a rank holds — its stages' parameters, gradients and optimizer state, and the activations of the
micro-batches in flight (forward done, backward not yet), which the action order alone decides.

An action is `(stage, kind, micro-batch)` with kind "F" (forward), "B" (full backward), "I" (input-gradient
backward) or "W" (weight-gradient backward) — torch.distributed.pipelining's actions. GPipe and 1F1B are
written out here; multi-stage schedules (interleaved, zero-bubble) are read from torch's own `pipeline_order`,
the code the runtime runs.

>>> import autoshard
>>> from autoshard.program.pipeline import PipelineConfig
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=4)
>>> pipe = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("pp",), pipeline={"microbatches": 4})
>>> config = PipelineConfig("pp", 2, 4, "1F1B")
>>> schedule_order(config)[0][:4]  # rank 0 runs one forward ahead before it alternates
[(0, 'F', 0), (0, 'F', 1), (0, 'B', 0), (0, 'F', 2)]
>>> [peak_in_flight(order, {0: 10, 1: 10}) for order in schedule_order(config).values()]  # 2 on rank 0, 1 on rank 1
[20, 10]
"""
from __future__ import annotations

import itertools

import torch

from autoshard.cost.axis_cost import needs_grad
from autoshard.cost.flops import local_bytes
from autoshard.cost.prediction import node_cost
from autoshard.cost.recompute_cost import region_savings
from autoshard.cost.zero_cost import memory_breakdowns
from autoshard.ir import meta
from autoshard.ir.errors import PlanError
from autoshard.ir.meta import RECOMPUTE


def param_share(config, in_layer: bool = True) -> float:
    """The share of a parameter (with its gradient and optimizer state) the fullest pp rank of a micro-batch
    program holds, as counted before the cut exists (solve's memory row, the recompute pass's budget check): an
    even split over the pp ranks for a parameter of the repeated layers (`in_layer`); one outside them (the
    embedding, the head, a final norm) sits whole on the stage that uses it, and is counted whole (the first and
    last ranks hold the embedding and the head besides their layers). `config` is a PipelineConfig, None for a
    program that does not pipeline. After the cut, `rank_memory` counts each rank's own stages.

    >>> from autoshard.program.pipeline import PipelineConfig
    >>> param_share(None), param_share(PipelineConfig("pp", 4, 8)), param_share(PipelineConfig("pp", 4, 8), False)
    (1.0, 0.25, 1.0)
    """
    return 1.0 if config is None or not in_layer else 1.0 / config.pp_size


def activation_share(config) -> float:
    """The activations the fullest pp rank keeps in flight, in micro-batches through the whole model, as counted
    before the cut exists (solve's memory row, the recompute pass's budget check), with stages assumed equal: the
    peak of each rank's action order (`peak_in_flight`). 1F1B's first rank keeps p micro-batches of its 1/p of the
    layers (1.0); GPipe keeps all m (m/p); interleaved 1F1B's first rank more than one. 1.0 for a program that does
    not pipeline (`config` None). After the cut, `rank_memory` counts each rank's own stages.

    >>> from autoshard.program.pipeline import PipelineConfig
    >>> [activation_share(PipelineConfig("pp", 4, 8, schedule)) for schedule in ("1F1B", "GPipe")]
    [1.0, 2.0]
    >>> activation_share(PipelineConfig("pp", 2, 4, "Interleaved1F1B", virtual=2))
    1.25
    """
    if config is None:
        return 1.0
    n = config.num_stages
    orders = schedule_order(config)
    equal = dict.fromkeys(range(n), 1.0 / n)
    return round(max(peak_in_flight(orders.get(rank, []), equal) for rank in range(config.pp_size)), 9)


def pre_cut_memory(predicted, config, whole_bytes: float = 0.0) -> float:
    """Bytes one pp rank is expected to hold before the cut: its `param_share` of the parameters, gradients and
    optimizer state (`whole_bytes` of them outside the repeated layers, counted whole), its `activation_share` of
    the activations, and every other part in full. `predicted` is a Prediction.

    >>> pre_cut_memory(pipe.plan.predicted, None) == pipe.plan.predicted.memory_bytes_per_rank
    True
    """
    if config is None or not predicted.memory:
        return predicted.memory_bytes_per_rank
    parts = predicted.memory
    held = parts.params + parts.grads + parts.optimizer
    return (predicted.memory_bytes_per_rank - (1 - param_share(config)) * max(held - whole_bytes, 0.0)
            + (activation_share(config) - 1) * parts.activations)


def schedule_order(config) -> dict[int, list[tuple]]:
    """{pp rank: [(stage, kind, microbatch), ...]} in the order the schedule runs them.

    >>> from autoshard.program.pipeline import PipelineConfig
    >>> schedule_order(PipelineConfig("pp", 2, 2, "1F1B"))[0]
    [(0, 'F', 0), (0, 'F', 1), (0, 'B', 0), (0, 'B', 1)]
    """
    p, m = config.pp_size, config.microbatches
    if config.schedule == "GPipe":
        return {r: [(r, "F", i) for i in range(m)] + [(r, "B", i) for i in range(m)] for r in range(p)}
    if config.schedule == "1F1B":
        orders = {}
        for r in range(p):
            warmup = min(p - 1 - r, m)
            order = [(r, "F", i) for i in range(warmup)]
            f, b = warmup, 0
            while b < m:
                if f < m:
                    order.append((r, "F", f))
                    f += 1
                order.append((r, "B", b))
                b += 1
            orders[r] = order
        return orders
    return _torch_order(config)


class _StageShape:
    """What torch's multi-stage schedules read from a stage to compute their action order."""

    def __init__(self, index, num_stages, pp_size, rank):
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, num_stages, pp_size, rank
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.submod = torch.nn.Identity()
        self.stage_index_to_group_rank = None
        self.has_backward = True
        self.dw_builder = None


_ORDERS: dict = {}  # (schedule, pp size, micro-batches, stages per rank) -> action order: the search asks again and
_ORDERS_KEPT = 64   # again (each candidate's cut, memory and timeline), torch builds it in milliseconds to seconds


def _torch_order(config) -> dict[int, list[tuple]]:
    """The action order torch.distributed.pipelining computes for a multi-stage schedule (the same code
    the runtime runs), read from its `pipeline_order` with stand-in stages; computed once per schedule shape."""
    key = (config.schedule, config.pp_size, config.microbatches, config.virtual)
    if key not in _ORDERS:
        if len(_ORDERS) >= _ORDERS_KEPT:
            _ORDERS.clear()
        _ORDERS[key] = _read_torch_order(config)
    return _ORDERS[key]


def _read_torch_order(config) -> dict[int, list[tuple]]:
    from torch.distributed.pipelining.schedules import get_schedule_class
    cls = get_schedule_class(config.schedule)
    stages = [_StageShape(s, config.num_stages, config.pp_size, 0) for s in config.stages_of(0)]
    try:
        schedule = cls(stages, config.microbatches, loss_fn=lambda out, target: out)
        order = schedule.pipeline_order
    except Exception as exc:  # torch internals changed: say so instead of guessing
        raise PlanError(f"cannot read the action order of torch's {config.schedule} schedule ({exc}); the planned "
                        "timeline needs torch.distributed.pipelining's pipeline_order") from exc
    return {r: [(a.stage_index, str(a.computation_type).split(".")[-1].replace("FULL_BACKWARD", "B")
                 .replace("FORWARD", "F").replace("BACKWARD_INPUT", "I").replace("BACKWARD_WEIGHT", "W")[0],
                 a.microbatch_index) for a in actions if a is not None]
            for r, actions in order.items()}


def peak_in_flight(order: list[tuple], activations: dict) -> float:
    """The most activation bytes a rank keeps at once running `order` (its actions), given the bytes one
    micro-batch keeps for backward on each stage: a forward adds its stage's, a full or weight-gradient backward
    frees them (an input-gradient backward still leaves the saved inputs to the weight gradient).

    >>> peak_in_flight([(0, "F", 0), (0, "F", 1), (0, "B", 0), (0, "B", 1)], {0: 5})
    10
    """
    live, peak = 0, 0
    for stage, kind, _ in order:
        if kind == "F":
            live += activations.get(stage, 0)
            peak = max(peak, live)
        elif kind in ("B", "W"):
            live -= activations.get(stage, 0)
    return peak


def rank_memory(state, config) -> list[dict]:
    """Per pp rank of a pipeline's micro-batch program (after cut_stages), the bytes one device holds, as
    `plan.predicted["memory"]` splits them: {"params", "grads", "optimizer", "gathered", "inputs",
    "activations"}. A rank holds its stages' parameters (a parameter two stages use, once per stage, as torch's
    stages do), the inputs of every micro-batch its stages read, and the activations of its micro-batches in
    flight (`peak_in_flight` of its action order) plus, under recomputation, its largest region live again
    during its recompute.

    >>> [sorted(parts) for parts in rank_memory(pipe.state, pipe.config)][:1]  # pipe: see the module docstring
    [['activations', 'gathered', 'grads', 'inputs', 'optimizer', 'params']]
    """
    grad = needs_grad(state.gm.graph)
    per_stage = stage_nodes(state, config.num_stages)
    kept, largest = stage_activations(state, per_stage)
    orders = schedule_order(config)
    held = rank_nodes(config, per_stage)
    out = []
    for rank, (nodes, parts) in enumerate(zip(held, memory_breakdowns(state, held))):
        stages = config.stages_of(rank)
        parts["inputs"] = config.microbatches * sum(local_bytes(n, n.meta[meta.SPEC], state.mesh) for n in nodes
                                                    if n.op == "placeholder" and n.meta.get(meta.KIND) == "input")
        parts["params"] += sum(local_bytes(n, n.meta[meta.SPEC], state.mesh) for n in nodes  # frozen: held as is
                               if n.op == "placeholder" and n.meta.get(meta.KIND) in ("param", "buffer")
                               and not grad.get(n))
        parts["activations"] = int(peak_in_flight(orders.get(rank, []), kept)
                                   + max((largest[s] for s in stages), default=0))
        out.append(parts)
    return out


def stage_nodes(state, num_stages: int) -> list[set]:
    """Each stage's ops and the placeholders they read.

    >>> [len(nodes) > 0 for nodes in stage_nodes(pipe.state, 2)]
    [True, True]
    """
    out = [set() for _ in range(num_stages)]
    for node in state.gm.graph.nodes:
        if node.op == "call_function" and meta.STAGE in node.meta:
            out[node.meta[meta.STAGE]].add(node)
            out[node.meta[meta.STAGE]].update(a for a in node.all_input_nodes if a.op == "placeholder")
    return out


def rank_nodes(config, per_stage: list[set]) -> list[set]:
    """Each pp rank's nodes: the union of its stages' (`stage_nodes`).

    >>> [len(nodes) > 0 for nodes in rank_nodes(pipe.config, stage_nodes(pipe.state, 2))]
    [True, True]
    """
    return [set().union(*(per_stage[s] for s in config.stages_of(rank))) for rank in range(config.pp_size)]


def stage_activations(state, per_stage) -> tuple[dict, dict]:
    """({stage: bytes one micro-batch keeps for backward}, {stage: its largest recompute region's bytes}):
    predict's per-op figures (`autoshard.node_cost`), less what each checkpoint region does not keep.

    >>> kept, largest = stage_activations(pipe.state, stage_nodes(pipe.state, 2))
    >>> kept[0] > 0, largest  # no recomputation
    (True, {0: 0, 1: 0})
    """
    kept, largest = {}, {}
    order = {n: i for i, n in enumerate(state.gm.graph.nodes)}  # one walk of the graph, not one per stage
    for stage, nodes in enumerate(per_stage):
        ops = sorted((n for n in nodes if n.op == "call_function"), key=order.__getitem__)
        regions: dict = {}
        for node in ops:
            if node.meta.get(RECOMPUTE):
                regions.setdefault(node.meta[RECOMPUTE], []).append(node)
        savings = [region_savings(state, members)[0] for members in regions.values()]
        kept[stage] = sum(node_cost(n).memory_bytes for n in ops) - sum(savings)
        largest[stage] = max(savings, default=0)
    return kept, largest


class StageMemory:
    """The automatic cut's memory model (autoshard/passes/auto_cut.py): the bytes a stage [a, b) of the op sequence
    `nodes` (`index`: each op's position in it, ops left out at their first user's) adds to its pp rank,
    its parameters (with their gradients and optimizer state, predict's per-parameter bytes, at their first user)
    and the activations its rank keeps for that stage's micro-batches in flight under the schedule (predict's
    per-op bytes less what recomputed regions do not keep). A rank's stages add up to at least its peak (the
    stages' peaks may fall at different times): the caps scale them by the rank's own figure, and rank_memory
    remains the check of the cut.

    >>> ops = [n for n in pipe.state.gm.graph.nodes if n.op == "call_function"]
    >>> memory = StageMemory(pipe.state, ops, pipe.config, {n: i for i, n in enumerate(ops)})
    >>> len(memory.in_flight) == pipe.config.num_stages and memory.in_flight[0] >= memory.in_flight[-1]
    True
    """

    def __init__(self, state, nodes, config, index: dict):
        n = len(nodes)
        held, kept = [0.0] * n, [0.0] * n
        regions: dict = {}
        for node in state.gm.graph.nodes:
            if node.op == "placeholder" and node.meta.get(meta.KIND) in ("param", "buffer"):
                users = [index[u] for u in node.users if u in index]
                if users:
                    held[min(min(users), n - 1)] += node_cost(node).memory_bytes
            elif node.op == "call_function":
                kept[min(index[node], n - 1)] += node_cost(node).memory_bytes
                if node.meta.get(meta.RECOMPUTE):
                    regions.setdefault(node.meta[meta.RECOMPUTE], []).append(node)
        for members in regions.values():  # a region's savings where its members keep their bytes
            saved, weights = region_savings(state, members)[0], [max(node_cost(m).memory_bytes, 0) for m in members]
            total = sum(weights)
            if not total:
                kept[min(max(index[m] for m in members), n - 1)] -= saved
                continue
            for member, weight in zip(members, weights):
                kept[min(index[member], n - 1)] -= saved * weight / total
        self.held, self.kept = [0.0], [0.0]
        for h, k in zip(held, kept):
            self.held.append(self.held[-1] + h)
            self.kept.append(self.kept[-1] + k)
        self.config = config
        orders = schedule_order(config)
        self.in_flight = [peak_in_flight(orders.get(config.stage_rank(s), []), {s: 1})
                          for s in range(config.num_stages)]

    def stage_bytes(self, stage: int, a: int, b: int) -> float:
        """What ops [a, b) as stage `stage` add to their rank.

        >>> ops = [n for n in pipe.state.gm.graph.nodes if n.op == "call_function"]
        >>> one = StageMemory(pipe.state, ops, PipelineConfig("pp", 2, 4, "1F1B"), {n: i for i, n in enumerate(ops)})
        >>> one.stage_bytes(0, 0, len(ops)) > one.stage_bytes(1, 0, len(ops))  # two in flight, not one
        True
        """
        return (self.held[b] - self.held[a]) + self.in_flight[stage] * (self.kept[b] - self.kept[a])

    def caps(self, budget: float, ranks: list, bounds: list) -> list[float]:
        """Each stage's cap, from what it adds to its rank when cut at `bounds` (a cut's ends, first 0, last n) and
        how far the rank's bytes there (`ranks`, per pp rank, as rank_memory counts them) are from `budget`: the
        stages of an overfull rank must each shrink by the rank's excess ratio; each stage of a rank with room may
        grow by all of it (rank_memory checks the sum).

        >>> ops = [n for n in pipe.state.gm.graph.nodes if n.op == "call_function"]
        >>> one = StageMemory(pipe.state, ops, PipelineConfig("pp", 2, 4, "1F1B"), {n: i for i, n in enumerate(ops)})
        >>> caps = one.caps(100.0, [200.0, 50.0], [0, 3, len(ops)])
        >>> caps[0] == one.stage_bytes(0, 0, 3) / 2, caps[1] == one.stage_bytes(1, 3, len(ops)) * 2
        (True, True)
        """
        config = self.config
        filled = [self.stage_bytes(s, a, b) for s, (a, b) in enumerate(itertools.pairwise(bounds))]
        estimated = [sum(filled[t] for t in config.stages_of(r)) for r in range(config.pp_size)]
        caps = []
        for s, stage_bytes in enumerate(filled):
            r = config.stage_rank(s)
            scale = estimated[r] / max(ranks[r], 1.0)  # this model's bytes per byte rank_memory counts
            caps.append(stage_bytes * budget / max(ranks[r], 1.0) if ranks[r] > budget
                        else stage_bytes + (budget - ranks[r]) * scale)
        return caps
