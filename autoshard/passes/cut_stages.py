"""cut_stages: the pipeline stage of every node, from the user's annotations or a cost-balanced cut.

Reads `state.options.pipeline` (a PipelineConfig: number of stages, micro-batches, schedule, the
user's StageAnnotations or None) and, for the automatic cut, `autoshard.node_cost` written by
`predict` (so the communication that insert_comm actually emitted is balanced too). Writes
`autoshard.stage` on every node and `state.pipeline_stages` (one summary dict per stage).
Invariant: along every edge the producer's stage <= the consumer's; every stage has work; a
multi-output node and its getitems share a stage (a tuple never crosses a stage boundary).

Runs after `predict` rather than before insert_comm (DESIGN.md's order) for that reason: the cut
balances the plan's real collectives, not an estimate of them.

The examples cut a three-layer MLP into two stages automatically:

>>> import autoshard
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=3)
>>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("pp",),
...                              pipeline={"microbatches": 2})
>>> state, config = prog.state, prog.config
>>> nodes = [n for n in state.gm.graph.nodes if n.op == "call_function"]
"""
from __future__ import annotations

import difflib
import fnmatch
import itertools
import operator

import torch

from autoshard.cost.axis_cost import data_parallel_bucket_bytes, needs_grad
from autoshard.cost.collective_time import collective_latency
from autoshard.cost.flops import local_bytes
from autoshard.cost.pipeline_schedule import (
    StageMemory,
    rank_memory,
    stage_activations,
    stage_nodes,
)
from autoshard.cost.prediction import MemoryParts, node_cost
from autoshard.cost.recompute_cost import op_seconds
from autoshard.cost.sync_buckets import bucket_correction, tied_sync_seconds
from autoshard.cost.zero_cost import gather_seconds, reduce_scatter_shares
from autoshard.frontend.cut_points import find_layers
from autoshard.frontend.request import CompileOptions
from autoshard.ir import meta
from autoshard.ir.errors import PlanError, UserInputError
from autoshard.passes.contract import compiler_pass
from autoshard.passes.predict import collective_bytes
from autoshard.solver.balanced_cut import min_max_cut

AUTO_CUT_ALL_POSITIONS = 400  # up to this many ops every position is a candidate cut; above, module boundaries


@compiler_pass("cut_stages", reads=(meta.NODE_COST, meta.COMM_COST, "state.predicted"),
               writes=(meta.STAGE, "state.pipeline_stages", "state.predicted"))
def cut_stages(state) -> None:
    """The pass: write `autoshard.stage` on every node and `state.pipeline_stages`.

    >>> [(n.name, n.meta[meta.STAGE]) for n in nodes][::3]
    [('linear_default', 0), ('linear_default_1', 0), ('linear_default_2', 0), ('sum_dim_int_list', 1)]
    """
    config = state.options.pipeline
    nodes = [n for n in state.gm.graph.nodes if n.op == "call_function"]
    if config.annotations is not None:
        _apply(state, nodes, _from_annotations(nodes, config.annotations, config.num_stages), config)
        return
    costs = cut_costs(state, nodes, config)
    fastest = auto_cut(state, nodes, config, costs=costs)
    ranks = _apply(state, nodes, fastest, config)
    budget = CompileOptions.of(state.options).budget_bytes
    if max(ranks) > budget:
        # The fastest cut overfills a rank (more layers where the other work is light, on the rank that keeps the
        # most micro-batches in flight): the fastest cut whose ranks fit, when there is one and it fills less.
        capped = auto_cut(state, nodes, config, fill=(budget, ranks), costs=costs)
        if capped is not None:
            applied = (state.pipeline_stages, state.predicted.memory, state.predicted.memory_bytes_per_rank)
            if max(_apply(state, nodes, capped, config)) > max(ranks):  # the fastest cut again, as applied
                _fill_and_check(state.gm.graph, nodes, fastest, config.num_stages)
                state.pipeline_stages, state.predicted.memory, state.predicted.memory_bytes_per_rank = applied


