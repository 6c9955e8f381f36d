"""Planning at scale on paper: (data, tensor, pipeline) degrees, micro-batches and recomputation for a
whole cluster, from ONE trace of a few layers at the real width.

The training step is exported once at one sequence (`frontend.trace`, meta weights) and normalized once.
For each tensor-parallel degree tp (inside a node) a copy of that graph is planned by the project's
passes (strategies, the ILP on HiGHS, insert_comm, predict) on the mesh (tp,) with the link tp has in
the full (pp, dp, tp) mesh (slow -> fast). That plan serves every (dp, tp, pp) with this tp:

- data parallelism replicates parameters and splits the batch, so a replica's program is the tp plan
  and dp adds the all-reduce of every parameter's gradient once per step on the dp link (what predict
  charges for a parameter reduced on a batch axis). It is not an ILP axis: the ILP prices one
  micro-batch, so it would trade that once-per-step all-reduce for collectives repeated in every
  micro-batch (weights sharded across nodes);
- the traced model has at least 3 layers (first, middle, last); the real depth repeats the middle
  layer's planned costs (repeated layers share one ILP decision, autoshard/solver/layers.py);
- units (embedding; each layer; final norm, head and loss) carry their predicted compute + collective
  seconds per micro-batch of one sequence and its fixed part (latencies, weights' collectives), saved
  activations, what checkpointing a layer saves and costs (`cost/recompute_cost.region_savings`),
  parameters with gradients and optimizer state, gradient bytes, and the bytes crossing a stage
  boundary before the unit (`cut_stages.boundary_bytes`);
- pipeline: units cut into pp contiguous stages balanced by time ("balanced") or L/pp layers each
  ("even", Megatron's rule); stage-to-stage sends on the pp link (forward values and gradients);
- memory of a device (its fullest stage): parameters, gradients and optimizer state of its units, plus
  the activations of min(pp - s, m) micro-batches in flight (1F1B; one without a pipeline), plus one
  layer's activations while it is recomputed; layers are checkpointed (most bytes saved per second of
  recompute first) only while the stage does not fit ("auto") or all of them ("full");
- step: pipeline_search's 1F1B formula with stage times scaled from one sequence per micro-batch to b
  (`estimate_step`), b in MICROBATCH_SIZES, m = batch / (dp b); communication does not overlap compute;
- model-FLOPs utilisation: 3 x forward matmul FLOPs x batch / (step x devices x peak) (recompute not
  counted; `hfu` counts it).

>>> candidate_degrees(32, 8, n_layers=24)[:4]
[(32, 1, 1), (16, 1, 2), (8, 1, 4), (4, 1, 8)]
>>> A100_80GB.link((4, 8), 1) == A100_80GB.intra_node, A100_80GB.link((4, 8), 0) == A100_80GB.inter_node
(True, True)
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import time
from dataclasses import dataclass, field

from torch import fx

from autoshard.cost.axis_cost import needs_grad
from autoshard.cost.flops import is_matmul_like, node_flops
from autoshard.cost.model import (
    HardwareProfile,
    Link,
    all_reduce_time,
    collective_latency,
)
from autoshard.cost.recompute_cost import region_savings
from autoshard.frontend.request import CompileOptions
from autoshard.frontend.trace import Traced, trace
from autoshard.ir import meta
from autoshard.ir.errors import AutoshardError, UserInputError
from autoshard.ir.mesh import Mesh
from autoshard.ir.meta import NODE_COST
from autoshard.passes.cut_stages import boundary_bytes
from autoshard.passes.manager import CompileState, run_passes
from autoshard.passes.normalize import normalize
from autoshard.passes.pipelines import declared_pipeline
from autoshard.passes.predict import collective_bytes, local_bytes
from autoshard.search.pipeline_search import estimate_step
from autoshard.solver.balanced_cut import min_max_cut
from autoshard.solver.layers import layer_key

# A100-80GB nodes of 8: 312 TFLOP/s bf16, ~2 TB/s HBM, NVLink ~300 GB/s per GPU inside a node, one
# ~25 GB/s InfiniBand link per GPU between nodes (DGX A100, as in Narayanan et al. 2021).
A100_80GB = HardwareProfile(name="A100-80GB", peak_flops=312e12, memory_bandwidth=2.0e12, memory_bytes=80e9,
                            devices_per_node=8, intra_node=Link(5e-6, 300e9), inter_node=Link(1e-5, 25e9))
MICROBATCH_SIZES = (1, 2, 4, 8)
# bf16 weights and gradients (2 + 2 bytes) + fp32 master weights and Adam moments (12 bytes = 6 x 2).
MIXED_PRECISION_ADAM = 6.0


def candidate_degrees(devices: int, devices_per_node: int, n_layers: int) -> list[tuple[int, int, int]]:
    """Every (dp, tp, pp) with dp x tp x pp = devices, tp dividing a node, 1 <= pp <= n_layers.

    >>> candidate_degrees(8, 4, n_layers=2)
    [(8, 1, 1), (4, 1, 2), (4, 2, 1), (2, 2, 2), (2, 4, 1), (1, 4, 2)]
    """
    out = []
    for tp in range(1, devices_per_node + 1):
        if devices_per_node % tp or devices % tp:
            continue
        for pp in range(1, min(devices // tp, n_layers) + 1):
            if (devices // tp) % pp == 0:
                out.append((devices // (tp * pp), tp, pp))
    return out


@dataclass
class Unit:
    """Predicted figures of one unit (embedding, a layer, or the head) per micro-batch of one sequence:
    seconds forward + backward and their part that does not grow with the micro-batch, activation
    bytes kept, bytes and seconds of checkpointing it, forward matmul FLOPs, and, of the parameters no
    other unit uses: bytes with gradients and optimizer state, gradient bytes (one entry per parameter),
    tp gradient-sync seconds; bytes sent (forward and backward) when a stage starts at this unit.

    >>> Unit("layers.1", seconds=2.0, is_layer=True).seconds
    2.0
    """

    name: str
    seconds: float = 0.0
    fixed_s: float = 0.0
    activation_bytes: float = 0.0
    checkpoint_saves: float = 0.0
    recompute_s: float = 0.0
    flops: float = 0.0
    param_bytes: float = 0.0
    grad_bytes: list = field(default_factory=list)
    sync_s: float = 0.0
    in_bytes: float = 0.0
    is_layer: bool = False


@dataclass
class Candidate:
    """One (dp, tp, pp) as planned: micro-batch size b and count m, predicted step, utilisation, memory
    of the fullest device, layers per stage and how many of them are recomputed; `note` says why not.

    >>> Candidate(4, 8, 2, note="not planned").feasible
    False
    """

    dp: int
    tp: int
    pp: int
    microbatch_size: int = 0
    microbatches: int = 0
    step_s: float = math.inf
    mfu: float = 0.0
    hfu: float = 0.0
    memory_bytes: float = 0.0
    stage_layers: tuple = ()
    recomputed: tuple = ()
    split: str = "balanced"
    note: str = ""

    @property
    def degrees(self) -> tuple[int, int, int]:
        """(dp, tp, pp).

        >>> Candidate(4, 8, 2).degrees
        (4, 8, 2)
        """
        return (self.dp, self.tp, self.pp)

    @property
    def feasible(self) -> bool:
        """Planned, and fits the device memory.

        >>> Candidate(4, 8, 2, step_s=1.0).feasible
        True
        """
        return not self.note and math.isfinite(self.step_s)


@dataclass
class SearchResult:
    """The fastest feasible candidate, every candidate, how many intra-op plans were made, seconds,
    how many times the model was exported.

    >>> SearchResult(None, [], 0, 0.0, 1).exports
    1
    """

    best: Candidate | None
    candidates: list = field(default_factory=list)
    planned: int = 0
    seconds: float = 0.0
    exports: int = 1


def balanced_cut(times, transfer, stages: int) -> list[tuple[int, int]]:
    """`stages` contiguous (start, end) groups of units minimising the slowest group's time; a group pays
    `transfer[i]` for a boundary before unit i (at its start and at its end); among equally slow cuts, the
    one with the least transfer time (solver/balanced_cut.py, the routine cut_stages uses).

    >>> balanced_cut([1, 3, 3, 3, 1], [0, 0, 0.5, 0, 0], 2)  # without transfers, cutting at 2 or 3 ties (7 s)
    [(0, 3), (3, 5)]
    """
    n = len(times)
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)

    def stage_time(a, z):
        return prefix[z] - prefix[a] + (transfer[a] if a > 0 else 0.0) + (transfer[z] if z < n else 0.0)

    cuts = min_max_cut(stage_time, list(range(n + 1)), stages, crossing=lambda b: transfer[b])
    return list(itertools.pairwise([0, *cuts, n]))


def even_cut(units: list[Unit], stages: int) -> list[tuple[int, int]]:
    """Megatron's rule: layers split as evenly as possible, the embedding with the first stage, the head with
    the last.

    >>> even_cut([Unit("pre"), *[Unit("l", is_layer=True)] * 4, Unit("post")], 2)
    [(0, 3), (3, 6)]
    """
    layer_at = [i for i, u in enumerate(units) if u.is_layer]
    per, extra = divmod(len(layer_at), stages)
    bounds, start, taken = [], 0, 0
    for s in range(stages):
        taken += per + (1 if s < extra else 0)
        end = len(units) if s == stages - 1 else layer_at[taken - 1] + 1
        bounds.append((start, end))
        start = end
    return bounds


class ScaleSearch:
    """Trace once, then plan any (dp, tp, pp) of `devices` devices for `global_batch` sequences and a depth
    of `n_layers` (the model itself has a few layers, at least 3, of the real width).

    >>> from autoshard.zoo import gpt2
    >>> model, inputs, loss_fn = gpt2(batch=2, seq=16, dim=64, n_heads=4, n_layers=3, device="meta")
    >>> search = ScaleSearch(model, inputs, loss_fn, n_layers=8, devices=8, global_batch=16)
    >>> search.evaluate(4, 2, 1).degrees, search.exports
    ((4, 2, 1), 1)
    """

    def __init__(self, model, example_inputs, loss_fn, n_layers: int, devices: int, global_batch: int,
                 profile: HardwareProfile = A100_80GB, optimizer_state_factor: float = MIXED_PRECISION_ADAM,
                 microbatch_sizes=MICROBATCH_SIZES):
        if n_layers < 2:
            raise UserInputError(f"n_layers={n_layers}: the scale search needs a depth of at least 2 layers")
        self.n_layers, self.devices, self.global_batch = n_layers, devices, global_batch
        self.profile, self.factor, self.microbatch_sizes = profile, optimizer_state_factor, tuple(microbatch_sizes)
        inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
        self.traced = trace(model, tuple(x[:1] for x in inputs), loss_fn)  # one sequence: the micro-batch unit
        self.exports = 1
        normalize(CompileState(self.traced.gm, Mesh((1,)), self.traced))
        self._plans: dict = {}

    @property
    def planned(self) -> int:
        """How many intra-op plans (ILPs) were made so far: one per tensor-parallel degree.

        >>> from autoshard.zoo import gpt2
        >>> ScaleSearch(*gpt2(device="meta"), n_layers=2, devices=2, global_batch=8).planned
        0
        """
        return len(self._plans)

    def plan(self, tp: int) -> tuple[list[Unit], list]:
        """The intra-op plan on (tp,) at one sequence: (units scaled to n_layers, parameters shared by
        several units as (bytes, tp sync seconds, gradient bytes, unit indices)); cached per tp.

        >>> from autoshard.zoo import gpt2
        >>> search = ScaleSearch(*gpt2(batch=2, seq=16, dim=64, n_layers=3, device="meta"), n_layers=5,
        ...                      devices=4, global_batch=8)
        >>> units, shared = search.plan(2)
        >>> [u.name for u in units]
        ['embedding', 'layers.0', 'layers.1', 'layers.1', 'layers.1', 'layers.2', 'head']
        """
        if tp not in self._plans:
            graph, env = fx.Graph(), {}
            for node in self.traced.gm.graph.nodes:
                env[node] = graph.node_copy(node, lambda n: env[n])
            gm = fx.GraphModule(self.traced.gm, graph)
            link = self.profile.link((1, 1, tp), 2)  # the innermost axis: inside a node when tp fits one
            profile = dataclasses.replace(self.profile, axis_links=(link,))
            traced = Traced(gm, self.traced.params, self.traced.buffers, self.traced.aliases,
                            self.traced.input_names, self.traced.output_spec)
            # No memory bound here: the ILP sees a few layers and one sequence; a stage's memory (its layers x
            # the micro-batches in flight) is counted by `evaluate`, which recomputes layers to fit.
            state = CompileState(gm, Mesh((tp,), ("tp",)), traced, None,
                                 CompileOptions(profile=profile, memory_budget=float("inf"),
                                                optimizer_state_factor=self.factor))
            passes, provided = declared_pipeline("scale")
            run_passes(state, passes, provided=provided)
            self._plans[tp] = _scaled(*_units(state, profile), self.n_layers)
        return self._plans[tp]

    def evaluate(self, dp: int, tp: int, pp: int, split: str = "balanced", recompute: str = "auto") -> Candidate:
        """The best micro-batch size for (dp, tp, pp): predicted step, utilisation, memory, stages.

        >>> from autoshard.zoo import gpt2
        >>> search = ScaleSearch(*gpt2(batch=2, seq=16, dim=64, n_layers=3, device="meta"), n_layers=4,
        ...                      devices=4, global_batch=8)
        >>> c = search.evaluate(1, 2, 2, split="even", recompute="full")
        >>> c.stage_layers, c.recomputed
        ((2, 2), (2, 2))
        """
        out = Candidate(dp, tp, pp, split=split)
        if self.global_batch % dp:
            out.note = f"the batch of {self.global_batch} does not split over dp={dp}"
            return out
        try:
            units, shared = self.plan(tp)
        except AutoshardError as exc:
            out.note = f"not planned: {str(exc).splitlines()[0]}"
            return out
        mesh = (pp, dp, tp)
        link = self.profile.link(mesh, 0) if pp > 1 else Link(0.0, math.inf)
        dp_link = self.profile.link(mesh, 1)
        transfer = [2 * link.alpha + u.in_bytes / link.bandwidth for u in units]
        bounds = even_cut(units, pp) if split == "even" else balanced_cut([u.seconds for u in units], transfer, pp)
        flops = sum(u.flops for u in units)
        sync = {id(u): u.sync_s + sum(all_reduce_time(g, dp, dp_link) for g in u.grad_bytes) for u in units}
        shared = [(nbytes, t + sum(all_reduce_time(g, dp, dp_link) for g in grads), where)
                  for nbytes, t, grads, where in shared]
        best = None
        for b in self.microbatch_sizes:
            if (self.global_batch // dp) % b:
                continue
            m = self.global_batch // (dp * b)
            rows, memory, recomputed, redone = self._stages(units, shared, sync, bounds, transfer, b, m, recompute)
            if memory > self.profile.memory_bytes:
                if best is None:
                    out.memory_bytes, out.note = memory, f"{memory / 1e9:.0f} GB per device does not fit"
                continue
            step = estimate_step(rows, m * b, m, 1, link)
            if best is None or step < best.step_s:
                useful = 3 * flops * self.global_batch / (step * self.devices * self.profile.peak_flops)
                best = dataclasses.replace(
                    out, microbatch_size=b, microbatches=m, step_s=step, mfu=useful,
                    hfu=useful * (1 + redone / (3 * flops)), memory_bytes=memory, note="",
                    stage_layers=tuple(sum(u.is_layer for u in units[a:z]) for a, z in bounds),
                    recomputed=tuple(recomputed))
        return best or out

    def _stages(self, units, shared, sync, bounds, transfer, b, m, policy):
        """Stage rows for estimate_step (at one sequence per micro-batch), the fullest device's bytes, the
        layers recomputed per stage, and the recomputed forward FLOPs per sequence."""
        rows, peak, recomputed, redone = [], 0.0, [], 0.0
        budget = self.profile.memory_bytes
        for s, (a, z) in enumerate(bounds):
            members = units[a:z]
            inflight = min(len(bounds) - s, m)
            mine = [entry for entry in shared if any(a <= i < z for i in entry[2])]
            static = sum(u.param_bytes for u in members) + sum(entry[0] for entry in mine)
            kept = b * sum(u.activation_bytes for u in members)
            layers = sorted((u for u in members if u.is_layer),
                            key=lambda u: -u.checkpoint_saves / max(u.recompute_s, 1e-12))
            chosen, live = [], 0.0
            for u in layers:
                if policy != "full" and static + inflight * kept + b * live <= budget:
                    break
                chosen.append(u)
                kept -= b * u.checkpoint_saves
                live = max(live, u.checkpoint_saves)
            peak = max(peak, static + inflight * kept + b * live)
            recomputed.append(len(chosen))
            redone += sum(u.flops for u in chosen)
            seconds = sum(u.seconds for u in members) + sum(u.recompute_s for u in chosen)
            seconds += (transfer[a] if a > 0 else 0.0) + (transfer[z] if z < len(units) else 0.0)
            rows.append({"seconds": seconds, "latency_s": sum(u.fixed_s for u in members),
                         "sync_s": sum(sync[id(u)] for u in members) + sum(entry[1] for entry in mine)})
        return rows, peak, recomputed, redone

    def static_bytes(self) -> float:
        """Parameters with gradients and optimizer state of the whole model at n_layers (bytes, unsharded).

        >>> from autoshard.zoo import gpt2
        >>> search = ScaleSearch(*gpt2(n_layers=3, device="meta"), n_layers=3, devices=1, global_batch=8)
        >>> search.static_bytes() == 8.0 * sum(p.numel() * 4 for p in search.traced.params.values())
        True
        """
        per_unit: dict = {}
        for node in self.traced.gm.graph.nodes:
            if node.op == "placeholder" and node.meta.get(meta.KIND) == "param":
                val = node.meta["val"]
                instance = _layer_instance(next(iter(node.users), node))
                per_unit[instance] = per_unit.get(instance, 0) + val.numel() * val.element_size()
        layers = sorted((k for k in per_unit if k), key=lambda k: int(k.rsplit(".", 1)[1]))
        total = sum(v for k, v in per_unit.items() if not k)
        if len(layers) == self.n_layers:
            total += sum(per_unit[k] for k in layers)
        else:
            total += per_unit[layers[0]] + per_unit[layers[-1]] + (self.n_layers - 2) * per_unit[layers[1]]
        return (2 + self.factor) * total

    def search(self, degrees=None) -> SearchResult:
        """Evaluate every candidate (default: `candidate_degrees`) whose parameters, gradients and optimizer
        state can fit at all; the fastest feasible one wins (ties: fewer pipeline stages, then smaller tp).

        >>> from autoshard.zoo import gpt2
        >>> search = ScaleSearch(*gpt2(batch=2, seq=16, dim=64, n_layers=3, device="meta"), n_layers=4,
        ...                      devices=4, global_batch=8)
        >>> result = search.search()
        >>> result.best.feasible, result.exports, result.planned
        (True, 1, 3)
        """
        start = time.perf_counter()
        degrees = degrees or candidate_degrees(self.devices, self.profile.devices_per_node, self.n_layers)
        static, out = self.static_bytes(), []
        for dp, tp, pp in degrees:
            if static / (tp * pp) > self.profile.memory_bytes:
                out.append(Candidate(dp, tp, pp, memory_bytes=static / (tp * pp),
                                     note="parameters, gradients and optimizer state alone do not fit"))
                continue
            out.append(self.evaluate(dp, tp, pp))
        feasible = [c for c in out if c.feasible]
        best = min(feasible, key=lambda c: (c.step_s, c.pp, c.tp)) if feasible else None
        return SearchResult(best, out, self.planned, time.perf_counter() - start, self.exports)


def _layer_instance(node) -> str:
    return layer_key(node.meta.get(meta.PATH, ""))[1]


def _units(state, profile) -> tuple[list[Unit], list]:
    """Units of the planned graph in order (embedding, each traced layer, head) and the shared parameters."""
    graph, mesh = state.gm.graph, state.mesh
    ops = [n for n in graph.nodes if n.op == "call_function"]
    instances = list(dict.fromkeys(i for i in map(_layer_instance, ops) if i))
    if len(instances) < 2:
        raise UserInputError("the scale search needs a model with repeated layers (a ModuleList such as "
                             f"'layers.0', 'layers.1', ...); found {instances}")
    units = [Unit("embedding")] + [Unit(i, is_layer=True) for i in instances] + [Unit("head")]
    where = {i: k + 1 for k, i in enumerate(instances)}
    seen_layer, of, members = False, {}, {}
    for node in ops:
        instance = _layer_instance(node)
        seen_layer = seen_layer or bool(instance)
        of[node] = where[instance] if instance else (len(units) - 1 if seen_layer else 0)
        members.setdefault(of[node], []).append(node)
    grad = state.grad_flags = needs_grad(graph)
    fwd, bwd, _ = boundary_bytes(state, ops)
    for k, node in enumerate(ops):
        unit = units[of[node]]
        if k == 0 or of[ops[k - 1]] != of[node]:
            unit.in_bytes = fwd[k] + bwd[k]
        cost = node.meta.get(NODE_COST, {})
        unit.seconds += cost.get("seconds", 0.0)
        unit.activation_bytes += cost.get("memory_bytes", 0)
        comm = node.meta.get(meta.COMM)
        if comm and node.args[0].op == "placeholder":  # a weight's collective: as long whatever the micro-batch
            unit.fixed_s += cost.get("seconds", 0.0)
        elif comm:
            axis = mesh.axis(comm["axis"])
            unit.fixed_s += collective_latency(comm["op"], *collective_bytes(node, mesh), mesh.shape[axis],
                                               profile.link(mesh.shape, axis))
        elif is_matmul_like(node):
            unit.flops += node_flops(node)
    for index, nodes in members.items():
        if units[index].is_layer:
            units[index].checkpoint_saves, units[index].recompute_s = region_savings(state, nodes)
    shared = []
    for node in graph.nodes:
        if node.op != "placeholder" or NODE_COST not in node.meta:
            continue
        used = sorted({of[u] for u in node.users if u in of})
        cost = node.meta[NODE_COST]
        grads = [local_bytes(node, node.meta[meta.SPEC], mesh)] if grad.get(node) else []
        if len(used) == 1:
            units[used[0]].param_bytes += cost["memory_bytes"]
            units[used[0]].grad_bytes += grads
            units[used[0]].sync_s += cost["sync_s"]
        elif used:
            shared.append((cost["memory_bytes"], cost["sync_s"], grads, tuple(used)))
    return units, shared


def _scaled(units: list[Unit], shared: list, n_layers: int) -> tuple[list[Unit], list]:
    """The traced units at the real depth: first layer, n_layers - 2 copies of the second, last layer."""
    layers = units[1:-1]
    if n_layers == len(layers):
        return units, shared
    if len(layers) < 3:
        raise UserInputError(f"the model was traced with {len(layers)} layers; trace at least 3 (first, middle, "
                             f"last) to plan a depth of {n_layers}")
    out = [units[0], layers[0], *[layers[1]] * (n_layers - 2), layers[-1], units[-1]]
    last = len(units) - 1

    def moved(i):
        if 1 < i < last - 1:
            raise UserInputError("a parameter shared by a middle layer and another unit cannot be scaled to a "
                                 "different depth; trace the model at its real depth")
        return {0: 0, 1: 1, last - 1: n_layers, last: n_layers + 1}[i]

    return out, [(nbytes, sync, grads, tuple(moved(i) for i in where)) for nbytes, sync, grads, where in shared]
