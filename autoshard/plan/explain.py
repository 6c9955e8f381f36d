"""`Plan.explain(path)`: why each op of a module got its placement — the alternatives and their costs.

For every op under the module path and every mesh axis: each candidate strategy with its compute,
backward communication, gradient sync and memory (from the solver's cost model), plus the resharding
its inputs and outputs would need given what the neighbours chose. The chosen one is starred.

>>> import autoshard
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
...                              hints={"input:0": {"dp": "S(0)"}})
"""
from __future__ import annotations

from autoshard.cost.axis_cost import AxisCostModel, needs_grad
from autoshard.ir import meta
from autoshard.strategies import tensor_inputs


def _origin(node):
    """Look through inserted collectives to the value the solver saw."""
    while node.meta.get(meta.KIND) == "comm":
        node = node.args[0]
    return node


def _consumers(node):
    for user in node.users:
        if user.meta.get(meta.KIND) == "comm":
            yield from _consumers(user)
        elif meta.CHOICE in user.meta:
            yield user


def explain_nodes(state, path: str) -> str:
    """The text of `Plan.explain(path)`: per op under `path` and per mesh axis, each candidate's costs.

    >>> for line in explain_nodes(prog.state, "layers.0").splitlines()[:3]:  # doctest: +ELLIPSIS
    ...     print(line)
    layers.0: linear_default = aten.linear.default  spec [S(0)]
      axis dp (size 2):
         (R, R) -> R ... compute ...
    >>> explain_nodes(prog.state, "no.such.module")
    "no op under module path 'no.such.module'; module paths in this plan: input:0, layers.0, ..."
    """
    mesh = state.mesh
    profile = state.options.profile
    grad = needs_grad(state.gm.graph)
    models = [AxisCostModel(mesh, a, profile, grad) for a in range(mesh.ndim)]
    nodes = [n for n in state.gm.graph.nodes if n.op == "call_function" and meta.CHOICE in n.meta
             and (n.meta.get(meta.PATH, "") == path or n.meta.get(meta.PATH, "").startswith(path + ".") or not path)]
    if not nodes:
        known = sorted({n.meta.get(meta.PATH, "") for n in state.gm.graph.nodes if meta.CHOICE in n.meta} - {""})
        return f"no op under module path {path!r}; module paths in this plan: {', '.join(known[:20])}"
    lines = []
    for node in nodes:
        lines.append(f"{node.meta.get(meta.PATH) or '(top level)'}: {node.name} = {node.target}  spec "
                     f"{node.meta[meta.SPEC]!r}")
        chosen = node.meta[meta.CHOICE]
        inputs = [_origin(n) for n in tensor_inputs(node)]
        for axis in range(mesh.ndim):
            lines.append(f"  axis {mesh.names[axis]} (size {mesh.shape[axis]}):")
            others = {b: c for b, c in enumerate(chosen) if b != axis}
            for cand in node.meta[meta.CANDIDATES][axis]:
                cost = models[axis].node(node, cand, others)
                reshard = sum(models[axis].edge(p, p.meta[meta.CHOICE][axis].output, cand.inputs[i],
                                                {b: c for b, c in enumerate(p.meta[meta.CHOICE]) if b != axis})
                              for i, p in enumerate(inputs) if meta.CHOICE in p.meta)
                for user in _consumers(node):
                    for pos, p in enumerate(tensor_inputs(user)):
                        if _origin(p) is node:
                            reshard += models[axis].edge(node, cand.output, user.meta[meta.CHOICE][axis].inputs[pos],
                                                         others)
                total = cost.compute + cost.comm_bwd + cost.sync + reshard
                mark = "*" if cand == chosen[axis] else " "
                lines.append(f"   {mark} {cand!r:<28} compute {cost.compute:.3g}s  comm_bwd {cost.comm_bwd:.3g}s  "
                             f"sync {cost.sync:.3g}s  reshard {reshard:.3g}s  memory {cost.memory:.0f}B  "
                             f"total {total:.3g}s")
    return "\n".join(lines)