def _apply(state, nodes, stage: dict, config) -> list[int]:
    """Write the cut `stage` (`autoshard.stage`, the stage table, the fullest pp rank's memory as the predicted
    memory per device); return each pp rank's bytes."""
    _fill_and_check(state.gm.graph, nodes, stage, config.num_stages)
    state.pipeline_stages = stage_summary(state, config)
    # Memory per device, not the whole micro-batch program's: the pp rank holding the most (its stages'
    # parameters and its micro-batches in flight under the schedule).
    ranks = rank_memory(state, config)
    worst = MemoryParts(**max(ranks, key=lambda parts: sum(parts.values())))
    state.predicted.memory = worst
    state.predicted.memory_bytes_per_rank = worst.total()
    return [sum(parts.values()) for parts in ranks]


def module_stack(node) -> list[str]:
    """Module paths of a node, outermost first (model-relative, '' omitted).

    >>> module_stack(nodes[0])
    ['layers.0']
    """
    stack = node.meta.get("nn_module_stack") or {}
    return [p for p in (meta._strip_root(path) for path, _ in stack.values()) if p]


# ----------------------------------------------------------------------------------------- annotations

def _from_annotations(nodes, annotations, num_stages) -> dict:
    if annotations.node_stages:  # a saved plan's cut (its collectives follow their inputs, as insert_comm put them)
        return _from_node_stages(nodes, annotations.node_stages)
    if annotations.split_points:
        return _from_split_points(nodes, annotations, num_stages)
    stage, used = {}, set()
    for node in nodes:
        for path in reversed(module_stack(node)):  # the innermost annotated module wins
            hits = {k for glob, k in annotations.module_stages.items()
                    if path == glob or fnmatch.fnmatchcase(path, glob)}
            if len(hits) > 1:
                raise UserInputError(f"module {path!r} gets pipeline stages {sorted(hits)} from {annotations.source}; "
                                     "give each module one stage")
            if hits:
                stage[node] = hits.pop()
                used.update(g for g in annotations.module_stages if path == g or fnmatch.fnmatchcase(path, g))
                break
    known = sorted({p for n in nodes for p in module_stack(n)})
    for glob in annotations.module_stages:
        if glob not in used and not any(fnmatch.fnmatchcase(p, glob) or p == glob for p in known):
            close = difflib.get_close_matches(glob, known, n=3)
            raise UserInputError(f"stage annotation {glob!r} ({annotations.source}) matches no module that runs in "
                                 f"the model" + (f"; did you mean {', '.join(map(repr, close))}?" if close else
                                                 f"; modules are e.g. {known[:6]}"))
    numbers = sorted(set(annotations.module_stages.values()))
    if numbers != list(range(num_stages)):
        raise UserInputError(f"{annotations.source}: the annotations use pipeline stages {numbers} but the pipeline "
                             f"has {num_stages} stages (0..{num_stages - 1}: pp axis size x virtual stages per rank); number the "
                             "stages 0, 1, ... in execution order, one per stage")
    return stage


def _from_node_stages(nodes, node_stages: dict) -> dict:
    """The stage of each op a saved plan lists (`node_stages`: name -> stage); an op it does not list (no placement:
    a check of a tensor's metadata) that lies where the listed ops skip stages, in the order the automatic cut
    cuts (the ops but the weight-only ones), made those stages alone, in order (`_fill_and_check` places the other
    unlisted ops).

    >>> listed = {nodes[0].name: 0, nodes[2].name: 2, nodes[3].name: 2}  # nodes[1], unlisted, made stage 1
    >>> stage = _from_node_stages(nodes[:4], listed)
    >>> [stage[n] for n in nodes[:4]]
    [0, 1, 2, 2]
    """
    stage = {n: node_stages[n.name] for n in nodes if n.name in node_stages}
    floating = weight_only_ops(nodes)
    last, unlisted = -1, []
    for node in nodes:
        if node in floating:
            continue
        if node not in stage:
            unlisted.append(node)
            continue
        here = stage[node]
        for i, skipped in enumerate(unlisted if here > last + 1 else ()):
            stage[skipped] = min(last + 1 + i, here - 1)
        last, unlisted = max(last, here), []
    return stage


