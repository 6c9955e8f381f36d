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

import torch

from autoshard.cost.axis_cost import needs_grad
from autoshard.cost.flops import local_bytes
from autoshard.cost.prediction import node_cost
from autoshard.cost.recompute_cost import region_savings
from autoshard.cost.zero_cost import memory_breakdown
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
    out = []
    for rank in range(config.pp_size):
        stages = config.stages_of(rank)
        nodes = set().union(*(per_stage[s] for s in stages))
        parts = memory_breakdown(state, within=nodes)
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
