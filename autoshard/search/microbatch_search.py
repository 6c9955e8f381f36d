"""How a pipeline over one axis runs: with how many micro-batches and under which schedule, decided by predicted step
time (the axis itself is pipeline_search's choice).

The micro-batch count, when not given, is the multiple of p dividing the batch with the least predicted step time:
planned at p or 2p (and at Megatron's count, one sample per data-parallel device, unless that first plan splits its
micro-batch over exactly those devices), every other count estimated from those plans (`expected_steps`: a finer
count without the recomputation the planned one needed, and with it; a planned count ranked at its plan's step), and
the count ranked first planned until a planned count ranks first (a plan slower than its estimate hands the lead on).
The predicted step of a pipeline is the 1F1B-family formula: sum of stage times + (m - 1) x the slowest stage + the
slowest stage's gradient sync; then the schedules of two stages per rank (`SEARCHED_SCHEDULES`) are weighed on each
planned count's micro-batch program (`best_pipeline`, `best_schedule`). Each re-plan and schedule is skipped when its
least step (without the bubble) cannot beat `to_beat`, the best step the caller knows.

>>> import autoshard
>>> from autoshard.zoo import mlp
>>> from autoshard.frontend.request import CompileRequest
>>> model, inputs, loss_fn = mlp(n_layers=3)
>>> counted = best_microbatches(CompileRequest(model, autoshard.Mesh((2,), ("pp",)), inputs, loss_fn=loss_fn), "pp", {})
>>> counted.config.microbatches, sorted(counted.search_records["microbatch_search"])  # each count's expected step
(2, ['2', '4', '8'])
"""
from __future__ import annotations

import logging
import math

from autoshard.frontend.request import CompileRequest
from autoshard.ir.errors import AutoshardError
from autoshard.ir.placement import Shard
from autoshard.program.pipeline import (
    batch_size,
    inner_mesh,
    parallelize_pipeline,
    recut_pipeline,
)

log = logging.getLogger(__name__)


def predicted_step(stages: list[dict], m: int, virtual: int = 1, bubble: bool = True) -> float:
    """Step time of a pipeline whose stages take `stages[s]["seconds"]` per micro-batch; without the `bubble` (the
    fill and drain), the slowest rank's busy time: what no schedule of these stages beats (`least_step`).

    >>> two = [{"seconds": 1.0, "sync_s": 0.5}, {"seconds": 2.0, "sync_s": 0.0}]
    >>> predicted_step(two, m=4), predicted_step(two, m=4, bubble=False)  # 3 + 3 x 2 + 0.5; 4 x 2 + 0.5
    (9.5, 8.5)
    """
    per_rank = max(s["seconds"] for s in stages) * virtual
    sync = max(s["sync_s"] for s in stages)
    if not bubble:
        return m * per_rank + sync
    return sum(s["seconds"] for s in stages) + (m - 1) * per_rank + sync


# Besides 1F1B, the schedules the search weighs (with two stages per rank): zero bubble fills the bubble with
# weight gradients (Qi et al. 2023), interleaving shrinks it by the number of stages per rank (Narayanan et al.
# 2021; torchtitan measured interleaved 1F1B 28% faster than 1F1B on Llama 3 405B). Zero bubble first: it keeps
# 1F1B's activations in flight, so it is a recut of the same plan (cheap), and its step may rule out interleaving,
# which keeps more in flight and is planned afresh (on Llama 3 70B over (2, 32, 8): 14 s of a 51 s plan).
SEARCHED_SCHEDULES = (("ZBVZeroBubble", 2), ("Interleaved1F1B", 2))
# What a pipelined plan's record keeps of its searches (part of its fingerprint; a saved plan carries them).
SEARCH_RECORDS = ("microbatch_search", "not_replanned", "schedule_search")