def _from_split_points(nodes, annotations, num_stages) -> dict:
    cuts = []
    for path, where in annotations.split_points:
        idx = [i for i, n in enumerate(nodes) if path in module_stack(n)]
        if not idx:
            known = sorted({p for n in nodes for p in module_stack(n)})
            close = difflib.get_close_matches(path, known, n=3)
            raise UserInputError(f"split point {path!r} names no module that runs in the model"
                                 + (f"; did you mean {', '.join(map(repr, close))}?" if close else ""))
        cuts.append(min(idx) if where == "beginning" else max(idx) + 1)
    if cuts != sorted(set(cuts)) or (cuts and (cuts[0] == 0 or cuts[-1] >= len(nodes))):
        raise UserInputError(f"split points {[p for p, _ in annotations.split_points]} are not in execution order "
                             "(or one makes an empty stage); list them in the order the modules run")
    if len(cuts) + 1 != num_stages:
        raise UserInputError(f"{len(cuts)} split points make {len(cuts) + 1} stages but the pipeline has "
                             f"{num_stages} (pp axis size x virtual stages per rank); give {num_stages - 1} split "
                             "points")
    return stages_from_cuts(nodes, cuts)


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


def _fill_and_check(graph, nodes, stage, num_stages) -> None:
    """Unannotated nodes follow their inputs (or, with none, their first user); then check the order."""
    for node in nodes:
        if node not in stage:
            ins = [stage[i] for i in node.all_input_nodes if i in stage]
            if ins:
                stage[node] = max(ins)
    for node in reversed(nodes):
        users = [stage[u] for u in node.users if u in stage]
        if node not in stage and users:
            stage[node] = min(users)
    following = 0
    for node in reversed(nodes):  # no user (a check of a weight's dtype): where it stands, after its inputs
        if node not in stage:
            stage[node] = max([following] + [stage[i] for i in node.all_input_nodes if i in stage])
        following = stage[node]
    for node in nodes:
        if node.target is operator.getitem:  # a tuple never crosses a stage boundary
            stage[node] = stage[node.args[0]]
    for node in nodes:
        for src in node.all_input_nodes:
            if src in stage and stage[src] > stage[node]:
                raise UserInputError(
                    f"pipeline stages out of execution order: {_where(node)} (stage {stage[node]}) uses a value "
                    f"computed in {_where(src)} (stage {stage[src]}); a stage may only use values of earlier "
                    "stages: number the stages in the order the modules run")
    present = sorted(set(stage.values()))
    if present != list(range(num_stages)):
        empty = sorted(set(range(num_stages)) - set(present))
        raise UserInputError(f"pipeline stage(s) {empty} get no operations (of {num_stages} stages); annotate fewer "
                             "stages, use a smaller pp axis, or let autoshard cut automatically")
    for node in graph.nodes:
        if node.op == "call_function":
            node.meta[meta.STAGE] = stage[node]
        elif node.op == "placeholder":
            users = [stage[u] for u in node.users if u in stage]
            node.meta[meta.STAGE] = min(users) if users and node.meta.get(meta.KIND) != "input" else 0
        elif node.op == "output":
            node.meta[meta.STAGE] = num_stages - 1


def _where(node) -> str:
    stack = module_stack(node)
    return f"module {stack[-1]!r} (node {node.name})" if stack else f"node {node.name}"


# ----------------------------------------------------------------------------------------- automatic cut

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


