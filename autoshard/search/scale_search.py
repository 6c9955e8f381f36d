"""Planning at scale on paper: (data, tensor, pipeline) degrees, micro-batches and recomputation for a
whole cluster, from ONE trace of a few layers at the real width.

The training step is exported once at one sequence (`frontend.trace`, meta weights) and normalized once.
For each tensor-parallel degree tp (inside a node) a copy of that graph is planned by the project's
passes (strategies, the ILP on HiGHS, insert_comm, predict) on the mesh (tp,) with the link tp has in
the full (pp, dp, tp) mesh (slow -> fast). That plan serves every (dp, tp, pp) with this tp:

- data parallelism splits the batch, so a replica's program is the tp plan and dp adds, per ZeRO stage over
  dp (none, 1, 2, 3: `scale_stages`), the gradient and parameter collectives on the dp link and shards the
  parameters, gradients and optimizer state (`cost/zero_cost.memory_scale`). It is not an ILP axis: the ILP
  prices one micro-batch, so it would trade a once-per-step all-reduce for collectives repeated in every
  micro-batch (weights sharded across nodes); here ZeRO's per-micro-batch collectives are priced with m;
- the traced model has at least 3 layers (first, middle, last); the real depth repeats the middle
  layer's planned costs (repeated layers share one ILP decision, autoshard/solver/layers.py);
- units (`scale_units`: embedding; each layer; final norm, head and loss) carry their predicted compute +
  collective seconds per micro-batch of one sequence and its fixed part, saved activations, what checkpointing
  a layer (fully or selectively) saves and costs, parameters, gradient bytes, tp gradient-sync seconds, and
  the bytes crossing a stage boundary before the unit (`cut_stages.boundary_bytes`). Sequence parallelism is
  the ILP's own choice where it pays (on a llama it shards the norms' activations over tp, Megatron-SP);
- pipeline: units cut into pp contiguous stages balanced by time ("balanced") or L/pp layers each
  ("even", Megatron's rule); stage-to-stage sends on the pp link (forward values and gradients);
- memory of a device (its fullest stage): parameters, gradients and optimizer state of its units (under its
  ZeRO stage), plus the activations of min(pp - s, m) micro-batches in flight (1F1B; one without a pipeline),
  plus one layer's recomputed activations while it is recomputed; layers are recomputed selectively or fully
  (`scale_stages.choose_recompute`) only while the stage does not fit ("auto"), or all of them at one level
  ("selective", "full"). A plan must fit the device memory less `memory_headroom` (10%: allocator
  fragmentation, communication buffers, the CUDA context);
- step: pipeline_search's 1F1B formula with stage times scaled from one sequence per micro-batch to b
  (`estimate_step`), b in `microbatch_sizes`, m = batch / (dp b); communication does not overlap compute;
- model-FLOPs utilisation: 3 x forward matmul FLOPs x batch / (step x devices x peak) (recompute not
  counted; `hfu` counts it).

>>> candidate_degrees(32, 8, n_layers=24)[:4]
[(32, 1, 1), (16, 1, 2), (8, 1, 4), (4, 1, 8)]
>>> from autoshard.cost.profiles import H100_80GB
>>> H100_80GB.link((4, 8), 1) == H100_80GB.intra_node, H100_80GB.link((4, 8), 0) == H100_80GB.inter_node
(True, True)
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import time
from dataclasses import dataclass, field

from torch import fx

from autoshard.cost.profiles import A100_80GB, HardwareProfile, Link
from autoshard.frontend.cut_points import find_layers
from autoshard.frontend.request import DEFAULT_HEADROOM, CompileOptions, headroom_budget
from autoshard.frontend.trace import Traced, trace
from autoshard.ir import meta
from autoshard.ir.errors import AutoshardError, UserInputError
from autoshard.ir.mesh import Mesh
from autoshard.passes.manager import CompileState, run_passes
from autoshard.passes.normalize import normalize
from autoshard.passes.pass_lists import declared_pass_list
from autoshard.search.pipeline_search import estimate_step
from autoshard.search.scale_stages import ZERO_STAGES, Replica, stage_rows
from autoshard.search.scale_units import Unit, layer_instance, scaled, units_of
from autoshard.solver.balanced_cut import min_max_cut

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
class Candidate:
    """One (dp, tp, pp) as planned: ZeRO stage over dp, micro-batch size b and count m, predicted step,
    utilisation, memory of the fullest device, layers per stage and how many of them are recomputed fully and
    selectively; `note` says why not.

    >>> Candidate(4, 8, 2, note="not planned").feasible
    False
    """

    dp: int
    tp: int
    pp: int
    zero: int = 0
    microbatch_size: int = 0
    microbatches: int = 0
    step_s: float = math.inf
    mfu: float = 0.0
    hfu: float = 0.0
    memory_bytes: float = 0.0
    stage_layers: tuple = ()
    recomputed: tuple = ()
    selective: tuple = ()
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
        """Planned, and fits the device memory (less the headroom).

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
                 microbatch_sizes=MICROBATCH_SIZES, memory_headroom: float = DEFAULT_HEADROOM):
        if n_layers < 2:
            raise UserInputError(f"n_layers={n_layers}: the scale search needs a depth of at least 2 layers")
        self.n_layers, self.devices, self.global_batch = n_layers, devices, global_batch
        self.profile, self.factor, self.microbatch_sizes = profile, optimizer_state_factor, tuple(microbatch_sizes)
        self.memory_headroom = memory_headroom
        inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
        self.traced = trace(model, tuple(x[:1] for x in inputs), loss_fn)  # one sequence: the micro-batch unit
        self.exports = 1
        normalize(CompileState(self.traced.gm, Mesh((1,)), self.traced))
        self._plans: dict = {}

    @property
    def budget(self) -> float:
        """Bytes a device may hold: its memory less the headroom.

        >>> from autoshard.zoo import gpt2
        >>> ScaleSearch(*gpt2(device="meta"), n_layers=2, devices=2, global_batch=8).budget / 1e9
        72.0
        """
        return headroom_budget(self.profile, self.memory_headroom)

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
            # the micro-batches in flight) is counted by `evaluate`, which shards and recomputes to fit.
            state = CompileState(gm, Mesh((tp,), ("tp",)), traced, None,
                                 CompileOptions(profile=profile, memory_budget=float("inf"),
                                                optimizer_state_factor=self.factor))
            passes, provided = declared_pass_list("scale")
            run_passes(state, passes, provided=provided)
            self._plans[tp] = scaled(*units_of(state, profile), self.n_layers)
        return self._plans[tp]

    def evaluate(self, dp: int, tp: int, pp: int, split: str = "balanced", recompute: str = "auto",
                 zero=None, microbatch_sizes=None, fit: bool = True) -> Candidate:
        """The fastest ZeRO stage (`zero`: one stage, or None for each of 0-3 when dp > 1) and micro-batch size
        for (dp, tp, pp): predicted step, utilisation, memory, stages. `fit=False` prices a configuration
        that does not fit (its `note` says so) instead of rejecting it.

        >>> from autoshard.zoo import gpt2
        >>> search = ScaleSearch(*gpt2(batch=2, seq=16, dim=64, n_layers=3, device="meta"), n_layers=4,
        ...                      devices=4, global_batch=8)
        >>> c = search.evaluate(1, 2, 2, split="even", recompute="full")
        >>> c.stage_layers, c.recomputed, c.zero
        ((2, 2), (2, 2), 0)
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
        layers = tuple(sum(u.is_layer for u in units[a:z]) for a, z in bounds)
        stages = (zero,) if zero is not None else ZERO_STAGES if dp > 1 else (0,)
        best = None
        for stage, b in itertools.product(stages, microbatch_sizes or self.microbatch_sizes):
            if (self.global_batch // dp) % b:
                continue
            m = self.global_batch // (dp * b)
            replica = Replica(dp, stage, dp_link, self.factor)
            rows, memory, full, selective, redone = stage_rows(units, shared, bounds, transfer, replica, b, m,
                                                               self.budget, recompute)
            over = memory > self.budget
            if over and fit:
                if best is None:
                    out.memory_bytes, out.note = memory, f"{memory / 1e9:.0f} GB per device does not fit"
                continue
            step = estimate_step(rows, m * b, m, 1, link)
            if best is None or (over, step) < (not best.feasible, best.step_s):
                useful = 3 * flops * self.global_batch / (step * self.devices * self.profile.peak_flops)
                best = dataclasses.replace(
                    out, zero=stage, microbatch_size=b, microbatches=m, step_s=step, mfu=useful,
                    hfu=useful * (1 + redone / (3 * flops)), memory_bytes=memory, stage_layers=layers,
                    recomputed=full, selective=selective,
                    note=f"{memory / 1e9:.0f} GB per device does not fit" if over else "")
        return best or out

    def static_bytes(self) -> float:
        """Parameters with gradients and optimizer state of the whole model at n_layers (bytes, unsharded).

        >>> from autoshard.zoo import gpt2
        >>> search = ScaleSearch(*gpt2(n_layers=3, device="meta"), n_layers=3, devices=1, global_batch=8)
        >>> search.static_bytes() == 8.0 * sum(p.numel() * 4 for p in search.traced.params.values())
        True
        """
        per_unit: dict = {}
        found = find_layers(self.traced.gm.graph.nodes)
        for node in self.traced.gm.graph.nodes:
            if node.op == "placeholder" and node.meta.get(meta.KIND) == "param":
                val = node.meta["val"]
                instance = layer_instance(next(iter(node.users), node), found)
                per_unit[instance] = per_unit.get(instance, 0) + val.numel() * val.element_size()
        layers = [k for k in found.layers if k in per_unit]
        total = sum(v for k, v in per_unit.items() if not k)
        if len(layers) == self.n_layers:
            total += sum(per_unit[k] for k in layers)
        else:
            total += per_unit[layers[0]] + per_unit[layers[-1]] + (self.n_layers - 2) * per_unit[layers[1]]
        return (2 + self.factor) * total

    def search(self, degrees=None) -> SearchResult:
        """Evaluate every candidate (default: `candidate_degrees`) whose parameters, gradients and optimizer
        state can fit at all (sharded over every device by ZeRO-3); the fastest feasible one wins (ties: fewer
        pipeline stages, then smaller tp, then a lower ZeRO stage).

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
            if static / (dp * tp * pp) > self.budget:
                out.append(Candidate(dp, tp, pp, memory_bytes=static / (dp * tp * pp),
                                     note="parameters, gradients and optimizer state alone do not fit"))
                continue
            out.append(self.evaluate(dp, tp, pp))
        feasible = [c for c in out if c.feasible]
        best = min(feasible, key=lambda c: (c.step_s, c.pp, c.tp, c.zero)) if feasible else None
        return SearchResult(best, out, self.planned, time.perf_counter() - start, self.exports)
