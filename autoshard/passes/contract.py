"""What a pass declares: its name, what it reads and writes (node meta keys, CompileState fields as
"state.<field>") and the invariants it establishes. The pass manager checks a pipeline's order against
these declarations before running it, and in debug runs checks each established invariant after every
later pass (autoshard/passes/verifier.py holds the invariants).

>>> @compiler_pass("count_ops", reads=(meta.SPEC,), writes=("state.predicted",))
... def count_ops(state):
...     state.predicted = {"ops": len(state.gm.graph.nodes)}
>>> count_ops.name, count_ops.contract.writes
('count_ops', ('state.predicted',))
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from autoshard.ir import meta

# What trace (autoshard/frontend/trace.py) and CompileState's constructor give every pipeline.
TRACED = ("val", meta.KIND, meta.PATH, meta.ALIASES, "state.gm", "state.mesh", "state.traced", "state.hints",
          "state.options", "state.model", "state.fold")
NORMALIZED = "normalized graph"  # normalize's rewrite: every op in a form whose sharding rules are local and exact


@dataclass(frozen=True)
class Contract:
    """A pass's declaration: `reads` must have been written by an earlier pass (or by trace), `writes`
    are what it leaves, `ensures` names invariants (verifier.INVARIANTS) that hold from then on.

    >>> Contract(reads=(meta.SPEC,), writes=(meta.COMM,), ensures=("edges_match",)).ensures
    ('edges_match',)
    """

    reads: tuple = ()
    writes: tuple = ()
    ensures: tuple = ()


class PassOrderError(AssertionError):
    """A pipeline runs a pass before the pass that writes what it reads (an autoshard bug, or a user's
    pipeline in the wrong order).

    >>> try:
    ...     check_order([count_ops])
    ... except PassOrderError as exc:
    ...     print(exc)
    pass 'count_ops' reads 'autoshard.spec', which no pass before it writes (passes in order: ['count_ops'])
    """


def compiler_pass(name: str, reads=(), writes=(), ensures=()) -> Callable:
    """Decorator: give a pass function its name and Contract.

    >>> count_ops.contract.reads
    ('autoshard.spec',)
    """
    def declare(fn):
        fn.name = name
        fn.contract = Contract(tuple(reads), tuple(writes), tuple(ensures))
        return fn
    return declare


def contract_of(pass_) -> Contract | None:
    """A pass's Contract (None for an undeclared callable: the manager runs it unchecked).

    >>> contract_of(count_ops).writes, contract_of(lambda state: None)
    (('state.predicted',), None)
    """
    return getattr(pass_, "contract", None)


def pass_name(pass_) -> str:
    """A pass's name: its `name` attribute (compiler_pass sets it), else its __name__.

    >>> pass_name(count_ops), pass_name(len)
    ('count_ops', 'len')
    """
    return getattr(pass_, "name", getattr(pass_, "__name__", type(pass_).__name__))


def check_order(passes, provided=TRACED) -> None:
    """Raise PassOrderError when a pass reads something that neither `provided` nor an earlier pass writes.

    >>> check_order([count_ops], provided=TRACED + (meta.SPEC,))
    """
    written = set(provided)
    names = [pass_name(p) for p in passes]
    for name, pass_ in zip(names, passes):
        contract = contract_of(pass_)
        if contract is None:
            continue
        missing = [key for key in contract.reads if key not in written]
        if missing:
            raise PassOrderError(f"pass {name!r} reads {missing[0]!r}, which no pass before it writes "
                                 f"(passes in order: {names})")
        written.update(contract.writes)


def established_invariants(passes) -> list[tuple]:
    """Per pass, the invariants that hold after it: those it and the passes before it ensure.

    >>> established_invariants([count_ops])
    [()]
    """
    held, out = [], []
    for pass_ in passes:
        contract = contract_of(pass_)
        held += [i for i in (contract.ensures if contract else ()) if i not in held]
        out.append(tuple(held))
    return out
