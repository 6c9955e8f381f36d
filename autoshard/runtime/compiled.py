"""`parallelize(..., compile=True)`: each rank's program compiled by torch.compile (inductor).

A rank's GraphModule is compiled in place with `nn.Module.compile`, so it stays the same module: its
parameters are the ones the optimizer updates (dynamo passes a module's parameters to the compiled graph
as inputs, so no copy can go stale) and its state dict keeps its names. AOTAutograd compiles the backward.

- The collectives become custom ops of the graph (autoshard/runtime/graph_collectives.py): the same
  communicator calls and bytes, forward and backward, but no graph break, so a rank program without
  random ops is one forward and one backward graph. (Breaking the graph at each collective, the obvious
  way, made every model slower than eager: each piece's guards and autograd wrappers cost more than
  inductor saved on the compute between two collectives.)
- What must run as the eager runtime runs it is called through `torch.compiler.disable`, where dynamo
  breaks the graph: random ops (`random_op`: the rank's stream draws each mask, so `rng="placement"` and
  `rng="exact"` draw the very masks they draw eagerly; inductor's own generator would draw others);
  ZeRO-3's parameter gathers (their saved-tensor hooks keep only shards between forward and backward);
  submodules that are not graphs (activation recomputation's wrappers, which run torch.utils.checkpoint
  eagerly; the region's own graph is compiled in its turn).

Results equal the eager program's within float rounding (inductor fuses and reorders arithmetic).
Inductor compiles C++ kernels on the CPU: `require_cpp_compiler()` says which compiler it would use and
fails with what to do when there is none.

>>> import torch
>>> from autoshard.runtime.collectives import all_reduce
>>> from autoshard.runtime.communicator import DistCommunicator
>>> from autoshard.ir.mesh import Mesh
>>> solo = DistCommunicator(Mesh((1,), ("tp",)), 0, groups={}, mesh_group=None)  # one rank: no process group
>>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
>>> compile_rank_graph(gm, solo) is gm  # in place; compiled on its first call
True
"""
from __future__ import annotations

import functools
import os
import shutil
import sys
import warnings

import torch
from torch import fx

from autoshard.ir.errors import UserInputError
from autoshard.runtime.collectives import COLLECTIVES
from autoshard.runtime.graph_collectives import IN_GRAPH, register
from autoshard.runtime.rng import random_op
from autoshard.runtime.thread_communicator import ThreadCommunicator

_IN_GRAPH = {COLLECTIVES[name]: name for name in IN_GRAPH}
_EAGER = (frozenset(COLLECTIVES.values()) - set(_IN_GRAPH)) | {random_op}


def require_cpp_compiler() -> str:
    """The C++ compiler inductor will build CPU kernels with (`$CXX`, else g++; clang++ on macOS, as
    inductor chooses); a UserInputError naming what to install when it is not on PATH.

    >>> os.path.basename(require_cpp_compiler())  # this machine's
    'g++'
    """
    default = "clang++" if sys.platform == "darwin" else "g++"
    name = os.environ.get("CXX") or default
    found = shutil.which(name)
    if found is None:
        raise UserInputError(f"compile=True: torch.compile's inductor backend builds C++ kernels for the CPU with "
                             f"{name!r} ($CXX, default {default!r}), which is not on PATH; install a C++ compiler "
                             "(e.g. apt-get install g++) or point CXX at one, or drop compile=True to run eagerly")
    return found


def compile_rank_graph(gm: fx.GraphModule, comm, mixed_precision: bool = False) -> fx.GraphModule:
    """Compile `gm` (a rank's or a stage's GraphModule, run with the communicator `comm`) and the graphs of
    its recomputed regions in place: collectives become graph ops, random ops, ZeRO-3's parameter gathers
    and recomputation wrappers stay eager (see the module docstring). With `mixed_precision`, inductor
    rounds to the low-precision dtype where eager does (`emulate_precision_casts`) rather than keeping
    fused intermediates in float32, so a bf16/fp16 program stays close to its eager run.

    >>> graph = fx.Graph()
    >>> graph.output(graph.call_function(all_reduce, (graph.placeholder("x"), "tp")))
    output
    >>> gm = compile_rank_graph(fx.GraphModule(torch.nn.Module(), graph), solo)  # compiled on its first call
    >>> next(n.target for n in gm.graph.nodes if n.op == "call_function")  # all_reduce, as a graph op
    <OpOverload(op='autoshard.collective', overload='default')>
    """
    if isinstance(comm, ThreadCommunicator):  # simulated ranks are threads of one process
        warnings.warn("compile=True: the in-process simulator runs its ranks as threads, and compiling the same "
                      "program in several threads at once gave wrong results (a race in torch.compile); simulated "
                      "ranks run eagerly, real ranks (gloo/NCCL processes) compile", stacklevel=2)
        return gm
    _quiet_imports()
    options = {"emulate_precision_casts": True} if mixed_precision else None
    key = register(comm)
    for sub in list(gm.modules()):
        if isinstance(sub, fx.GraphModule):
            _rewrite(sub, key)
            sub.compile(backend="inductor", dynamic=False, options=options)
    return gm


def _rewrite(gm: fx.GraphModule, key: int) -> None:
    """Collectives become graph ops; the calls that must stay eager go through `torch.compiler.disable`
    (dynamo breaks the graph there)."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _IN_GRAPH:
            x, axis, *dims = node.args
            node.target, node.args = torch.ops.autoshard.collective.default, (x, key, _IN_GRAPH[node.target], axis,
                                                                                list(dims))
        elif node.op == "call_function" and node.target in _EAGER:
            node.target = _disabled(node.target)
        elif node.op == "call_module" and not isinstance(gm.get_submodule(node.target), fx.GraphModule):
            with gm.graph.inserting_before(node):
                module = gm.graph.get_attr(node.target)
            node.op, node.target, node.args = "call_function", _disabled(_call_eager), (module, *node.args)
    gm.recompile()


@functools.cache
def _quiet_imports() -> None:
    """Inductor imports torch.utils.mkldnn on its first compile, whose import warns (once per method) that
    torch.jit.script_method is deprecated: torch's own code, nothing a user can act on; import it quietly."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import torch.utils.mkldnn  # noqa: F401


@functools.cache
def _disabled(fn):
    return torch.compiler.disable(fn, recursive=True)


def _call_eager(module, *args):
    # Called through `_disabled(_call_eager)`, made when a graph is compiled rather than by a decorator at
    # import: `torch.compiler.disable` imports dynamo (over a second), which a process that only plans never needs.
    return module(*args)
