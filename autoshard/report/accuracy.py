"""How far a plan's predictions are from its run: predicted vs measured step time, per phase, bytes per mesh axis and
peak memory, with the ratio of each (`module.report()` after training steps, the accuracy benchmark).

Phases of one training step, predicted from the plan's per-node costs (autoshard/passes/predict.py):
- forward: each op's forward seconds (a third of its forward + backward where predict gives no split) and each
  collective's forward;
- backward: the rest of each op's and each collective's seconds, and recomputation;
- sync: the rest of the planner's step (gradient all-reduces, ZeRO's reduce-scatters and gathers, ZeRO-3's
  reduce-scatters that the runtime defers to `sync_grads`);
- optimizer: the update (`zero_cost.optimizer_step_time`), which the planner's step leaves out.
A pipelined plan is predicted as a whole (its schedule interleaves the phases): forward and backward together;
its optimizer phase is the pp rank's with the most to update (each updates its own stages' parameters).

Measured phases come from a StepClock: marks at forward start and end and around the gradient sync; the time from
the sync's end to the next forward is the optimizer's (with the rest of the loop's code). Medians over steps.

>>> import autoshard
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
...                              hints={"input:0": {"dp": "S(0)"}})
>>> phases = predicted_phases(prog)
>>> list(phases), abs(sum(phases.values()) - phases["step_s"] * 2) < 1e-12
(['forward_s', 'backward_s', 'sync_s', 'optimizer_s', 'step_s'], True)
"""
from __future__ import annotations

import statistics
import time

from autoshard.cost.pipeline_schedule import rank_nodes, stage_nodes
from autoshard.cost.prediction import node_cost
from autoshard.cost.zero_cost import optimizer_step_time
from autoshard.ir import meta
from autoshard.ir.meta import COMM_COST
from autoshard.report.peak_memory import predicted_peak

PHASES = ("forward_s", "backward_s", "sync_s", "optimizer_s")


def predicted_phases(prog) -> dict:
    """{forward_s, backward_s, sync_s, optimizer_s, step_s} one rank's step is predicted to take (see the module
    docstring; a pipeline: forward_s holds forward and backward, backward_s 0).

    >>> predicted_phases(prog)["step_s"] == prog.plan.predicted["step_time_s"] + predicted_phases(prog)["optimizer_s"]
    True
    """
    state = prog.state
    pipeline = prog.plan.pipeline
    if pipeline:
        sync = max((row.get("sync_s", 0.0) for row in state.pipeline_stages), default=0.0)
        step = pipeline["predicted_step_s"]
        # each pp rank updates its own stages' parameters; the slowest rank's step is the one measured
        held = rank_nodes(prog.config, stage_nodes(state, prog.config.num_stages))
        optimizer = max(optimizer_step_time(state, within) for within in held)
        return {"forward_s": step - sync, "backward_s": 0.0, "sync_s": sync, "optimizer_s": optimizer,
                "step_s": step + optimizer}
    optimizer = optimizer_step_time(state)
    predicted = state.predicted
    forward = backward = 0.0
    for node in state.gm.graph.nodes:
        if node.op != "call_function":
            continue
        comm = node.meta.get(COMM_COST)
        if comm is not None:  # its forward as predict priced it; ZeRO-3's deferred reduce-scatters left to sync
            ahead = node_cost(node).forward_seconds()
            forward += ahead
            backward += comm.seconds - ahead - comm.sync_s
        elif node.meta.get(meta.KIND) != "comm":
            cost = node_cost(node)
            forward += cost.forward_seconds()
            backward += cost.seconds - cost.forward_seconds()
    backward += predicted.recompute_s or 0.0
    sync = max(predicted.step_time_s - forward - backward, 0.0)
    return {"forward_s": forward, "backward_s": backward, "sync_s": sync, "optimizer_s": optimizer,
            "step_s": forward + backward + sync + optimizer}


