"""cut_stages: the pipeline stage of every node, from the user's annotations or a cost-balanced cut.

Reads `state.options.pipeline` (a PipelineConfig: number of stages, micro-batches, schedule, the
user's StageAnnotations or None) and, for the automatic cut, `autoshard.node_cost` written by
`predict` (so the communication that insert_comm actually emitted is balanced too). Writes
`autoshard.stage` on every node and `state.pipeline_stages` (one summary dict per stage).
Invariant: along every edge the producer's stage <= the consumer's; every stage has work; a
multi-output node and its getitems share a stage (a tuple never crosses a stage boundary).

Runs after `predict` rather than before insert_comm (DESIGN.md's order) for that reason: the cut
balances the plan's real collectives, not an estimate of them. The automatic cut itself (its cost model and
search) is autoshard/passes/auto_cut.py; this pass applies it, or the user's or a saved plan's stages, and
writes the stage table (`stage_summary`).

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
import operator

import torch

from autoshard.cost.axis_cost import data_parallel_bucket_bytes, needs_grad
from autoshard.cost.collective_time import collective_latency
from autoshard.cost.flops import local_bytes
from autoshard.cost.pipeline_schedule import (
    rank_memory,
    stage_activations,
    stage_nodes,
)
from autoshard.cost.prediction import MemoryParts, node_cost
from autoshard.cost.recompute_cost import op_seconds
from autoshard.cost.sync_buckets import bucket_correction, tied_sync_seconds
from autoshard.cost.zero_cost import gather_seconds, reduce_scatter_shares
from autoshard.frontend.cut_points import module_stack
from autoshard.frontend.request import CompileOptions
from autoshard.ir import meta
from autoshard.ir.errors import UserInputError
from autoshard.passes.auto_cut import auto_cut, carried_values, cut_costs, stages_from_cuts, weight_only_ops
from autoshard.passes.contract import compiler_pass
from autoshard.passes.predict import collective_bytes


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
