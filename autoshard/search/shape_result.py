"""A candidate mesh shape as the mesh search keeps it (autoshard/search/mesh_search.py): its plan, its predicted
step and the row `plan.search["mesh_candidates"]` shows, from a Program planned here or in a worker process.

>>> import autoshard
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, hints={"input:0": {"a0": "S(0)"}})
>>> shape_result((2,), prog, 0.0, keep_program=False).step == prog.plan.step_s
True
"""
from __future__ import annotations

import dataclasses
import math
import time

from autoshard.ir import meta
from autoshard.ir.errors import AutoshardError
from autoshard.ir.placement import Shard
from autoshard.report.accuracy import predicted_memory_bytes


@dataclasses.dataclass
class ShapeResult:
    """One candidate shape planned: its row of `plan.search["mesh_candidates"]`, its predicted step, the plan (a plan
    file's content, which a worker process returns), the Program when planned in this process, the predicted step
    of its flat automatic plan when the hand plans were deferred (`flat_step`), and its refusal when none plans.

    >>> ShapeResult((2, 4), {"mesh": [2, 4], "error": "no plan fits"}).step
    inf
    """
    shape: tuple
    row: dict
    step: float = math.inf
    plan: dict | None = None
    program: object = None
    flat_step: float | None = None
    ilp_stats: list = dataclasses.field(default_factory=list)
    ilp_stopped: list = dataclasses.field(default_factory=list)
    error: AutoshardError | None = None


def shape_result(shape: tuple, prog, started: float, keep_program: bool, flat_step: float | None = None) -> ShapeResult:
    """`prog`, planned on the mesh `shape` since `started` (perf_counter seconds), as the mesh search keeps it: its
    plan file's content, its row's figures, and the Program itself when `keep_program` (in this process).

    >>> shape_result((2,), prog, 0.0, keep_program=False).row["plan"]
    "batch on ['a0']"
    """
    plan = dict(prog.plan.to_json(), fingerprint=prog.plan.fingerprint)
    return ShapeResult(shape, {"mesh": list(shape), **figures_of(prog),
                               "seconds": round(time.perf_counter() - started, 3)},
                       prog.plan.step_s, plan, prog if keep_program else None, flat_step,
                       list(prog.state.ilp_stats), list(prog.state.ilp_stopped))


def figures_of(prog) -> dict:
    """The figures of `prog` a row of `plan.search["mesh_candidates"]` shows.

    >>> sorted(figures_of(prog))
    ['memory_bytes_per_rank', 'plan', 'predicted_step_s']
    """
    return {"predicted_step_s": prog.plan.step_s, "memory_bytes_per_rank": predicted_memory_bytes(prog),
            "plan": describe_roles(prog)}


def deferred_flat_step(search: dict) -> float | None:
    """The predicted step of the flat automatic plan whose hand plans were deferred, from a search record (`search`:
    `plan.search` of that plan or of the pipeline kept over it, which carries the deferral's record row), else None.

    >>> deferred_flat_step(prog.plan.search) is None  # planned outside the mesh search: nothing was deferred
    True
    """
    deferred = search.get("hand_plans_deferred")
    return deferred["automatic"]["predicted_step_s"] if deferred else None


def describe_roles(prog) -> str:
    """What each mesh axis does in `prog`'s plan, in a few words: the pipeline axis, the axes the batch is split
    on (data parallelism), the axes parameters are split on (tensor parallelism, or ZeRO-3's), the axes only other
    values are split on (a sequence, the experts' token groups; an axis in none of these only replicates), and ZeRO.

    >>> import autoshard
    >>> from autoshard.zoo import mlp
    >>> model, inputs, loss_fn = mlp(n_layers=2)
    >>> describe_roles(autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
    ...                                      hints={"input:0": {"dp": "S(0)"}}))
    "batch on ['dp']"
    """
    parts = []
    pipeline = prog.plan.pipeline
    if pipeline:
        parts.append(f"pipeline over {pipeline['axis']!r} ({pipeline['stages']} stages, "
                     f"{pipeline['microbatches']} micro-batches, {pipeline['schedule']})")
    names = [n for n in prog.mesh.names if not pipeline or n != pipeline["axis"]]
    batch = sorted({names[a] for spec in prog.input_specs for a, p in enumerate(spec) if p == Shard(0)})
    specs = prog.param_specs
    params = sorted({names[a] for fqn in prog.traced.params for a, p in enumerate(specs[fqn])
                     if isinstance(p, Shard)})
    # other values split on an axis that carries neither (a sequence, the experts' token groups)
    activations = sorted({names[a] for node in prog.state.gm.graph.nodes if node.op == "call_function"
                          for a, p in enumerate(node.meta.get(meta.SPEC, ())) if isinstance(p, Shard)}
                         - set(batch) - set(params))
    if batch:
        parts.append(f"batch on {batch}")
    if params:
        parts.append(f"parameters split on {params}")
    if activations:
        parts.append(f"activations split on {activations}")
    if prog.zero is not None:
        parts.append(repr(prog.zero))
    return ", ".join(parts) or "replicated"