class StepClock:
    """Measured phases of training steps: `mark("forward")` when a step's forward starts (it also ends the last
    step's optimizer phase), `mark("forward_end")`, `mark("sync")` and `mark("sync_end")` around the gradient
    sync. `phases()` gives the median of each phase over the complete steps, skipping the first `warmup`.

    >>> clock = StepClock(warmup=0, timer=iter([0.0, 1.0, 3.0, 3.5, 4.0, 4.0]).__next__)
    >>> for event in ("forward", "forward_end", "sync", "sync_end", "forward"):
    ...     clock.mark(event)
    >>> clock.phases()
    {'forward_s': 1.0, 'backward_s': 2.0, 'sync_s': 0.5, 'optimizer_s': 0.5, 'step_s': 4.0, 'steps': 1}
    """

    def __init__(self, warmup: int = 1, timer=time.perf_counter, bytes_now=None):
        self.warmup = warmup
        self._timer = timer
        self._bytes_now = bytes_now  # () -> {axis: bytes sent so far}: each step's bytes are the difference
        self._current: dict = {}
        self._sent: dict = {}
        self.steps: list[dict] = []

    def mark(self, event: str) -> None:
        """Record `event` ("forward", "forward_end", "sync", "sync_end") now.

        >>> StepClock().mark("forward")
        """
        now = self._timer()
        if event == "forward" and {"forward", "forward_end", "sync", "sync_end"} <= set(self._current):
            c = self._current
            self.steps.append({"forward_s": c["forward_end"] - c["forward"], "backward_s": c["sync"] - c["forward_end"],
                               "sync_s": c["sync_end"] - c["sync"], "optimizer_s": now - c["sync_end"],
                               "step_s": now - c["forward"]})
            if self._bytes_now is not None:
                sent = self._bytes_now()
                self.steps[-1]["bytes"] = {axis: n - self._sent.get(axis, 0) for axis, n in sent.items()}
        if event == "forward":
            self._current = {}
            if self._bytes_now is not None:
                self._sent = self._bytes_now()
        self._current[event] = now

    def phases(self, statistic: str = "median") -> dict | None:
        """Each phase over the steps after the warm-up (and how many), None before any: the median of each (steps
        an evaluation or a checkpoint lengthens do not count), or with `statistic="mean"` the mean, whose step is
        the loop's time per step (what a job's throughput is: on ranks that share cores the steps of one rank can
        alternate between short and long, and its median then reads whichever it has more of).

        >>> StepClock().phases() is None
        True
        >>> clock = StepClock(warmup=0, timer=iter([0.0, 1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 4.0, 4.0, 5.0,
        ...                                         5.0]).__next__)
        >>> for _ in range(3):  # steps of 1, 1 and 3 s
        ...     for event in ("forward", "forward_end", "sync", "sync_end"):
        ...         clock.mark(event)
        >>> clock.mark("forward")
        >>> clock.phases()["step_s"], clock.phases("mean")["step_s"]
        (1.0, 1.6666666666666667)
        """
        if statistic not in ("median", "mean"):
            raise ValueError(f"statistic is 'median' or 'mean', not {statistic!r}")
        steps = self.steps[self.warmup:]
        if not steps:
            return None
        of = statistics.median if statistic == "median" else statistics.fmean
        out = {key: of([s[key] for s in steps]) for key in (*PHASES, "step_s")}
        if "bytes" in steps[0]:
            out["bytes"] = {axis: statistics.median(s["bytes"].get(axis, 0) for s in steps) for axis in steps[0]["bytes"]}
        return dict(out, steps=len(steps))


def axis_bytes(prog) -> dict:
    """{axis: bytes one rank sends per step} the plan predicts (forward, backward and sync together; a pipeline's
    micro-batch program times its micro-batches).

    >>> axis_bytes(prog)
    {'dp': 33408}
    """
    scale = prog.plan.pipeline["microbatches"] if prog.plan.pipeline else 1
    out = {}
    for name, moved in prog.plan.predicted["comm_bytes_per_step"].items():
        moved = dict(moved)
        out[name] = int((moved["fwd"] + moved["bwd"]) * scale + moved["sync"])
    return out


def accuracy_rows(predicted: dict, measured: dict) -> list[dict]:
    """[{figure, predicted, measured, ratio}] of the figures both sides have (ratio: predicted / measured, None
    where the measured figure is 0).

    >>> accuracy_rows({"step_s": 2.0, "sync_s": 0.0}, {"step_s": 1.0, "sync_s": 0.0})
    [{'figure': 'step_s', 'predicted': 2.0, 'measured': 1.0, 'ratio': 2.0}, {'figure': 'sync_s', 'predicted': 0.0, 'measured': 0.0, 'ratio': None}]
    """
    rows = []
    for key, value in predicted.items():
        if key not in measured or measured[key] is None:
            continue
        got = measured[key]
        rows.append({"figure": key, "predicted": value, "measured": got, "ratio": value / got if got else None})
    return rows


def format_rows(rows: list[dict]) -> str:
    """The rows as an aligned text table (seconds in ms, bytes in MiB).

    >>> print(format_rows([{"figure": "step_s", "predicted": 0.002, "measured": 0.001, "ratio": 2.0}]))
    figure          predicted    measured   predicted/measured
    step            2.000 ms     1.000 ms   2.00
    """
    def show(key, value):
        if value is None:
            return "-"
        return f"{value * 1e3:.3f} ms" if key.endswith("_s") else f"{value / 2**20:.3f} MiB"
    lines = [f"{'figure':<15} {'predicted':<12} {'measured':<10} predicted/measured"]
    for row in rows:
        name = row["figure"].removesuffix("_s").removesuffix("_bytes")
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}"
        lines.append(f"{name:<15} {show(row['figure'], row['predicted']):<12} "
                     f"{show(row['figure'], row['measured']):<10} {ratio}")
    return "\n".join(lines)


