"""How the rates of ops timed one by one scale to ops run in a model's sequence: a small language model exported to
ATen, its forward and backward timed, less their work, over the fixed costs timed one by one (`sequence_scales`);
and a larger one, whose time is mostly work, over the work the fitted rates give it (`work_scale`: a kernel chained
on one weight keeps its data in the caches, a model's layers each bring their own).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from autoshard.cost.axis_cost import compute_parts
from autoshard.cost.kernel_timing import median_seconds, timer


class _Block(torch.nn.Module):
    """A pre-norm transformer block (attention, GELU MLP, residuals): the op sequence `sequence_scales` times."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.up, self.down = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2)
                   for t in self.qkv(self.norm1(x)).split(d, dim=-1))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(attended)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class _Stack(torch.nn.Module):
    """A small language model of `_Block`s: embedding, blocks, head, cross-entropy."""

    def __init__(self, layers: int, dim: int, heads: int, vocab: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())


STACK = {"layers": 4, "batch": 4, "seq": 16, "dim": 32, "heads": 2, "vocab": 64}  # small: the fixed costs dominate
STACK_REPEATS = 21  # one step of the stack is ~1 ms on a CPU
# Large enough that the work dominates (a CPU step of the first ~30 ms, the GPU's ~10 ms of kernels).
WORK_STACK = {"cpu": {"layers": 2, "batch": 4, "seq": 64, "dim": 256, "heads": 4, "vocab": 512},
              "cuda": {"layers": 2, "batch": 8, "seq": 1024, "dim": 2048, "heads": 16, "vocab": 8192}}
WORK_REPEATS = 9


def _graph_grads(graph, params: set) -> dict:
    """Node -> whether its output has a gradient (it depends on a parameter: placeholders named in `params`) in an
    exported graph."""
    flags = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            flags[node] = node.name in params
        elif node.op == "call_function":
            vals = node.meta.get("val")
            vals = vals if isinstance(vals, (tuple, list)) else [vals]
            floating = any(isinstance(v, torch.Tensor) and v.dtype.is_floating_point for v in vals)
            flags[node] = floating and any(flags.get(a, False) for a in node.all_input_nodes)
    return flags


def _exported_stack(g: dict, device: torch.device, dtype: torch.dtype):
    """(the exported module, its input, its call_function nodes, each node's needs-a-gradient flag, its parameters)
    of a `_Stack` of size `g`."""
    model = _Stack(g["layers"], g["dim"], g["heads"], g["vocab"]).to(device, dtype)
    x = torch.randint(0, g["vocab"], (g["batch"], g["seq"]), device=device)
    exported = torch.export.export(model, (x,))
    module, graph = exported.module(), exported.graph_module.graph
    grads = _graph_grads(graph, set(exported.graph_signature.inputs_to_parameters))
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    return module, x, nodes, grads, list(model.parameters())


def _timed_steps(module, x, params, device: torch.device, repeats: int) -> tuple[float, float]:
    """(forward, backward) seconds of the exported stack, medians."""
    timed = timer(device)

    def forward():
        module(x)

    def train():
        module(x).backward()
        for p in params:
            p.grad = None

    forward_s = median_seconds(forward, timed, repeats)
    return forward_s, median_seconds(train, timed, repeats) - forward_s


def sequence_scales(device: torch.device, dtype: torch.dtype, rates, repeats: int) -> tuple:
    """(forward, backward) factors from the fixed costs of ops timed one by one to those of ops run in a model's
    sequence: a `_Stack` of STACK's size exported to ATen, its forward (autograd recording) and backward timed,
    less their work, over the fixed costs `rates` give its ops (`axis_cost.compute_parts`). Measured on this CPU:
    ~2 (ops of one kind back to back keep their code and data in the caches; a graph's sequence does not).

    >>> from autoshard.cost.compute_rates import ComputeRates
    >>> rates = ComputeRates({"float32": 1e12}, 1e12, 1e12, 1e-6, 2e-6, 0.0, 1e-6, 2e-6)
    >>> forward, backward = sequence_scales(torch.device("cpu"), torch.float32, rates, 3)
    >>> forward >= 0 and backward >= 0  # 0 where the measured time is all work (noise on a loaded machine)
    True
    """
    module, x, nodes, grads, params = _exported_stack(STACK, device, dtype)
    full, bare = rates.profile(), rates.scaled(0.0, 0.0).profile()  # bare: the work alone
    priced = [compute_parts(n, 1, full, grads[n]) for n in nodes]
    work = [compute_parts(n, 1, bare, grads[n]) for n in nodes]
    fixed_forward = sum(f for f, _ in priced) - sum(f for f, _ in work)
    fixed_backward = sum(b for _, b in priced) - sum(b for _, b in work)
    forward_s, backward_s = _timed_steps(module, x, params, device, repeats)
    return (max(forward_s - sum(f for f, _ in work), 0.0) / max(fixed_forward, 1e-12),
            max(backward_s - sum(b for _, b in work), 0.0) / max(fixed_backward, 1e-12))


def work_scale(device: torch.device, dtype: torch.dtype, rates, repeats: int = WORK_REPEATS) -> float:
    """How much longer a model's work takes than the rates fitted on one kernel at a time say (above 1: slower): a
    `_Stack` of WORK_STACK's size (its time mostly work) exported to ATen, its forward and backward timed, less the
    fixed costs `rates` give its ops, over the work they give it. Measured on 2 ranks of this 2-core machine: 1.4
    (gpt2-like models of width 256 trained ~25% slower than the rates fitted on chained kernels predicted).

    >>> from autoshard.cost.compute_rates import ComputeRates
    >>> rates = ComputeRates({"float32": 1e11}, 1e11, 1e10, 1e-6, 2e-6, 0.0, 1e-6, 2e-6)
    >>> work_scale(torch.device("cpu"), torch.float32, rates, 3) > 0
    True
    """
    size = WORK_STACK["cuda" if device.type == "cuda" else "cpu"]
    module, x, nodes, grads, params = _exported_stack(size, device, dtype)
    full, bare = rates.profile(), rates.scaled(0.0, 0.0).profile()
    priced = sum(sum(compute_parts(n, 1, full, grads[n])) for n in nodes)
    work = sum(sum(compute_parts(n, 1, bare, grads[n])) for n in nodes)
    measured = sum(_timed_steps(module, x, params, device, repeats))
    return max(measured - (priced - work), 1e-12) / max(work, 1e-12)
