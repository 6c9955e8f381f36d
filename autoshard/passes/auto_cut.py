"""The automatic pipeline cut: contiguous stages of the op sequence minimising the slowest stage's time (then the bytes
crossing the cuts), by dynamic programming over the candidate positions (autoshard/solver/balanced_cut.py), each stage
within its pp rank's memory where the fastest cut overfills one. Its cost model (`CutCosts`): per op its predicted
seconds (`autoshard.node_cost`, written by predict, recomputation included), per position the values and gradients
that cross it (`boundary_bytes`). cut_stages (autoshard/passes/cut_stages.py) applies the cut.

The examples cut a three-layer MLP into two stages:

>>> import autoshard
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=3)
>>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("pp",),
...                              pipeline={"microbatches": 2})
>>> state, config = prog.state, prog.config
>>> nodes = [n for n in state.gm.graph.nodes if n.op == "call_function"]
"""
from __future__ import annotations

import itertools

import torch

from autoshard.cost.axis_cost import needs_grad
from autoshard.cost.flops import local_bytes
from autoshard.cost.pipeline_schedule import StageMemory
from autoshard.cost.recompute_cost import op_seconds
from autoshard.frontend.cut_points import find_layers, module_stack
from autoshard.ir import meta
from autoshard.ir.errors import PlanError
from autoshard.solver.balanced_cut import min_max_cut

AUTO_CUT_ALL_POSITIONS = 400  # up to this many ops every position is a candidate cut; above, module boundaries


def carried_values(graph):
    """(node, whether it is a user input) of each value a pipeline may carry across its stage boundaries: every op's
    output, and every user input (inputs enter at the first stage and are carried to their users).

    >>> [node.name for node, is_input in carried_values(state.gm.graph) if is_input]
    ['inputs_0']
    """
    for node in graph.nodes:
        if node.op == "call_function":
            yield node, False
        elif node.op == "placeholder" and node.meta.get(meta.KIND) == "input":
            yield node, True


def boundary_bytes(state, nodes) -> tuple[list[int], list[int], list[bool], list[int], list[int]]:
    """Per cut position k (before nodes[k], k = 0..n): bytes of the values crossing it, bytes of their
    gradients, whether the position is allowed (no tuple crosses it), and how many tensors cross it each way (each
    is a message of its own). An op left out of `nodes` (a weight-only op) counts as computed where `op_positions`
    puts it: with its first user.

    >>> fwd, bwd, ok, fwd_n, bwd_n = boundary_bytes(state, nodes)
    >>> len(fwd) == len(nodes) + 1, fwd[3], bwd[3], fwd_n[3]  # after layers.0's linear + bias + GELU: 4 x 128 floats
    (True, 2048, 2048, 1)
    """
    n = len(nodes)
    index = op_positions(state.gm.graph, nodes)
    fwd, bwd, bad = [0] * (n + 2), [0] * (n + 2), [0] * (n + 2)
    fwd_n, bwd_n = [0] * (n + 2), [0] * (n + 2)
    grads = needs_grad(state.gm.graph)  # stored in node meta by normalize: read, not re-analysed
    for node, is_input in carried_values(state.gm.graph):
        first = 0 if is_input else index[node] + 1
        uses = [index.get(u, n) for u in node.users]  # the output node counts as after the last op
        if not uses:
            continue
        last = max(uses)
        if last < first:
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            size = local_bytes(node, node.meta[meta.SPEC], state.mesh)
            grad = bool(grads.get(node))
            for arr, amount in ((fwd, size), (bwd, size if grad else 0), (fwd_n, 1), (bwd_n, int(grad))):
                arr[first] += amount
                arr[last + 1] -= amount
        else:
            bad[first] += 1
            bad[last + 1] -= 1
    return (*(list(itertools.accumulate(arr[:n + 1])) for arr in (fwd, bwd)),
            [x == 0 for x in itertools.accumulate(bad[:n + 1])],
            *(list(itertools.accumulate(arr[:n + 1])) for arr in (fwd_n, bwd_n)))