def stage_summary(state, config) -> list[dict]:
    """Per stage: ops, modules, predicted forward/backward seconds per micro-batch, memory, bytes sent.

    >>> [(s["stage"], s["ops"], s["first_module"], s["last_module"]) for s in stage_summary(state, config)]
    [(0, 7, 'layers.0', 'layers.2'), (1, 4, 'layers.2', 'layers.2')]
    """
    grads = needs_grad(state.gm.graph)
    profile = state.options.profile
    shares = reduce_scatter_shares(state.gm.graph, state.mesh) if state.zero is not None else {}
    out = [{"stage": s, "ops": 0, "first_module": "", "last_module": "", "seconds": 0.0, "param_bytes": 0,
            "activation_bytes": 0, "send_bytes": 0, "send_tensors": 0, "grad_tensors": 0, "sync_s": 0.0,
            "latency_s": 0.0, "recompute_s": 0.0} for s in range(config.num_stages)]
    held = [set() for _ in out]  # each stage's parameters
    for node in state.gm.graph.nodes:
        cost = node_cost(node)
        if node.op == "placeholder":
            if node.meta.get(meta.KIND) in ("param", "buffer"):
                for s in sorted({u.meta[meta.STAGE] for u in node.users if meta.STAGE in u.meta}):
                    out[s]["param_bytes"] += cost.memory_bytes
                    out[s]["sync_s"] += cost.sync_s
                    held[s].add(node)
            continue
        if node.op != "call_function":
            continue
        row = out[node.meta[meta.STAGE]]
        row["ops"] += 1
        seconds = op_seconds(state, node)  # with its recompute in backward when checkpointed
        row["seconds"] += seconds
        row["recompute_s"] += seconds - cost.seconds
        comm = node.meta.get(meta.COMM)
        if comm:  # the part of a collective's time that does not shrink with the micro-batch
            axis = state.mesh.axis(comm["axis"])
            fwd, bwd = collective_bytes(node, state.mesh, grads.get(node, False))
            k, link = state.mesh.shape[axis], profile.link(state.mesh.shape, axis)
            if comm["op"] == "param_all_gather":  # ZeRO-3: a layer's reduce-scatters share one's latencies
                row["latency_s"] += gather_seconds(node, fwd, k, link.latency_only(), shares.get(node, 1.0),
                                                   grads.get(node, False))
            else:
                row["latency_s"] += collective_latency(comm["op"], fwd, bwd, k, link)
        stack = module_stack(node)
        if stack:
            row["first_module"] = row["first_module"] or stack[-1]
            row["last_module"] = stack[-1]
        later = [u for u in node.users if u.meta.get(meta.STAGE, -1) > node.meta[meta.STAGE]]
        if later and isinstance(node.meta.get("val"), torch.Tensor):
            row["send_bytes"] += local_bytes(node, node.meta[meta.SPEC], state.mesh) * (2 if grads.get(node) else 1)
    last = config.num_stages - 1
    for node, is_input in carried_values(state.gm.graph):  # each tensor crossing a boundary is a message of its own
        made = 0 if is_input else node.meta.get(meta.STAGE)
        if made is None or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        # the output node is the last stage's (as `boundary_bytes` counts it after the last op)
        used = max((last if u.op == "output" else u.meta.get(meta.STAGE, -1) for u in node.users), default=-1)
        for boundary in range(made, used):  # passed on by every stage in between
            out[boundary]["send_tensors"] += 1
            out[boundary]["grad_tensors"] += int(bool(grads.get(node)))
    bucket = data_parallel_bucket_bytes(grads)  # the bucket predict priced each parameter's sync a share of
    for row, params in zip(out, held):  # a stage's module syncs its own gradients in its own buckets
        row["sync_s"] += sum(bucket_correction(state, params, bucket).values())
    for stage, seconds in tied_sync_seconds(state, config).items():  # a tied weight's gradient summed over pp
        out[stage]["sync_s"] += seconds
    kept, _ = stage_activations(state, stage_nodes(state, config.num_stages))  # recomputed regions' less
    for row in out:
        once = row["seconds"] - row["recompute_s"]  # backward ~ 2x forward, and the recompute runs in backward
        row["fwd_s"], row["bwd_s"] = once / 3, 2 * once / 3 + row["recompute_s"]
        row["activation_bytes"] = int(kept[row["stage"]])
    return out
