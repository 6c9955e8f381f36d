"""The pass manager: checks a pipeline's order, runs its passes, times them, keeps each pass's graph
text, verifies.

A pass is a callable `pass_(state) -> None` with a `name` and a Contract (autoshard/passes/contract.py):
what it reads and writes of `node.meta["autoshard.*"]` and of the CompileState's declared fields, and the
invariants it establishes. Before running, the manager checks that every pass reads only what trace or an
earlier pass wrote; in tests and debug runs `verify_state` checks the established invariants after every
pass and names the node, placement and axis.

>>> import torch
>>> from autoshard.frontend.trace import trace
>>> from autoshard.ir.mesh import Mesh
>>> from autoshard.passes.normalize import normalize
>>> traced = trace(torch.nn.Linear(4, 2), (torch.randn(8, 4),))
>>> state = CompileState(traced.gm, Mesh((2,), ("dp",)), traced)
>>> history = run_passes(state, [normalize], verify=True)
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import fx

from autoshard.cost.prediction import Prediction
from autoshard.frontend.request import CompileOptions
from autoshard.ir import meta
from autoshard.ir.mesh import Mesh
from autoshard.passes.contract import (
    TRACED,
    check_order,
    established_invariants,
    pass_name,
)
from autoshard.passes.verifier import verify_state
from autoshard.report.progress import StepProgress


@dataclass(slots=True)
class CompileState:
    """What the passes share: the graph, the mesh, the user's hints and options, and the fields passes
    write (each pass's contract names the ones it reads and writes; slots: no field is added from outside).

    >>> state.mesh, state.grad_reduce, state.options.rng
    (Mesh(dp=2), {}, 'placement')
    """

    gm: fx.GraphModule
    mesh: Mesh
    traced: object  # frontend.trace.Traced
    hints: object = None  # the user's hints (dict or Hints); annotate parses them into Hints
    options: CompileOptions = field(default_factory=CompileOptions)
    model: object = None  # the user's nn.Module: weights="init" replays its initialisation, buffers come from it
    grad_reduce: dict = field(default_factory=dict)  # insert_comm: param FQN -> axes its gradient is reduced on
    ilp_stats: list = field(default_factory=list)  # solve: one entry per ILP solved
    ilp_stopped: list = field(default_factory=list)  # compile_state: the IlpResults its time limit stopped
    objective_s: float | None = None  # solve / apply_plan: the plan's objective
    memory_row_bytes: float | None = None  # solve / apply_plan: the ILP's memory row at the plan (every axis)
    memory_savers: object = None  # solve: the MemorySavers its memory row assumed; zero and recompute apply them
    zero: object = None  # zero: ZeroConfig or None
    recompute_regions: list = field(default_factory=list)  # recompute: module paths, graph order
    predicted: Prediction | None = None  # predict: step time, communication, memory (cost/prediction.py)
    pipeline_stages: list | None = None  # cut_stages: one summary dict per stage
    fold: object = None  # compile_state: the Fold when three repeated layers stand for all (frontend/fold.py)

    def __post_init__(self):
        self.options = CompileOptions.of(self.options)

    @property
    def semi_auto(self) -> bool:
        """Any user constraint (hint file/dict or `autoshard.constrain` in forward) makes the plan
        semi-automatic: hinted shardings propagate; unhinted parameters stay replicated on the axes where
        the user sharded an input (data parallelism) and elsewhere follow their ops (a bias its weight).

        >>> state.semi_auto, CompileState(state.gm, state.mesh, traced, hints={"input:0": {"dp": "S(0)"}}).semi_auto
        (False, True)
        """
        return bool(self.hints) or any(meta.HINT in n.meta or meta.INPUT_HINT in n.meta
                                       for n in self.gm.graph.nodes)


@dataclass(frozen=True)
class HistoryEntry:
    """One pass's record: name, seconds, and the annotated graph it left.

    >>> print(HistoryEntry("normalize", 0.012, "add = linear + bias"))
    # after normalize (12 ms)
    add = linear + bias
    """

    name: str
    seconds: float
    graph_text: str

    def __repr__(self) -> str:
        return f"# after {self.name} ({self.seconds * 1e3:.0f} ms)\n{self.graph_text}"


class History(list):
    """`prog.history`: printable list of HistoryEntry.

    >>> history[0].name, "aten.add.Tensor" in history[0].graph_text  # the linear's bias became an add
    ('normalize', True)
    """

    def __repr__(self) -> str:
        return "\n\n".join(repr(e) for e in self)

    def summary(self) -> str:
        """One line per pass: its name and milliseconds.

        >>> print(history.summary())  # doctest: +ELLIPSIS
        normalize ... ms
        """
        return "\n".join(f"{e.name:<14} {e.seconds * 1e3:8.1f} ms" for e in self)


HISTORY_TEXT_MAX_NODES = 2000  # larger graphs' text costs more than their passes and is not read line by line


def _graph_text(state, describe, keep: bool) -> str:
    """The graph's text after a pass: kept for graphs up to HISTORY_TEXT_MAX_NODES, or always in debug runs."""
    gm = getattr(state, "gm", None)
    n = len(gm.graph.nodes) if gm is not None else 0
    if n > HISTORY_TEXT_MAX_NODES and not keep:
        return (f"({n} nodes: the text of graphs over {HISTORY_TEXT_MAX_NODES} nodes is kept only with "
                "parallelize(debug=True))")
    return describe(state) if describe is not None else state.gm.graph.python_code("self").src


def run_passes(state: CompileState, passes: list[Callable], verify: bool = False,
               describe: Callable | None = None, provided=TRACED) -> History:
    """Check the passes' order against their contracts (`provided`: what the state holds before the first),
    run them on `state` and return their history. `describe(state)` renders the graph text; `verify` checks
    the established invariants after each pass (`verify_state`).

    >>> [entry.name for entry in run_passes(state, [normalize])]
    ['normalize']
    """
    check_order(passes, provided)
    invariants = established_invariants(passes)
    history = History()
    with StepProgress(len(passes), "autoshard planning") as progress:  # a bar only for passes over 1 s
        for pass_, held in zip(passes, invariants):
            start = time.perf_counter()
            with progress.step(pass_name(pass_)):
                pass_(state)
            seconds = time.perf_counter() - start
            text = _graph_text(state, describe, keep=verify)
            history.append(HistoryEntry(pass_name(pass_), seconds, text))
            if verify:
                verify_state(state, after=pass_name(pass_), invariants=held)
    return history