def weight_only_ops(nodes) -> set:
    """The ops computed from parameters, buffers and constants alone (a weight's cast under mixed precision,
    which the trace puts before every layer): the automatic cut leaves them out and `_fill_and_check` puts
    each in the stage of its first user, so that a stage holds its own weights instead of receiving them.

    >>> weight_only_ops(nodes)  # the MLP computes everything from its input
    set()
    """
    out: set = set()
    for node in nodes:
        if all(i in out or (i.op == "placeholder" and i.meta.get(meta.KIND) != "input")
               for i in node.all_input_nodes):
            out.add(node)
    return out


def op_positions(graph, nodes) -> dict:
    """{op: its position in `nodes`} for every op of the graph; an op left out of `nodes` takes the position of
    its earliest user that is in (through left-out users), len(nodes) when only the output uses it.

    >>> op_positions(state.gm.graph, nodes[1:])[nodes[0]]  # the first linear goes with its user, the bias add
    0
    """
    where = {node: i for i, node in enumerate(nodes)}
    for node in reversed(graph.nodes):
        if node.op == "call_function" and node not in where:
            where[node] = min((where.get(u, len(nodes)) for u in node.users), default=len(nodes))
    return where


def candidate_positions(nodes, ok, layers=None) -> list[int]:
    """Where a cut may go: every allowed position for small graphs, else where the block changes: a
    repeated layer at any depth (`frontend/cut_points.find_layers`: 'inner.model.layers.3' in a wrapped
    model), outside the layers the first two components of the innermost module path ('lm_head').

    >>> candidate_positions(nodes, boundary_bytes(state, nodes)[2])[:4]
    [1, 2, 3, 4]
    """
    n = len(nodes)
    if n <= AUTO_CUT_ALL_POSITIONS:
        return [k for k in range(1, n) if ok[k]]
    layers = find_layers(nodes) if layers is None else layers

    def block(node):
        layer = layers.layer_of(node)
        if layer:
            return layer
        stack = module_stack(node)
        return ".".join(stack[-1].split(".")[:2]) if stack else ""

    blocks = [block(node) for node in nodes]
    return [k for k in range(1, n) if ok[k] and blocks[k] != blocks[k - 1]]


class CutCosts:
    """The automatic cut's cost model over the op sequence `nodes`: stage time of ops [a, b) = their
    compute + intra-op communication + the transfers across both ends (forward values and gradients).

    >>> costs = CutCosts(state, nodes, config)
    >>> costs.stage_time(0, 3) > costs.prefix[3]  # layers.0's compute plus sending its output
    True
    """

    def __init__(self, state, nodes, config):
        self.nodes = nodes
        self.n = len(nodes)
        self.fwd_bytes, self.bwd_bytes, self.allowed, self.fwd_tensors, self.bwd_tensors = boundary_bytes(state, nodes)
        seconds = [op_seconds(state, node) for node in nodes] + [0.0]  # a checkpointed op's recompute included
        for node, k in op_positions(state.gm.graph, nodes).items():  # ops left out run with their first user
            if k >= self.n or nodes[k] is not node:
                seconds[min(k, self.n - 1)] += op_seconds(state, node)
        self.prefix = [0.0]
        for t in seconds[:-1]:
            self.prefix.append(self.prefix[-1] + t)
        self.link, self.config = config.link, config
        self.layers = find_layers(nodes)
        self.positions = [0] + candidate_positions(nodes, self.allowed, self.layers) + [self.n]

    def transfer(self, k: int) -> float:
        """Seconds to send the values crossing position `k` forward and their gradients back (0 at the ends), each
        tensor beyond the first each way a message of its own (`PipelineConfig.message_seconds`).

        >>> costs = CutCosts(state, nodes, config)
        >>> costs.transfer(0), costs.transfer(3) > 0
        (0.0, True)
        """
        if k in (0, self.n):
            return 0.0
        return 2 * self.link.alpha + (self.fwd_bytes[k] + self.bwd_bytes[k]) / self.link.bandwidth \
            + self.config.message_seconds(self.fwd_tensors[k]) + self.config.message_seconds(self.bwd_tensors[k])

    def stage_time(self, a: int, b: int) -> float:
        """Seconds of a stage running ops [a, b): compute, intra-op communication and both transfers.

        >>> costs = CutCosts(state, nodes, config)
        >>> costs.stage_time(0, 3) == costs.prefix[3] + costs.transfer(3)
        True
        """
        return self.prefix[b] - self.prefix[a] + self.transfer(a) + self.transfer(b)

    def max_stage_time(self, cuts) -> float:
        """The slowest stage's seconds when stages begin at `cuts` (what the automatic cut minimises).

        >>> costs = CutCosts(state, nodes, config)
        >>> costs.max_stage_time([3]) == max(costs.stage_time(0, 3), costs.stage_time(3, costs.n))
        True
        """
        bounds = [0, *cuts, self.n]
        return max(self.stage_time(a, b) for a, b in itertools.pairwise(bounds))