def best_schedule(request: CompileRequest, prog, opts: dict, to_beat: float = float("inf")):
    """`prog`'s pipeline (one stage per rank, 1F1B) or, when its predicted step is shorter, the same axis and
    micro-batch count under each of SEARCHED_SCHEDULES: each is the same micro-batch program cut into twice the
    stages (`recut_pipeline`), and its step is the simulated timeline of the schedule's own action order. A schedule
    or virtual stages the user gave are kept; `plan.pipeline["schedule_search"]` lists what was compared. A schedule
    whose least step (`least_step`) cannot beat `to_beat` (the best step found so far) or the best schedule so far
    is not planned.

    >>> from autoshard.frontend.request import CompileRequest
    >>> deep, deep_inputs, deep_loss = mlp(n_layers=8)
    >>> request = CompileRequest(deep, autoshard.Mesh((2,), ("pp",)), deep_inputs, loss_fn=deep_loss)
    >>> piped = best_schedule(request, best_microbatches(request, "pp", {}), {})
    >>> [row["schedule"] for row in piped.plan.pipeline["schedule_search"]]
    ['1F1B', 'ZBVZeroBubble', 'Interleaved1F1B']
    """
    if "schedule" in opts or "virtual_stages" in opts:
        return prog
    work = prog.predicted_work_s  # its step without the bubble
    if work >= to_beat:
        return prog
    config = prog.config
    rows = [{"schedule": config.schedule, "virtual_stages": config.virtual,
             "predicted_step_s": prog.predicted_step_s}]
    best = prog
    for schedule, virtual in SEARCHED_SCHEDULES:
        least = least_step(work, config.pp_size, config.microbatches, schedule, virtual, config.shares_cores)
        beat = min(to_beat, best.predicted_step_s)
        if least >= beat:
            rows.append({"schedule": schedule, "virtual_stages": virtual,
                         "not_planned": f"its least step {least:.4g} s cannot beat {beat:.4g} s"})
            continue
        try:  # the same micro-batch program, cut into `virtual` stages per rank
            other = recut_pipeline(request, prog, dict(opts, microbatches=config.microbatches, schedule=schedule,
                                                       virtual_stages=virtual), replan_bound(beat, schedule, virtual))
        except AutoshardError as exc:  # e.g. fewer layers than stages
            rows.append({"schedule": schedule, "virtual_stages": virtual, "error": str(exc).splitlines()[0]})
            continue
        step = other.predicted_step_s
        rows.append({"schedule": schedule, "virtual_stages": virtual, "predicted_step_s": step})
        if step < best.predicted_step_s:
            best = other
    for key in SEARCH_RECORDS[:2]:  # the micro-batch count was searched under 1F1B
        if key in prog.search_records:
            best.record(key, prog.search_records[key])
    best.record("schedule_search", rows)
    return best


def replan_bound(to_beat: float, schedule: str, virtual: int):
    """parallelize_pipeline's `worth_replanning` for a search whose best step so far is `to_beat`: a plan whose
    fullest pp rank overflows the budget is planned again against a tighter one (one to three more plans of the
    micro-batch program) only if its least step (`least_step` of its work) can beat `to_beat`: the tighter budget
    only constrains it more. None (always re-plan) while nothing is known to beat.

    >>> replan_bound(float("inf"), "1F1B", 1) is None
    True
    """
    if math.isinf(to_beat):
        return None

    def reason(prog) -> str | None:
        config = prog.config
        least = least_step(prog.predicted_work_s, config.pp_size, config.microbatches, schedule, virtual,
                           config.shares_cores)
        if least < to_beat:
            return None
        return f"not planned again: its least step {least:.4g} s cannot beat {to_beat:.4g} s"
    return reason


def least_step(work: float, p: int, m: int, schedule: str, virtual: int, shares_cores: bool = False) -> float:
    """The least step a schedule can take for a pipeline whose 1F1B plan does `work` seconds besides its bubble:
    interleaving leaves a bubble of (p - 1) / (virtual x m) of the work (Narayanan et al. 2021), zero bubble none. A
    bound as the search's other prunes are: a plan of this schedule keeps at least as many activations in flight,
    so its ILP is at least as constrained and its work per micro-batch no smaller. Where ranks share their host's
    cores (`PipelineConfig.shares_cores`) a bubble may cost nothing (the busy ranks take its cores): `work` only.

    >>> least_step(64.0, p=32, m=64, schedule="Interleaved1F1B", virtual=2)
    79.5
    >>> least_step(64.0, 32, 64, "ZBVZeroBubble", 2)
    64.0
    """
    if schedule == "Interleaved1F1B" and not shares_cores:
        return work * (1 + (p - 1) / (virtual * m))
    return work


def _microbatch_candidates(p: int, batch: int) -> list[int]:
    """The counts the first plan is made at (the smallest bubble per planning second)."""
    return [m for m in (p, 2 * p, 4 * p) if m <= batch and batch % m == 0] or [1]


def _data_devices(inner: tuple) -> int:
    """The devices Megatron's rule gives data parallelism in an inner mesh: all but its innermost axis (tensor
    parallelism inside a node); none of a one-axis mesh."""
    return math.prod(inner[:-1]) if len(inner) > 1 else 1


