"""Timelines: a pipeline's, planned (the schedule simulated on predicted stage times) and measured, and a
flat program's planned step with its overlap (compute and each link as rows: `overlap_timeline`).

A timeline is a list of events `(pp rank, stage, kind, micro-batch, start_s, end_s)` with kind "F"
(forward), "B" (full backward), "I" (input-gradient backward) or "W" (weight-gradient backward) —
the actions of torch.distributed.pipelining's schedules. `planned_timeline(program)` runs the
schedule's action order per rank (autoshard/cost/pipeline_schedule.py: torch's own `pipeline_order` for
multi-stage schedules) on the plan's per-stage forward/backward times with the stage-to-stage
transfer time; the measured one comes from a real step (`PipelineRankModule.timeline`). Both print as
text rows per rank and plot with `autoshard.report.viz.plot_timeline`.

>>> t = Timeline([(0, 0, "F", 0, 0.0, 1.0), (1, 1, "F", 0, 1.0, 2.0), (1, 1, "B", 0, 2.0, 4.0),
...               (0, 0, "B", 0, 4.0, 6.0)])
>>> round(t.bubble_fraction(), 3)
0.5
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from autoshard.cost.overlap import step_works, two_streams
from autoshard.cost.pipeline_schedule import schedule_order
from autoshard.cost.profiles import core_contention
from autoshard.ir.errors import PlanError
from autoshard.report.viz import plot_timeline


@dataclass
class Timeline:
    """Events `(rank, stage, kind, microbatch, start_s, end_s)` of one training step.

    >>> Timeline([(0, 0, "F", 0, 0.0, 1.0), (0, 0, "B", 0, 1.0, 3.0)]).busy(0)
    3.0
    """

    events: list = field(default_factory=list)
    source: str = "planned"
    rows: dict = field(default_factory=dict)  # row -> its name (default: "pp rank <row>")
    # Where ranks share their host's cores: the least step any schedule of these stage times can take (`_shared_cores`)
    least_s: float | None = None

    def row_name(self, row: int) -> str:
        """What row `row` shows: a pp rank, or the compute stream / a link of an overlap timeline.

        >>> Timeline(rows={1: "link dp"}).row_name(1), Timeline().row_name(0)
        ('link dp', 'pp rank 0')
        """
        return self.rows.get(row, f"pp rank {row}")

    @property
    def ranks(self) -> list[int]:
        """The pp ranks with events.

        >>> Timeline([(1, 1, "F", 0, 0.0, 1.0), (0, 0, "F", 0, 0.0, 1.0)]).ranks
        [0, 1]
        """
        return sorted({e[0] for e in self.events})

    def span(self) -> float:
        """First start to last end (seconds).

        >>> Timeline([(0, 0, "F", 0, 2.0, 3.0), (1, 1, "F", 0, 3.0, 5.0)]).span()
        3.0
        """
        return max(e[5] for e in self.events) - min(e[4] for e in self.events) if self.events else 0.0

    def busy(self, rank: int) -> float:
        """Seconds `rank` spent in forward/backward chunks.

        >>> Timeline([(0, 0, "F", 0, 0.0, 1.0), (1, 1, "F", 0, 1.0, 2.0)]).busy(1)
        1.0
        """
        return sum(e[5] - e[4] for e in self.events if e[0] == rank)

    def bubble_fraction(self, span: float | None = None) -> float:
        """Idle share of the step averaged over ranks: 1 - busy / (ranks x step span).

        >>> Timeline([(0, 0, "F", 0, 0.0, 1.0), (1, 1, "F", 0, 1.0, 2.0)]).bubble_fraction()
        0.5
        """
        span = self.span() if span is None else span
        if span <= 0:
            return 0.0
        return 1.0 - sum(self.busy(r) for r in self.ranks) / (len(self.ranks) * span)

    def plot_events(self) -> list[tuple]:
        """Events for `autoshard.report.viz.plot_timeline` (one row per pp rank; I counts as backward).

        >>> Timeline([(0, 0, "I", 3, 1.0, 2.0)]).plot_events()
        [('pp rank 0', 0.0, 1.0, 'B', 3)]
        """
        t0 = min(e[4] for e in self.events) if self.events else 0.0
        return [(self.row_name(r), s0 - t0, s1 - t0, "B" if kind == "I" else kind, mb)
                for r, _, kind, mb, s0, s1 in sorted(self.events, key=lambda e: (e[0], e[4]))]

    def plot(self, title: str | None = None):
        """A matplotlib Gantt chart of the step (one row per pp rank).

        >>> figure = Timeline([(0, 0, "F", 0, 0.0, 1.0), (1, 1, "F", 0, 1.0, 2.0)]).plot()
        """
        return plot_timeline(self.plot_events(), title=title or f"{self.source} {'' if self.rows else 'pipeline '}step")

    def __repr__(self) -> str:
        """One text row per rank: each column a slice of the step, the letter of what ran (. idle)."""
        width, span = 72, self.span()
        if not self.events or span <= 0:
            return f"Timeline({self.source}: empty)"
        t0 = min(e[4] for e in self.events)
        lines = [f"{self.source} timeline: step {span:.3g} s, bubble {self.bubble_fraction():.1%}"]
        for rank in self.ranks:
            row = ["."] * width
            for r, stage, kind, mb, s0, s1 in self.events:
                if r == rank:
                    for c in range(int((s0 - t0) / span * width), max(int((s1 - t0) / span * width),
                                                                     int((s0 - t0) / span * width) + 1)):
                        row[min(c, width - 1)] = kind
            lines.append(f"  {self.row_name(rank)}: {''.join(row)}")
        return "\n".join(lines)


def simulate(config, durations: dict, transfer_s: float = 0.0, sent_s: float = 0.0) -> Timeline:
    """Run the per-rank action orders as early as their dependencies allow.

    `durations[stage]` = {"F": s, "B": s}; I and W take half of B each (zero-bubble's split), times the split's
    cost over a fused backward (`config.split_backward`); every action also takes the runtime's fixed cost per
    action (`config.action_s`), and one that sends more than one tensor (`durations[stage]["F_sends"]` forward,
    `["B_sends"]` backward, 1 when absent) `config.message_seconds` of them. A message between stages arrives
    `transfer_s` after its action ends; an action that sends one (a forward but the last stage's, an input backward but the first stage's) also takes
    `config.send_share` of `sent_s`, the message's bytes time (its rank's share of the copy). Where ranks share
    their host's cores (`config.shares_cores`), the busy ones share them at each moment (`_shared_cores`).

    >>> from autoshard.program.pipeline import PipelineConfig
    >>> even = {0: {"F": 1.0, "B": 2.0}, 1: {"F": 1.0, "B": 2.0}}
    >>> round(simulate(PipelineConfig("pp", 2, 4, "1F1B"), even).bubble_fraction(), 3)  # (p-1)/(m+p-1)
    0.2
    >>> cpu = PipelineConfig("pp", 2, 4, "1F1B", send_share=1.0)  # each rank sends 4 messages of 0.25 s
    >>> simulate(cpu, even, sent_s=0.25).span() - simulate(PipelineConfig("pp", 2, 4, "1F1B"), even).span()
    1.25
    """
    orders = schedule_order(config)
    done: dict = {}
    ready = _ready_rule(config, done, transfer_s)
    last = config.num_stages - 1

    def seconds(stage, kind):
        spent = config.action_s + (durations[stage]["F"] if kind == "F" else
                                   durations[stage]["B"] * (1.0 if kind == "B" else 0.5 * config.split_backward))
        if (kind == "F" and stage < last) or (kind in ("B", "I") and stage > 0):
            sends = durations[stage].get("F_sends" if kind == "F" else "B_sends", 1)
            spent += config.send_share * sent_s + config.message_seconds(sends)
        return spent

    if config.shares_cores:
        return _shared_cores(config, orders, done, ready, seconds)
    position = {r: 0 for r in orders}
    free = {r: 0.0 for r in orders}
    events = []
    remaining = sum(len(o) for o in orders.values())
    while remaining:
        progressed = False
        for r, order in orders.items():
            if position[r] >= len(order):
                continue
            stage, kind, mb = order[position[r]]
            t = ready(stage, kind, mb)
            if t is None:
                continue
            start = max(t, free[r])
            done[(stage, kind, mb)] = free[r] = start + seconds(stage, kind)
            events.append((r, stage, kind, mb, start, free[r]))
            position[r] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            _deadlock(config, orders, position)
    return Timeline(events, source="planned")


def _ready_rule(config, done: dict, transfer_s: float):
    """ready(stage, kind, micro-batch): when an action's inputs are there (its dependencies' ends in `done`, a
    message `transfer_s` after the action that sends it), None while one of them has not run."""
    last = config.num_stages - 1

    def ready(stage, kind, mb):
        if kind == "F":
            deps = [(stage - 1, "F", mb)] if stage > 0 else []
        elif kind in ("B", "I"):
            deps = [(stage, "F", mb)] + ([] if stage == last else [(stage + 1, "B", mb), (stage + 1, "I", mb)])
        else:
            deps = [(stage, "I", mb)]
        if kind in ("B", "I") and stage < last:  # the next stage ran either a full or an input backward
            later = [done.get((stage + 1, k, mb)) for k in ("B", "I")]
            later = [t for t in later if t is not None]
            own = done.get((stage, "F", mb))
            return None if not later or own is None else max(own, min(later) + transfer_s)
        times = [done.get(d) for d in deps]
        if any(t is None for t in times):
            return None
        return max(times, default=0.0) + (transfer_s if kind == "F" and stage > 0 else 0.0)
    return ready


def _shared_cores(config, orders: dict, done: dict, ready, seconds) -> Timeline:
    """`simulate` where ranks share their host's cores (CPU ranks outnumbering the cores): the stage times were
    measured with `config.rates_ranks` ranks busy at once, so an action's work alone is its time over that contention
    (`core_contention`), and at each moment the busy ranks share the cores evenly. A rank waiting for a
    message computes nothing (gloo's receive sleeps): a pipeline's bubble leaves its cores to the others, so on 4
    ranks of 2 cores a 4-stage 1F1B step of 8 micro-batches takes 0.77 of the step the ranks would take busy in
    lockstep (4 micro-batches: 0.64).

    >>> from autoshard.program.pipeline import PipelineConfig
    >>> even = {s: {"F": 1.0, "B": 2.0} for s in range(4)}
    >>> shared = PipelineConfig("pp", 4, 8, "1F1B", host_cores=2, rates_ranks=4, host_ranks=4)
    >>> simulate(shared, even).span(), simulate(PipelineConfig("pp", 4, 8, "1F1B"), even).span()
    (25.5, 33.0)
    """
    alone = core_contention(config.rates_ranks, config.host_cores)
    works = [sum(seconds(stage, kind) for stage, kind, _ in order) / alone for order in orders.values()]
    # The host's ranks together compute no faster than all its cores, and none faster than alone: the average rank's
    # work alone times the contention bounds any cut of the same micro-batch program (its total work is the same,
    # its busiest rank's may not be).
    least = sum(works) / len(works) * core_contention(config.host_ranks, config.host_cores)
    position = {r: 0 for r in orders}
    running: dict = {}  # rank -> [action, work left (seconds alone), start]
    events, now = [], 0.0
    remaining = sum(len(o) for o in orders.values())
    while remaining:
        waiting = {}  # rank -> when its next action's inputs arrive
        for r, order in orders.items():
            if r in running or position[r] >= len(order):
                continue
            t = ready(*order[position[r]])
            if t is not None and t <= now:
                stage, kind, _ = order[position[r]]
                running[r] = [order[position[r]], seconds(stage, kind) / alone, now]
            elif t is not None:
                waiting[r] = t
        if not running:
            if not waiting:
                _deadlock(config, orders, position)
            now = min(waiting.values())
            continue
        slowdown = core_contention(config.host_ranks * len(running) / config.pp_size, config.host_cores)
        step = min(min(work for _, work, _ in running.values()) * slowdown,
                   min(waiting.values(), default=math.inf) - now)
        now += step
        for r in list(running):
            action, work, start = running[r]
            running[r][1] = work - step / slowdown
            if running[r][1] <= 1e-12 * max(work, 1.0):
                done[action] = now
                events.append((r, *action, start, now))
                position[r] += 1
                remaining -= 1
                del running[r]
    return Timeline(events, source="planned", least_s=least)


def _deadlock(config, orders: dict, position: dict):
    raise PlanError(f"the {config.schedule} action order deadlocks in simulation (at "
                    f"{ {r: orders[r][position[r]] for r in orders if position[r] < len(orders[r])} })")


def planned_timeline(program) -> Timeline:
    """The step the plan predicts: for a pipelined program its schedule (stage table and pp link), for a
    flat one the compute and the links with the overlap (`overlap_timeline`).

    >>> import autoshard
    >>> from autoshard.zoo import mlp
    >>> model, inputs, loss_fn = mlp(n_layers=2)
    >>> pipe = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("pp",),
    ...                              pipeline={"microbatches": 2})
    >>> planned = planned_timeline(pipe)  # == pipe.planned_timeline(); print it, or .plot() in a notebook
    >>> planned.ranks, planned.span() == pipe.plan.pipeline["predicted_step_s"]
    ([0, 1], True)
    """
    if not getattr(program.state, "pipeline_stages", None):
        return overlap_timeline(program.state)
    return pipeline_timeline(program.config, program.state.pipeline_stages)


def overlap_timeline(state) -> Timeline:
    """A flat program's predicted step: row 0 the compute (F forward, B backward), then one row per mesh axis
    link (C collectives, S gradient sync); the sync runs under the backward of earlier layers, and the span
    is the plan's `overlapped_step_s` without ZeRO's optimizer gathers and recomputation
    (autoshard/cost/overlap.py computes both).

    >>> import autoshard
    >>> from autoshard.zoo import mlp
    >>> model, inputs, loss_fn = mlp(n_layers=2)
    >>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
    ...                              hints={"input:0": {"dp": "S(0)"}})
    >>> timeline = overlap_timeline(prog.state)
    >>> [timeline.row_name(r) for r in timeline.ranks]
    ['compute', 'link dp']
    """
    _, events = two_streams(step_works(state), state.options.profile.comm_overlap)
    names = ["compute"] + sorted({stream for stream, *_ in events} - {"compute"})
    rows = {i: name if i == 0 else f"link {name}" for i, name in enumerate(names)}
    index = {name: i for i, name in enumerate(names)}
    return Timeline([(index[stream], 0, label, 0, start, end) for stream, label, start, end in events],
                    rows=rows)


def pipeline_timeline(config, table) -> Timeline:
    """The pipeline's predicted step: the schedule's actions run on the stage table's forward/backward
    times with the stage-to-stage transfers, then each rank's gradient sync ("S"); its span is the one
    predicted step the plan reports (`plan.pipeline["predicted_step_s"]`).

    >>> from autoshard.program.pipeline import PipelineConfig
    >>> table = [{"stage": s, "fwd_s": 1.0, "bwd_s": 2.0, "send_bytes": 0, "sync_s": 0.5} for s in range(2)]
    >>> round(pipeline_timeline(PipelineConfig("pp", 2, 4, "1F1B"), table).span(), 3)  # (m + p - 1) x 3 + 0.5
    15.5
    """
    sends = {row["stage"]: row.get("send_tensors", 1) for row in table}  # across the boundary after the stage
    grads = {row["stage"] + 1: row.get("grad_tensors", 1) for row in table}  # back across the one before it
    durations = {row["stage"]: {"F": row["fwd_s"], "B": row["bwd_s"], "F_sends": sends[row["stage"]],
                                "B_sends": grads.get(row["stage"], 1)} for row in table}
    boundary = max((row["send_bytes"] for row in table), default=0)
    sent = boundary / 2 / config.link.bandwidth
    timeline = simulate(config, durations, config.link.alpha + sent, sent)
    end = max((e[5] for e in timeline.events), default=0.0)
    sync = {config.stage_rank(row["stage"]): 0.0 for row in table}
    for row in table:
        sync[config.stage_rank(row["stage"])] += row.get("sync_s", 0.0)
    timeline.events += [(rank, -1, "S", -1, end, end + seconds) for rank, seconds in sorted(sync.items()) if seconds]
    if timeline.least_s is not None:  # every rank syncs once its compute is done
        timeline.least_s += min(sync.values(), default=0.0)
    return timeline


def measured_timeline(results: dict, program) -> Timeline:
    """The measured step from rank results of `pipeline_rank_run` ({rank: {"timeline": [...]}}): one row
    per pp rank (the rank with intra-op coordinate 0 of each pp coordinate).

    >>> import autoshard
    >>> from autoshard.zoo import mlp
    >>> model, inputs, loss_fn = mlp(n_layers=2)
    >>> pipe = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("pp",),
    ...                              pipeline={"microbatches": 2})
    >>> results = {0: {"timeline": [(0, "F", 0, 0.0, 1.0), (0, "B", 0, 2.0, 4.0)]},  # what ranks report
    ...            1: {"timeline": [(1, "F", 0, 1.0, 2.0)]}}
    >>> print(measured_timeline(results, pipe))
    measured timeline: step 4 s, bubble 50.0%
      pp rank 0: FFFFFFFFFFFFFFFFFF..................BBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB
      pp rank 1: ..................FFFFFFFFFFFFFFFFFF....................................
    """
    events = []
    for rank, res in sorted(results.items()):
        if res is None or program.inner_rank(rank) != 0:
            continue
        pp = program.pp_coord(rank)
        events += [(pp, stage, kind, mb, s0, s1) for stage, kind, mb, s0, s1 in res["timeline"]]
    return Timeline(events, source="measured")