def cut_costs(state, nodes, config) -> CutCosts:
    """The CutCosts of the ops `nodes` less their weight-only ops (`weight_only_ops`: cut_stages puts each with its
    first user), which the automatic cut cuts.

    >>> len(cut_costs(state, nodes, config).nodes) == len(nodes) - len(weight_only_ops(nodes))
    True
    """
    floating = weight_only_ops(nodes)
    return CutCosts(state, [n for n in nodes if n not in floating], config)


def auto_cut(state, nodes, config, fill: tuple | None = None, costs: CutCosts | None = None) -> dict | None:
    """Contiguous stages minimising (max stage time, total crossing bytes) by dynamic programming over
    the candidate positions (exact over them: O(stages x positions^2)). With `fill` (the budget, and each pp rank's
    bytes under the fastest cut) each stage must also fit its cap (`StageMemory.caps`); None when no cut does.
    `costs`: `cut_costs(state, nodes, config)` when made already.

    >>> auto_cut(state, nodes, config) == {n: n.meta[meta.STAGE] for n in nodes}  # what cut_stages chose
    True
    """
    costs = costs or cut_costs(state, nodes, config)
    nodes = costs.nodes
    positions, stages = costs.positions, config.num_stages
    if len(positions) - 1 < stages:
        found = (f"its {len(costs.layers)} repeated layers are in {', '.join(map(repr, costs.layers.containers))}"
                 if costs.layers.containers else "no repeated layers found (a ModuleList or nn.Sequential of "
                 "blocks of one class, each using the one before)")
        raise PlanError(f"the model has {len(positions) - 1} places to cut but the pipeline needs {stages} stages "
                        f"({found}); use fewer stages (a smaller pp axis or fewer virtual stages) or name the "
                        "cuts (pipeline={'split_points': [...]})")
    cuts = min_max_cut(costs.stage_time, positions, stages, crossing=lambda b: costs.fwd_bytes[b])
    if fill is not None:
        memory = StageMemory(state, nodes, config, op_positions(state.gm.graph, nodes))
        caps = memory.caps(*fill, [0, *cuts, costs.n])
        cuts = min_max_cut(costs.stage_time, positions, stages, crossing=lambda b: costs.fwd_bytes[b],
                           fits=lambda s, a, b: memory.stage_bytes(s, a, b) <= caps[s])
    return None if cuts is None else stages_from_cuts(nodes, cuts)


def stages_from_cuts(nodes, cuts) -> dict:
    """Stage of each op when a new stage begins at every position in the sorted `cuts`.

    >>> list(stages_from_cuts(nodes[:4], [1, 3]).values())
    [0, 1, 1, 2]
    """
    stage, k = {}, 0
    for i, node in enumerate(nodes):
        while k < len(cuts) and i >= cuts[k]:
            k += 1
        stage[node] = k
    return stage