def log_bytes(comm) -> dict:
    """{axis: bytes this rank's communicator has sent so far} (its CommLog, every phase).

    >>> from autoshard.runtime.communicator import CommLog
    >>> class Comm:
    ...     log = CommLog()
    >>> Comm.log.record("dp", "all_reduce", 64, "sync")
    >>> log_bytes(Comm)
    {'dp': 64}
    """
    out: dict = {}
    for (axis, _, _), n in comm.log.bytes.items():
        out[axis] = out.get(axis, 0) + n
    return out


def peak_memory_bytes(device) -> int | None:
    """The peak bytes the allocator held on `device` since the last reset (CUDA); None on a CPU, whose allocator
    keeps no statistics (benchmarks/memory_accuracy.py measures a CPU rank's tensors with a dispatch mode).

    >>> import torch
    >>> peak_memory_bytes(torch.device("cpu")) is None
    True
    """
    import torch

    if getattr(device, "type", device) == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated(device))
    return None


def predicted_memory_bytes(prog) -> int:
    """The plan's predicted bytes per device (a pipeline's fullest pp rank).

    >>> predicted_memory_bytes(prog) == prog.plan.predicted["memory_bytes_per_rank"]
    True
    """
    pipeline = prog.plan.pipeline
    if pipeline and pipeline.get("memory_bytes_per_pp_rank"):
        return int(max(pipeline["memory_bytes_per_pp_rank"]))
    return int(prog.plan.predicted["memory_bytes_per_rank"])


class AccuracyReport:
    """Predicted vs measured figures of one rank's training steps: `rows` ({figure, predicted, measured, ratio}),
    printed as a table; `to_json()` for logs.

    >>> clock = StepClock(warmup=0, timer=iter([0.0, 1.0, 3.0, 3.5, 4.0, 4.0]).__next__)
    >>> for event in ("forward", "forward_end", "sync", "sync_end", "forward"):
    ...     clock.mark(event)
    >>> report = AccuracyReport.of(prog, clock.phases())
    >>> [row["figure"] for row in report.rows]
    ['forward_s', 'backward_s', 'sync_s', 'optimizer_s', 'step_s']
    """

    def __init__(self, rows: list[dict], steps: int, note: str = ""):
        self.rows, self.steps, self.note = rows, steps, note

    @classmethod
    def of(cls, prog, measured: dict | None, peak_bytes: int | None = None, exact: bool = False,
           overlap: bool = True, pp_rank: int | None = None) -> AccuracyReport:
        """The report of `prog`'s predictions against `measured` (a StepClock's phases, with "bytes" per axis when
        counted) and the measured peak memory: against the step's predicted peak (autoshard/report/peak_memory.py:
        `exact` reductions, buckets started in backward with `overlap`, torch's foreach Adam on a GPU; a
        pipeline's pp rank `pp_rank`, the measuring rank) where it is modelled, else the footprint.

        >>> AccuracyReport.of(prog, None).steps
        0
        """
        if not measured:
            return cls([], 0, "no complete training step measured yet (forward, backward with the gradient sync, "
                              "then the next forward)")
        rows = accuracy_rows(predicted_phases(prog), measured)
        sent = measured.get("bytes")
        if sent is not None:
            predicted = axis_bytes(prog)
            rows += accuracy_rows({f"{axis}_bytes": n for axis, n in predicted.items()},
                                  {f"{axis}_bytes": sent.get(axis, 0) for axis in predicted})
        if peak_bytes is not None:
            peak = predicted_peak(prog, exact=exact, overlap=overlap, foreach=True, pp_rank=pp_rank)
            rows += accuracy_rows({"peak_memory_bytes": peak["bytes"] if peak else predicted_memory_bytes(prog)},
                                  {"peak_memory_bytes": peak_bytes})
        note = "" if peak_bytes is not None else "peak memory: measured on CUDA devices only"
        return cls(rows, measured["steps"], note)

    def to_json(self) -> dict:
        """{"steps", "rows", "note"}.

        >>> AccuracyReport([], 0).to_json()
        {'steps': 0, 'rows': [], 'note': ''}
        """
        return {"steps": self.steps, "rows": self.rows, "note": self.note}

    def __str__(self) -> str:
        if not self.rows:
            return self.note
        head = f"predicted vs measured, median of {self.steps} step{'s' if self.steps != 1 else ''}\n"
        return head + format_rows(self.rows) + (f"\n({self.note})" if self.note else "")

    __repr__ = __str__
