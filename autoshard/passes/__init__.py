"""The compiler passes, one per file, run in order by `autoshard.passes.pass_lists.PASSES` (see DESIGN.md).

Each pass reads and writes `node.meta["autoshard.*"]` (autoshard/ir/meta.py) and declared fields of the
CompileState; its Contract (`@compiler_pass`, autoshard/passes/contract.py) declares what it reads, writes
and ensures, the manager checks a pipeline's order against them, and its docstring says the same in words.
`autoshard.passes.pass_lists.state_before(name, ...)` gives the state a pass sees, to watch it on a small graph.

>>> from autoshard.passes.pass_lists import PASSES
>>> [p.name for p in PASSES]
['normalize', 'annotate', 'strategies', 'solve', 'zero', 'unfold', 'insert_comm', 'fuse_comm', 'predict', 'recompute', 'check_hints', 'codegen']
"""
