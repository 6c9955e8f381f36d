"""apply_plan: take every node's strategy from a saved Plan instead of solving (runs in solve's place;
`CheckPlan` runs the same node-by-node comparison right after normalize, before the plan's hints).

Reads the Plan's rows (each with its `choice` per mesh axis), `autoshard.candidates`, `autoshard.hint`
and FakeTensor vals. Writes what solve writes: `autoshard.choice`, `autoshard.spec`,
`autoshard.in_specs`, `autoshard.grad_partial`, `state.objective_s` and `state.memory_row_bytes` (the plan's
objective and memory row, as solve records them) and `state.ilp_stats = []` (nothing was solved).
Invariant: the plan's rows (inserted collectives aside) match the graph's nodes one to one in order —
name, op, module path, kind, shape and dtype — and each chosen strategy is one solve could have chosen
on that axis (solve's `_axis_candidates`: divisible after the earlier axes, hints respected); otherwise
PlanMismatchError names the first node where the plan and the traced graph differ.

>>> import autoshard
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> hints = {"input:0": {"dp": "S(0)"}}
>>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",), hints=hints)
>>> again = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",), plan=prog.plan)
>>> [entry.name for entry in again.history][:5], again.plan.fingerprint == prog.plan.fingerprint
(['normalize', 'unfold', 'check_plan', 'annotate', 'strategies'], True)
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import ClassVar

import torch

from autoshard.cost.axis_cost import needs_grad
from autoshard.frontend.hints import RECOMPUTE_KEY, Hints
from autoshard.ir import meta
from autoshard.ir.errors import UserInputError
from autoshard.ir.json_files import short
from autoshard.ir.mesh import Mesh
from autoshard.ir.placement import describe_type, dtype_name
from autoshard.passes.choice import axis_candidates, record_choice
from autoshard.passes.contract import NORMALIZED, Contract
from autoshard.passes.memory_fit import MemorySavers
from autoshard.passes.solve import plan_figures
from autoshard.plan.io import PlanMismatchError
from autoshard.plan.plan import Plan, op_name
from autoshard.strategies.base import is_tensor_value

_REPLAN = ("pass the plan saved for this model and these example inputs (same shapes and dtypes), or re-plan "
           "without plan=")


def resolve_plan(plan, mesh: Mesh, hints):
    """`parallelize(plan=...)`: the Plan (loaded when a path) and the hints to compile with (the plan's
    own unless the caller's agree with them); a plan for another mesh or other hints is an error.

    >>> resolve_plan(prog.plan, Mesh((2,), ("dp",)), None)[1]
    {'input:0': {'dp': 'S(0)'}}
    >>> resolve_plan(prog.plan, Mesh((2,), ("tp",)), None)
    Traceback (most recent call last):
    ...
    autoshard.plan.io.PlanMismatchError: the plan was made for mesh Mesh(dp=2) but parallelize got Mesh(tp=2); ...
    """
    if isinstance(plan, (str, os.PathLike)):
        plan = Plan.load(plan)
    elif not isinstance(plan, Plan):
        raise UserInputError(f"plan= takes a Plan or the path of a plan file written by Plan.save, got {short(plan)}")
    if plan.mesh.shape != mesh.shape or plan.mesh.names != mesh.names or plan.mesh.named != mesh.named:
        axes = f"axis_names={plan.mesh.names!r}" if plan.mesh.named else "no axis_names"

        def shown(m):  # an unnamed mesh prints like one named a0, a1, ...: say which it is
            return repr(m) if m.named else f"{m!r} (unnamed: the planner chose each axis's role)"
        raise PlanMismatchError(f"the plan was made for mesh {shown(plan.mesh)} but parallelize got {shown(mesh)}; pass "
                                f"mesh={plan.mesh.shape!r} with {axes}, or re-plan without plan= for the new mesh")
    if hints is None:
        return plan, (plan.hints or None)
    given = Hints.load(hints).to_json()
    planned = plan.hints or {}
    if RECOMPUTE_KEY not in given and given == {k: v for k, v in planned.items() if k != RECOMPUTE_KEY}:
        return plan, plan.hints  # the hints it was made with: the plan adds the regions it recomputes
    if given != plan.hints:
        raise PlanMismatchError(f"hints= differ from the hints the plan was made with: {_hints_difference(given, plan.hints)}"
                                "; leave hints out when passing plan= (the plan carries its hints), or re-plan "
                                "without plan= to use the new hints")
    return plan, hints


def _hints_difference(given: dict, planned: dict) -> str:
    """The keys on which two hint dicts differ, the first three of each kind (their shared keys are many).

    >>> print(_hints_difference({"a": {"tp": "R"}, "b": {}}, {"a": {"tp": "S(0)"}, "zero": {"dp": 3}}))
    'a' is {'tp': 'R'} here but {'tp': 'S(0)'} in the plan; only in hints=: 'b'; only in the plan: 'zero' (...)
    """
    def brief(value) -> str:
        text = repr(value)
        return text if len(text) <= 80 else text[:77] + "..."

    planned = planned or {}
    changed = [f"{k!r} is {brief(given[k])} here but {brief(planned[k])} in the plan"
               for k in sorted(set(given) & set(planned)) if given[k] != planned[k]]
    extra, missing = sorted(set(given) - set(planned)), sorted(set(planned) - set(given))
    parts = changed[:3] + (["only in hints=: " + ", ".join(map(repr, extra[:3]))] if extra else []) \
        + (["only in the plan: " + ", ".join(map(repr, missing[:3]))] if missing else [])
    text = "; ".join(parts)
    return text + (" (parallelize(zero=...) is kept with the plan's hints)" if "zero" in missing else "")


@dataclass(frozen=True, eq=False)
class CheckPlan:
    """Runs right after normalize: a plan for another model fails here, before its hints are resolved.

    >>> other, other_inputs, _ = mlp(n_layers=3)
    >>> autoshard.parallelize(other, (2,), other_inputs, axis_names=("dp",), plan=prog.plan)
    Traceback (most recent call last):
    ...
    autoshard.plan.io.PlanMismatchError: the plan was made for another model or other example inputs: ...
    """

    plan: Plan
    same_shapes: bool = True
    name: str = "check_plan"
    contract: ClassVar[Contract] = Contract(reads=(NORMALIZED,))

    def __call__(self, state) -> None:
        match_rows(self.plan, state.gm.graph, self.same_shapes)


@dataclass(frozen=True, eq=False)
class ApplyPlan:
    """The pass, in solve's place: `ApplyPlan(plan)(state)`.

    >>> from autoshard.passes.pass_lists import state_before
    >>> state = state_before("solve", model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",), hints=hints)
    >>> ApplyPlan(prog.plan)(state)
    >>> next(n for n in state.gm.graph.nodes if n.name == "inputs_0").meta["autoshard.spec"]
    [S(0)]
    """

    plan: Plan
    same_shapes: bool = True
    name: str = "apply_plan"
    contract: ClassVar[Contract] = Contract(
        reads=(meta.CANDIDATES, meta.HINT), writes=(meta.CHOICE, meta.SPEC, meta.IN_SPECS, meta.GRAD_PARTIAL,
                                                    "state.ilp_stats", "state.objective_s",
                                                    "state.memory_row_bytes", "state.memory_savers"))

    def __call__(self, state) -> None:
        mesh = state.mesh
        pairs = match_rows(self.plan, state.gm.graph, self.same_shapes)
        nodes = [node for node, _ in pairs]
        choices: dict = {n: [] for n in nodes}
        zero3 = {mesh.axis(a) for a, stage in (self.plan.hints or {}).get("zero", {}).items() if stage == 3}
        for node, row in pairs:
            for axis in range(mesh.ndim):
                feasible = axis_candidates(node, axis, mesh, choices)
                wanted = row.choice[axis] if row is not None else _cast_choice(node, axis, choices, zero3)
                chosen = next((c for c in feasible if c.to_json() == wanted), None)
                if chosen is None:
                    text = f"({', '.join(wanted['inputs'])}) -> {wanted['output']} {wanted.get('method', '')}".rstrip()
                    where = f"{row.name!r} ({row.op} at {row.path or 'the top level'})" if row is not None else \
                        f"{node.name!r} (the cast of a ZeRO-3 parameter)"
                    raise PlanMismatchError(
                        f"the plan chooses {text} for node {where} "
                        f"on mesh axis {mesh.names[axis]!r}, which is not a strategy autoshard can use there "
                        f"(it can use {', '.join(map(repr, feasible[:6]))}{' ...' if len(feasible) > 6 else ''}): "
                        "the plan was made for other shapes or hints, by another autoshard version, or edited; "
                        f"{_REPLAN}")
                choices[node].append(chosen)
        grad = needs_grad(state.gm.graph)
        for node in nodes:
            record_choice(node, choices[node], grad)
        state.ilp_stats = []
        state.memory_savers = MemorySavers()  # a saved plan's ZeRO and recomputation come from its hints
        state.objective_s, state.memory_row_bytes = plan_figures(state)


def _cast_choice(node, axis: int, choices: dict, zero3: set) -> dict:
    """What solve chose for a parameter cast that fuse_comm folded away: it follows the parameter, which ZeRO-3 shards
    only after solve (on its axis the cast read the replicated parameter)."""
    source = choices[node.args[0]][axis].output
    placement = "R" if axis in zero3 else repr(source)
    return {"inputs": [placement], "output": placement}


def match_rows(plan: Plan, graph, same_shapes: bool = True) -> list:
    """(node, row) for every node solve would decide (placeholders and tensor-valued ops), in graph order;
    the first node where the plan and the graph differ raises PlanMismatchError. With `same_shapes=False` the
    sizes of a node's dims may differ from the plan's (the same program at another batch size or sequence
    length): its rank, dtype, op and module must not.

    >>> node, row = match_rows(prog.plan, prog.state.gm.graph)[0]
    >>> node.name == row.name, row.path
    (True, 'layers.0.weight')
    """
    rows = [r for r in plan.rows if r.kind != "comm"]
    nodes = [n for n in graph.nodes if n.op == "placeholder" or (n.op == "call_function" and is_tensor_value(n))]
    by_name = {r.name: r for r in rows}
    fused = [n for n in nodes if n.name not in by_name and fused_parameter_cast(n)]
    if fused and len(by_name) == len(rows) == len(nodes) - len(fused) and \
            all(n.name in by_name for n in nodes if n not in fused):
        # fuse_comm folds the cast of a ZeRO-3 parameter into its all-gather (bf16 on the wire), so the plan has no
        # row for it: it gets row None, and ApplyPlan gives it the placements solve gave it (see there).
        pairs = [(node, by_name.get(node.name)) for node in nodes]
        for node, row in pairs:
            problem = _difference(row, node, same_shapes) if row is not None else None
            if problem:
                raise PlanMismatchError(f"the plan was made for another model or other example inputs: {problem}; "
                                        f"{_REPLAN}")
        return pairs
    for index in range(max(len(rows), len(nodes))):
        row = rows[index] if index < len(rows) else None
        node = nodes[index] if index < len(nodes) else None
        problem = _difference(row, node, same_shapes)
        if problem:
            raise PlanMismatchError(f"the plan was made for another model or other example inputs: {problem}; "
                                    f"{_REPLAN}")
    return list(zip(nodes, rows))


def fused_parameter_cast(node) -> bool:
    """Whether `node` casts a parameter (mixed precision's compute copy), which fuse_comm folds into the parameter's
    ZeRO-3 all-gather.

    >>> [n.name for n in prog.state.gm.graph.nodes if fused_parameter_cast(n)]  # float32: no casts
    []
    """
    if node.op != "call_function" or node.target not in _CASTS or not node.args:
        return False
    source = node.args[0]
    return getattr(source, "op", None) == "placeholder" and source.meta.get(meta.KIND) == "param"


_CASTS = (torch.ops.aten.to.dtype, torch.ops.aten._to_copy.default)


def _describe_row(row) -> str:
    return f"node {row.name!r} ({row.op} at {row.path or 'the top level'}, {row.kind}, {_unsharded(row.type)})"


def _unsharded(type_text: str) -> str:
    """`f32[8@dp, 16@tp]{P@a0}` -> `f32[8, 16]`: the global shape and dtype, whatever the placements."""
    return re.sub(r"(@\w+)+", "", re.sub(r"\{P@[\w,]+\}$", "", type_text))


def _describe_node(node) -> str:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        typ = describe_type(tuple(val.shape), None, (), dtype_name(val.dtype))
    else:
        typ = describe_type((), None, (), "tuple")
    path = node.meta.get(meta.PATH, "")
    return f"node {node.name!r} ({op_name(node)} at {path or 'the top level'}, {node.meta.get(meta.KIND, '')}, {typ})"


def _difference(row, node, same_shapes: bool = True) -> str:
    """'' when the plan row describes the node; otherwise the first difference, in words."""
    if node is None:
        return f"the traced graph ends before the plan's {_describe_row(row)}"
    here = _describe_node(node)
    if row is None:
        return f"the plan ends before the traced graph's {here}"
    planned = _describe_row(row)
    alike = here == planned if same_shapes else _sizes_blank(here) == _sizes_blank(planned)
    if not alike:
        return f"the plan has {planned} where the traced graph has {here}"
    return ""


def _sizes_blank(description: str) -> str:
    """A node's description with every dim size blanked: `f32[8, 16]` -> `f32[_, _]` (the rank stays).

    >>> _sizes_blank("node 'x' (op at a, input, f32[8, 16])")
    "node 'x' (op at a, input, f32[_, _])"
    """
    return re.sub(r"\b\d+\b(?=[,\]])", "_", description)