def _batch_ways(prog) -> int:
    """Over how many devices of the inner mesh the first plan splits a micro-batch (its data parallelism)."""
    shape = prog.inner_mesh.shape
    specs = [spec for spec in prog.input_specs if spec]
    return max((math.prod(shape[a] for a, p in enumerate(spec) if p == Shard(0)) for spec in specs), default=1)


def _splits_as_megatron(prog, inner: tuple) -> bool:
    """Whether `prog` splits its micro-batch over exactly the inner mesh's data devices (Megatron's rule): then the
    counts estimated from it (`_finer_counts` of its batch split) include Megatron's count, one sample per data
    device, sharded alike. Over fewer devices it may shard otherwise (its activations crowd out the parameters: Llama
    3 8B over 128 GPUs, pipelined over 2 of (2, 16, 4), plans 2.13 s at Megatron's 16 micro-batches and 3.89 s at 4
    micro-batches of its batch unsplit); over more, the counts of fewer samples than it splits are not estimated at
    all: either way Megatron's count is planned."""
    return _batch_ways(prog) == _data_devices(inner)


def _finer_counts(p: int, batch: int, ways: int) -> list[int]:
    """The micro-batch counts estimated from the first plan: every multiple of the pp size dividing the batch
    whose micro-batch still splits over the `ways` devices the first plan gives the batch (Megatron runs 8 to 24
    micro-batches per stage: the bubble (p - 1) / (m + p - 1) shrinks with m while each micro-batch's latencies
    stay).

    >>> _finer_counts(2, 48, 4)  # micro-batches of 24, 12, 8, 4 sequences over 4 data-parallel devices
    [2, 4, 6, 12]
    """
    return [m for m in range(p, batch + 1, p) if batch % m == 0 and (batch // m) % ways == 0]


def estimate_step(stages: list[dict], m0: int, m: int, config, bubble: bool = True) -> float:
    """The predicted step with `m` micro-batches from stage times measured at `m0` (`config` the PipelineConfig
    planned): the bandwidth and compute parts scale with the micro-batch size, the latencies (collectives, stage
    sends, the runtime's `action_s` per forward and backward and its cost per tensor sent beyond the first) do not.

    >>> from autoshard.cost.profiles import Link
    >>> from autoshard.program.pipeline import PipelineConfig
    >>> stages = [{"seconds": 1.0, "sync_s": 0.0}, {"seconds": 1.0, "sync_s": 0.0}]
    >>> estimate_step(stages, m0=2, m=4, config=PipelineConfig("pp", 2, 2, link=Link(0.0, 1e9)))  # 4 halves + 1
    2.5
    """
    scaled = []
    last = len(stages) - 1
    for i, row in enumerate(stages):
        fixed = row.get("latency_s", 0.0) + 4 * config.link.alpha
        messages = (config.message_seconds(row.get("send_tensors", 1)) if i < last else 0.0) \
            + (config.message_seconds(stages[i - 1].get("grad_tensors", 1)) if i > 0 else 0.0)
        scaled.append(dict(row, seconds=max(row["seconds"] - fixed, 0.0) * m0 / m + fixed + 2 * config.action_s
                           + messages))
    return predicted_step(scaled, m, config.virtual, bubble)


def expected_steps(planned: dict, p: int, batch: int, recomputed: bool = False) -> dict:
    """{count: (expected step, the planned count it is estimated from, the expected step without the bubble)} over
    the counts each plan of `planned` ({count: its Program}) estimates (`_finer_counts` of its batch split), each the
    least expected of them; a planned count's is its plan's predicted step, whatever another plan estimates. The step
    without the bubble is what no schedule beats (`least_step`): the search weighs zero bubble after the count. A
    finer count keeps smaller micro-batches in flight: what the memory ladder recomputed at the planned count it
    recomputes at most there, so its estimate leaves the recomputation out (Llama 3 8B pipelined over 2 of 8 GPUs: at
    4 micro-batches 20 layers recomputed; 16 estimated with them at 2.01 s were not planned; planned, 1.69 s), unless
    `recomputed`.

    >>> from types import SimpleNamespace as Plan
    >>> from autoshard.cost.profiles import Link
    >>> from autoshard.program.pipeline import PipelineConfig
    >>> rows = [{"seconds": 3.0, "recompute_s": 1.0, "sync_s": 0.0}, {"seconds": 3.0, "recompute_s": 1.0, "sync_s": 0.0}]
    >>> four = Plan(config=PipelineConfig("pp", 2, 4, link=Link(0.0, 1e9)), state=Plan(pipeline_stages=rows),
    ...             predicted_step_s=15.0, predicted_work_s=12.0, inner_mesh=Plan(shape=(4,)), input_specs=[])
    >>> {m: round(step, 2) for m, (step, *_) in expected_steps({4: four}, p=2, batch=16).items()}  # 8, 16: 2 s a stage
    {2: 18.0, 4: 15.0, 8: 9.0, 16: 8.5}
    >>> {m: round(step, 2) for m, (step, *_) in expected_steps({4: four}, 2, 16, recomputed=True).items()}
    {2: 18.0, 4: 15.0, 8: 13.5, 16: 12.75}
    >>> {m: round(least, 2) for m, (*_, least) in expected_steps({4: four}, 2, 16).items()}  # 2 x 6, 4 x 3, 8 x 1
    {2: 12.0, 4: 12.0, 8: 8.0, 16: 8.0}
    """
    expected = {}
    for m0, prog in planned.items():
        config, stages = prog.config, prog.state.pipeline_stages
        own = estimate_step(stages, m0, m0, config)
        lighter = [dict(row, seconds=row["seconds"] - row.get("recompute_s", 0.0)) for row in stages]
        for m in sorted({m0, *_finer_counts(p, batch, _batch_ways(prog))}):
            # the estimates rank the counts; scaled to the plan's own predicted step they say what m would take
            rows = lighter if m > m0 and not recomputed else stages
            if m in planned:  # a plan is known: no estimate from another plan stands in for it
                continue
            step = estimate_step(rows, m0, m, config) * prog.predicted_step_s / own
            least = estimate_step(rows, m0, m, config, bubble=False) * prog.predicted_step_s / own
            if m not in expected or step < expected[m][0]:
                expected[m] = (step, m0, least)
        expected[m0] = (prog.predicted_step_s, m0, prog.predicted_work_s)
    return dict(sorted(expected.items()))


def best_microbatches(request: CompileRequest, axis: str, opts: dict, to_beat: float = float("inf"),
                      every: bool = False):
    """Plan at one or two micro-batch counts (`_first_counts`), estimate the others from each plan (`expected_steps`,
    without and with the planned count's recomputation), and plan the count ranked first until a planned count ranks
    first (GPT-2 of width 2048 and 8 layers pipelined over 4 of (4, 2) on H100s: 64 micro-batches, estimated fastest
    from the plan at 8, planned slower; the next estimate, 32, planned 0.113 s under zero bubble against 8's 0.124 s);
    the fastest planned count wins (`every`: every planned count's Program, fastest first). A re-plan is skipped
    when, even without its gradient sync (the only cost a plan for another count weighs differently: its share per
    micro-batch) and its bubble (zero bubble may remove it: `to_beat` is often a zero-bubble step), the estimate
    cannot beat `to_beat`, the best step found so far. Measured with the bubble kept in: Megatron's 3.6B GPT over 64
    GPUs kept a 1.543 s plan, its zero-bubble counts pruned by their 1F1B estimates; planned, 1.418 s.

    The count kept (the module's example) is the one expected fastest, planned:

    >>> expected = counted.search_records["microbatch_search"]
    >>> min(expected, key=expected.get) == str(counted.config.microbatches)
    True
    """
    if "microbatches" in opts:
        prog = parallelize_pipeline(request, axis, opts)
        return [prog] if every else prog
    inputs = request.example_inputs
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    mesh = request.mesh
    p, batch = mesh.shape[mesh.axis(axis)], batch_size(inputs)
    request = request.replace(example_inputs=inputs)
    planned, errors, tried = {}, [], set()  # tried: planned, or refused (planning it again would refuse it again)
    replan = replan_bound(to_beat, "1F1B", 1)
    inner = inner_mesh(mesh, axis).shape
    for m in _first_counts(p, batch, inner):
        if planned and all(_splits_as_megatron(prog, inner) for prog in planned.values()):
            break  # the first plan splits its micro-batch as Megatron's count would be: it estimates that count
        tried.add(m)
        try:
            planned[m] = parallelize_pipeline(request, axis, dict(opts, microbatches=m), replan)
        except AutoshardError as exc:  # e.g. micro-batches too large to fit: the finer count may
            errors.append(exc)
    if not planned:
        raise errors[0]
    pruned = None
    # The count expected fastest is planned, until a planned count ranks first (a plan slower than its estimate hands
    # the lead to the next estimate); likewise ranked with the planned count's recomputation kept (what the search
    # re-planned before the estimates left it out), so that leaving it out never loses a plan.
    for recomputed in (False, True):
        while True:
            ranking = {m: row for m, row in expected_steps(planned, p, batch, recomputed).items()
                       if m in planned or m not in tried}
            best = min(ranking, key=lambda m: (ranking[m][0], m))
            if best in planned:
                break
            tried.add(best)
            sync = max(row.get("sync_s", 0.0) for row in planned[ranking[best][1]].state.pipeline_stages)
            # the bound may be a zero-bubble step: the count is weighed under zero bubble too (`best_pipeline`)
            if ranking[best][2] - sync >= to_beat:
                pruned = pruned or {"microbatches": best, "expected_step_s": ranking[best][0]}
                break
            try:
                planned[best] = parallelize_pipeline(request, axis, dict(opts, microbatches=best), replan)
            except AutoshardError as exc:  # e.g. a micro-batch too small to shard on dp: keep the planned counts
                log.info("pipelining with %d micro-batches is not possible (%s)", best, exc)
    expected = expected_steps(planned, p, batch)
    ranked = sorted(planned.values(), key=lambda prog: (prog.predicted_step_s, prog.config.microbatches))
    for prog in ranked:  # each planned count may win under another schedule (`best_pipeline`)
        prog.record("microbatch_search", {str(m): expected[m][0] for m in sorted(expected)})
        if pruned:
            prog.record("not_replanned", pruned)
    return ranked if every else ranked[0]


def best_pipeline(request: CompileRequest, axis: str, opts: dict, to_beat: float = float("inf")):
    """The fastest pipeline over `axis`: every micro-batch count `best_microbatches` planned, each under the schedules
    `best_schedule` weighs (a count that loses under 1F1B may win under zero bubble, whose bubble does not shrink with
    more micro-batches: Llama 3 70B over (2, 16, 8), its ZeRO variant pipelined over the 16-way axis, 64 micro-batches
    under 1F1B 22.1 s against 32's 23.9, under zero bubble 19.7 s against 18.3). Each schedule is skipped where its
    least step cannot beat the best found.

    >>> from autoshard.frontend.request import CompileRequest
    >>> deep, deep_inputs, deep_loss = mlp(n_layers=8)
    >>> request = CompileRequest(deep, autoshard.Mesh((2,), ("pp",)), deep_inputs, loss_fn=deep_loss)
    >>> best_pipeline(request, "pp", {}).predicted_step_s <= best_schedule(
    ...     request, best_microbatches(request, "pp", {}), {}).predicted_step_s
    True
    """
    best = None
    for prog in best_microbatches(request, axis, opts, to_beat=to_beat, every=True):
        bound = min(to_beat, best.predicted_step_s) if best is not None else to_beat
        scheduled = best_schedule(request, prog, opts, to_beat=bound)
        if best is None or scheduled.predicted_step_s < best.predicted_step_s:
            best = scheduled
    return best


def first_microbatch_counts(shape: tuple, batch: int) -> list[int]:
    """The micro-batch counts the pipeline search plans first on a mesh of `shape`, over every axis it may pipeline
    (`_first_counts` of each): the mesh search traces these micro-batches before it forks its workers, which would
    otherwise each trace them again.

    >>> first_microbatch_counts((8, 8), 16), first_microbatch_counts((2, 4, 8), 16)
    ([16], [4, 8, 16])
    """
    counts = set()
    for i, p in enumerate(shape):
        if p >= 2:
            counts.update(_first_counts(p, batch, shape[:i] + shape[i + 1:]))
    return sorted(counts)


def _first_counts(p: int, batch: int, inner: tuple) -> list[int]:
    """The micro-batch counts planned before the others are estimated: the largest of p, 2p that divides the
    batch (a small bubble for few micro-batches), and, when it is at least four times as many, Megatron's count:
    one sample per data-parallel device and micro-batch, the data-parallel devices taken as the inner mesh less
    its innermost axis (tensor parallelism inside a node; a one-axis inner mesh has none: one sample a micro-batch).
    A plan at a large micro-batch may shard very differently (its activations crowd out the parameters): estimates
    from it alone would miss the fine counts. Megatron's count is planned unless the first plan splits its micro-batch
    as that count would be (`_splits_as_megatron`).

    >>> _first_counts(2, 1536, (32, 8)), _first_counts(2, 8, (2,)), _first_counts(2, 16, (4,))
    ([4, 48], [4], [4, 16])
    """
    coarse = _microbatch_candidates(p, batch)
    first = max([m for m in coarse if m <= 2 * p] or coarse[:1])
    data = _data_devices(inner)
    fine = [m for m in _finer_counts(p, batch, data) if batch // m == data]
    return [first] + [m for m in fine if m >= 4 * first]
