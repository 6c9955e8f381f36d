"""Hardware profiles: a machine as numbers (peak FLOP/s, memory bandwidth and size, the links inside and between
nodes), the named ones parallelize takes (`profile="gpu"`, "cpu", "a100", "h100") and profile JSON files (what
`python -m autoshard calibrate` writes).

The default is 8-GPU nodes with NVLink inside a node and a slower network between nodes: the innermost mesh axes
whose sizes multiply to at most 8 are intra-node, the rest inter-node (DESIGN: axis order is slow -> fast).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from autoshard.ir.errors import UserInputError


@dataclass(frozen=True)
class Link:
    """One collective link: per-message latency (s) and bandwidth (bytes/s) of the all-reduce; `gather`,
    `reduce_scatter` and `all_to_all` the (alpha, bandwidth) of those collectives when they differ (calibrate
    measures each as the runtime runs it: gloo's exact reductions gather every rank's whole input and sum it, so
    a reduce-scatter there moves k times the bytes a ring's would; without its own figures a reduce-scatter or an
    all-to-all takes the gathers').

    >>> link = Link(alpha=1e-5, bandwidth=1e9)   # 10 us per message, 1 GB/s
    >>> link.alpha + 1e6 / link.bandwidth  # one message of 1 MB (cost/collective_time.py has the ring formulas)
    0.00101
    >>> Link(1e-5, 1e9, gather=(2e-5, 2e9)).of("reduce_scatter").alpha
    2e-05

    `measured` (calibrate's): the axis's size and, per collective, the seconds it took at each size it was timed at;
    the collective times interpolate these over the sizes measured (`measured_seconds`) rather than take the fitted
    line, which on a machine whose time per byte grows with the size (gloo's exact sums on this VM) is exact only
    at the sizes that set it.
    """

    alpha: float
    bandwidth: float
    gather: tuple | None = None  # (alpha, bandwidth) of all-gathers
    reduce_scatter: tuple | None = None  # of reduce-scatters (else the gathers')
    all_to_all: tuple | None = None  # of all-to-alls (else the gathers')
    measured: tuple = field(default=(), repr=False)  # (axis size, ((collective, ((bytes, seconds), ...)), ...))

    def measured_seconds(self, collective: str, nbytes: float, k: int) -> float | None:
        """Seconds of `collective` moving `nbytes` (its byte convention: cost/collective_time.py) over `k` ranks,
        interpolated between the sizes calibrate timed on this axis (linearly in the bytes; past the largest, that
        last segment's slope; below the smallest, the smallest's time); None where nothing was measured for it.

        >>> link = Link(1e-3, 1e8, measured=(4, (("all_reduce", ((4096, 0.004), (1048576, 0.010))),)))
        >>> link.measured_seconds("all_reduce", 526336, 4), link.measured_seconds("all_gather", 4096, 4)
        (0.007, None)
        >>> link.measured_seconds("all_reduce", 2048, 4), link.measured_seconds("all_reduce", 4096, 2)  # other k: none
        (0.004, None)
        >>> round(link.measured_seconds("all_reduce", 2093056, 4), 9)  # past the largest: its segment's slope
        0.016
        """
        if not self.measured or self.measured[0] != k:
            return None
        points = dict(self.measured[1]).get(collective)
        if not points:
            return None
        if nbytes <= points[0][0] or len(points) == 1:
            return points[0][1]
        for (b0, t0), (b1, t1) in itertools.pairwise(points):
            if nbytes <= b1:
                return t0 + (nbytes - b0) * (t1 - t0) / (b1 - b0)
        (b0, t0), (b1, t1) = points[-2], points[-1]
        slope = (t1 - t0) / (b1 - b0)
        if slope <= 0.0:  # noise made the largest message no slower: the table's mean slope
            slope = max((t1 - points[0][1]) / (b1 - points[0][0]), 0.0)
        return t1 + (nbytes - b1) * slope

    def of(self, collective: str) -> Link:
        """The link's figures for one ring collective ("all_reduce", "all_gather", "reduce_scatter", "all_to_all").

        >>> Link(1e-5, 1e9).of("all_gather") == Link(1e-5, 1e9)
        True
        >>> Link(1e-5, 1e9, (2e-5, 2e9), (3e-5, 5e8)).of("reduce_scatter"), Link(1e-5, 1e9, (2e-5, 2e9)).of("all_to_all")
        (Link(alpha=3e-05, bandwidth=500000000.0, gather=None, reduce_scatter=None, all_to_all=None), Link(alpha=2e-05, bandwidth=2000000000.0, gather=None, reduce_scatter=None, all_to_all=None))
        """
        if collective == "all_reduce":
            return self
        own = {"reduce_scatter": self.reduce_scatter, "all_to_all": self.all_to_all}.get(collective)
        figures = own or self.gather
        return Link(*figures, measured=self.measured) if figures is not None else self

    def latency_only(self) -> Link:
        """The same latencies with unlimited bandwidth (what a collective costs whatever its bytes).

        >>> Link(1e-5, 1e9, gather=(2e-5, 2e9)).latency_only().of("all_gather").bandwidth
        inf
        """
        def free(pair):
            return None if pair is None else (pair[0], math.inf)
        return Link(self.alpha, math.inf, free(self.gather), free(self.reduce_scatter), free(self.all_to_all))

    def to_json(self) -> list:
        """[alpha, bandwidth], then the gathers' two, then the reduce-scatters' and all-to-alls' when measured.

        >>> Link(1e-5, 1e9, gather=(2e-5, 2e9)).to_json()
        [1e-05, 1000000000.0, 2e-05, 2000000000.0]
        >>> Link(1e-5, 1e9, measured=(2, (("all_reduce", ((4096, 1e-4),)),))).to_json()  # then what calibrate timed
        [1e-05, 1000000000.0, {'k': 2, 'all_reduce': [[4096, 0.0001]]}]
        """
        own = [self.alpha, self.bandwidth]
        if self.reduce_scatter is None and self.all_to_all is None:
            numbers = own + list(self.gather or ())
        else:
            gather = self.gather or (self.alpha, self.bandwidth)
            numbers = own + [*gather, *(self.reduce_scatter or gather), *(self.all_to_all or gather)]
        if not self.measured:
            return numbers
        k, timed = self.measured
        return numbers + [{"k": k, **{name: [list(point) for point in points] for name, points in timed}}]

    @classmethod
    def from_json(cls, values) -> Link:
        """The inverse of `to_json` (2, 4 or 8 numbers, then what calibrate timed when it did).

        >>> Link.from_json([1e-5, 1e9, 2e-5, 2e9]).gather, Link.from_json([1, 2, 3, 4, 5, 6, 7, 8]).all_to_all
        ((2e-05, 2000000000.0), (7, 8))
        >>> Link.from_json([1e-5, 1e9, {"k": 2, "all_reduce": [[65536, 2e-4], [4096, 1e-4]]}]).measured
        (2, (('all_reduce', ((4096, 0.0001), (65536, 0.0002))),))
        """
        values = list(values)
        timed = values.pop() if values and isinstance(values[-1], dict) else None
        if len(values) not in (2, 4, 8):
            raise UserInputError(f"a link is [alpha, bandwidth] with the all-gathers' two and the reduce-scatters' "
                                 f"and all-to-alls' two after them (2, 4 or 8 numbers; then calibrate's timings); "
                                 f"got {values!r}")
        pairs = [tuple(values[i:i + 2]) for i in range(2, len(values), 2)] + [None] * 3
        measured = () if timed is None else (
            int(timed["k"]), tuple((name, tuple(sorted(dict(map(tuple, points)).items())))  # by size, each once
                                   for name, points in timed.items() if name != "k"))
        return cls(values[0], values[1], *pairs[:3], measured=measured)


@dataclass(frozen=True)
class HardwareProfile:
    """A machine as numbers; `axis_links` overrides the node rule per mesh axis when given.

    >>> HardwareProfile().link((2, 8), 0) == HardwareProfile().inter_node   # 16 devices: the outer axis crosses nodes
    True
    >>> HardwareProfile(name="my-box", peak_flops=1e14).peak_flops
    100000000000000.0
    """

    name: str = "8xGPU-NVLink-nodes"
    peak_flops: float = 3.0e14
    memory_bandwidth: float = 2.0e12
    memory_bytes: float = 80e9
    devices_per_node: int = 8
    intra_node: Link = Link(5e-6, 2.0e11)
    inter_node: Link = Link(2e-5, 2.5e10)
    axis_links: tuple = field(default=())
    # Flash-style attention kernels keep no rows x keys weights for backward (torch has them on CUDA and, for
    # float32/bf16, on CPUs); False prices the weights a math kernel keeps.
    fused_attention: bool = True
    # Measured by `calibrate` (autoshard/cost/compute_rates.py); the defaults keep the nominal figures above:
    # matmul FLOP/s per dtype name (a dtype not listed runs at peak_flops), attention's FLOP/s (0: peak_flops),
    # the seconds an op's forward takes whatever its size (dispatch, kernel launch), what autograd adds to a
    # forward it records (ops whose output has a gradient), and their backward's; a view's forward (recorded) and
    # backward (it moves no data: only these).
    dtype_flops: tuple = field(default=())
    attention_flops: float = 0.0
    op_overhead_s: float = 0.0
    grad_op_overhead_s: float = 0.0
    recorded_op_overhead_s: float = 0.0
    view_overhead_s: float = 0.0
    view_grad_overhead_s: float = 0.0
    # Per op (ATen name): (forward, what recording adds, backward) seconds, for the ops calibrate times one by one;
    # the others pay the three figures above (the median of the timed ones).
    op_overheads: tuple = field(default=())
    # The seconds torch.distributed.pipelining's runtime spends on one action of a schedule (a stage's forward or
    # backward of one micro-batch) besides its compute and its messages' transfer.
    pipeline_action_s: float = 0.0
    # What each tensor a stage sends beyond its first adds to the action that sends it (each is its own message).
    pipeline_tensor_s: float = 0.0
    # A zero-bubble schedule's backward split in two (input gradients, then weight gradients) over the fused one.
    split_backward_factor: float = 1.0
    # The share of an asynchronous collective's time that compute running meanwhile does not pay (1: hidden whole,
    # a GPU's copy engines and NICs; CPU ranks whose gloo threads share the cores with the compute get less).
    comm_overlap: float = 1.0
    # Ranks that outnumber their host's cores share them (CPU ranks): `host_cores` is one host's cores (0: every rank
    # has a device of its own, a GPU), and the rates above are those of `rates_ranks` ranks computing at once (the
    # contention calibrate measured). A pipeline's ranks idle in its bubble, and the busy ones then run faster
    # (`core_contention`; autoshard/report/timeline.py `simulate`).
    host_cores: int = 0
    rates_ranks: int = 1
    # The compute calibrate ran before each collective it timed (seconds): its figures are for collectives that
    # follow that much compute at least; one sooner after the last costs less (the peers' threads are still awake),
    # down to back-to-back calls (`all_gather_time`'s `after_s`). 0: not measured (every figure taken as it is).
    collective_gap_s: float = 0.0
    # The optimizer's update as calibrate timed torch's (SGD for optimizer state factor 0, AdamW for 2): rows (factor,
    # seconds per parameter tensor, bytes per second of the (3 + 2 factor) x the parameter bytes it reads and writes);
    # () : `optimizer_update` prices it from memory_bandwidth and op_overhead_s.
    optimizer_updates: tuple = field(default=())

    def to_json(self) -> dict:
        """The profile as a JSON object (what `calibrate` writes and `from_json` reads).

        >>> HardwareProfile().to_json()["intra_node"]
        [5e-06, 200000000000.0]
        """
        return {"name": self.name, "peak_flops": self.peak_flops, "memory_bandwidth": self.memory_bandwidth,
                "memory_bytes": self.memory_bytes, "devices_per_node": self.devices_per_node,
                "intra_node": self.intra_node.to_json(), "inter_node": self.inter_node.to_json(),
                "axis_links": [link.to_json() for link in self.axis_links],
                "fused_attention": self.fused_attention, "dtype_flops": [list(pair) for pair in self.dtype_flops],
                "attention_flops": self.attention_flops, "op_overhead_s": self.op_overhead_s,
                "grad_op_overhead_s": self.grad_op_overhead_s, "recorded_op_overhead_s": self.recorded_op_overhead_s,
                "view_overhead_s": self.view_overhead_s, "view_grad_overhead_s": self.view_grad_overhead_s,
                "op_overheads": [list(row) for row in self.op_overheads], "pipeline_action_s": self.pipeline_action_s,
                "pipeline_tensor_s": self.pipeline_tensor_s,
                "split_backward_factor": self.split_backward_factor, "comm_overlap": self.comm_overlap,
                "host_cores": self.host_cores, "rates_ranks": self.rates_ranks,
                "collective_gap_s": self.collective_gap_s,
                "optimizer_updates": [list(row) for row in self.optimizer_updates]}

    @classmethod
    def from_json(cls, data: dict) -> HardwareProfile:
        """A profile from JSON (e.g. what `python -m autoshard calibrate` wrote); unknown keys are errors.

        >>> HardwareProfile.from_json({"name": "x", "peak_flops": 1e12}).peak_flops
        1000000000000.0
        """
        known = set(cls.__dataclass_fields__)
        if not isinstance(data, dict) or set(data) - known:
            raise UserInputError(f"a hardware profile is a JSON object with keys {sorted(known)}; got "
                                 f"{sorted(data) if isinstance(data, dict) else type(data).__name__}")
        fields = dict(data)
        for key in ("intra_node", "inter_node"):
            if key in fields:
                fields[key] = Link.from_json(fields[key])
        if "axis_links" in fields:
            fields["axis_links"] = tuple(Link.from_json(values) for values in fields["axis_links"])
        if "dtype_flops" in fields:
            fields["dtype_flops"] = tuple((str(name), float(rate)) for name, rate in fields["dtype_flops"])
        if "op_overheads" in fields:
            fields["op_overheads"] = tuple((str(name), *map(float, costs)) for name, *costs in fields["op_overheads"])
        if "optimizer_updates" in fields:
            fields["optimizer_updates"] = tuple(tuple(map(float, row)) for row in fields["optimizer_updates"])
        return cls(**fields)

    def optimizer_update(self, state_factor: float) -> tuple[float, float]:
        """(seconds per parameter tensor, bytes per second) of an optimizer keeping `state_factor` x the parameters'
        bytes of state: calibrate's timings (`optimizer_updates`) interpolated between the factors timed (the nearest
        outside them), else memory-bound at memory_bandwidth with 1 + 2 factor ops per tensor.

        >>> HardwareProfile(memory_bandwidth=1e9, op_overhead_s=1e-6).optimizer_update(2.0)  # 5 ops per tensor
        (4.9999999999999996e-06, 1000000000.0)
        >>> timed = HardwareProfile(optimizer_updates=((0.0, 1e-6, 4e10), (2.0, 5e-6, 1e10)))
        >>> timed.optimizer_update(1.0), timed.optimizer_update(3.0)
        ((3e-06, 25000000000.0), (5e-06, 10000000000.0))
        """
        rows = sorted(self.optimizer_updates)
        if not rows:
            return (1 + 2 * state_factor) * self.op_overhead_s, self.memory_bandwidth
        below = [row for row in rows if row[0] <= state_factor] or rows[:1]
        above = [row for row in rows if row[0] >= state_factor] or rows[-1:]
        (f0, t0, b0), (f1, t1, b1) = below[-1], above[0]
        share = 0.0 if f1 == f0 else (state_factor - f0) / (f1 - f0)
        return t0 + share * (t1 - t0), b0 + share * (b1 - b0)

    def fixed_costs(self, target) -> tuple[float, float, float]:
        """(forward, added when autograd records it, backward) seconds an op `target` (an OpOverload) takes whatever
        its size: its row of `op_overheads`, else the profile's figures for any op.

        >>> import torch
        >>> profile = HardwareProfile(op_overhead_s=3e-6, op_overheads=(("aten.gelu.default", 1e-5, 1e-6, 2e-5),))
        >>> profile.fixed_costs(torch.ops.aten.gelu.default), profile.fixed_costs(torch.ops.aten.add.Tensor)
        ((1e-05, 1e-06, 2e-05), (3e-06, 0.0, 0.0))
        """
        default = (self.op_overhead_s, self.recorded_op_overhead_s, self.grad_op_overhead_s)
        if not self.op_overheads:
            return default
        cache = self.__dict__.get("_fixed_by_target")
        if cache is None:  # by target: str(target) per call would cost the planner seconds
            cache = self.__dict__["_fixed_by_target"] = {}
        found = cache.get(target)
        if found is None:
            found = cache[target] = next((tuple(costs) for name, *costs in self.op_overheads if name == str(target)),
                                         default)
        return found

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_fixed_by_target"}

    def matmul_flops(self, dtype) -> float:
        """FLOP/s of a matmul in `dtype` (a torch.dtype or its name): the calibrated rate, else `peak_flops`.

        >>> import torch
        >>> HardwareProfile(dtype_flops=(("float64", 1e9),)).matmul_flops(torch.float64)
        1000000000.0
        >>> HardwareProfile(peak_flops=2e9).matmul_flops("bfloat16")
        2000000000.0
        """
        name = str(dtype).removeprefix("torch.")
        return next((rate for known, rate in self.dtype_flops if known == name), self.peak_flops)

    def link(self, mesh_shape, axis: int) -> Link:
        """The link mesh axis `axis` communicates over: `axis_links[axis]` when given, else intra-node
        when the axes from `axis` inwards fit in one node (devices_per_node), else inter-node.

        >>> profile = HardwareProfile()
        >>> profile.link((2, 8), 1) == profile.intra_node, profile.link((2, 8), 0) == profile.inter_node
        (True, True)
        """
        if self.axis_links:
            return self.axis_links[axis]
        inner = math.prod(mesh_shape[axis:])
        return self.intra_node if inner <= self.devices_per_node else self.inter_node


def core_contention(busy: float, cores: int) -> float:
    """How many times longer a rank's compute takes with `busy` ranks of a host of `cores` cores computing at once
    than alone: the cores shared evenly (1 where each rank has its own device, `cores` 0, or the cores outnumber them).

    >>> core_contention(3, 2), core_contention(3, 0)
    (1.5, 1.0)
    """
    return max(1.0, busy / cores) if cores else 1.0


DEFAULT_PROFILE = HardwareProfile()
# A CPU host whose ranks talk over loopback gloo (measured order of magnitude on the 2-core dev box;
# `python -m autoshard calibrate` measures the links of the machine at hand).
CPU_PROFILE = HardwareProfile(name="cpu-gloo", peak_flops=2e10, memory_bandwidth=5e9, memory_bytes=16e9,
                              devices_per_node=64, intra_node=Link(5e-5, 1e9), inter_node=Link(5e-5, 1e9))
# DGX A100-80GB nodes of 8 (Narayanan et al. 2021): 312 TFLOP/s bf16, ~2 TB/s HBM, NVLink ~300 GB/s per GPU
# per direction inside a node, one ~25 GB/s (200 Gb/s HDR) InfiniBand link per GPU between nodes; nominal figures.
A100_80GB = HardwareProfile(name="A100-80GB", peak_flops=312e12, memory_bandwidth=2.0e12, memory_bytes=80e9,
                            devices_per_node=8, intra_node=Link(5e-6, 300e9), inter_node=Link(1e-5, 25e9))
# H100-80GB SXM nodes of 8 (DGX/HGX H100), calibrated: each nominal figure times what is achieved in practice.
# Matmuls: 989 TFLOP/s dense bf16 (datasheet) x 0.75, what large cuBLAS GEMMs sustain at LLM shapes (70-80%
# of the dense peak; clocks drop under load). HBM3: 3.35 TB/s x 0.9 (STREAM-like copies reach ~3.0 TB/s).
# NVLink 4: 450 GB/s per direction per GPU x 0.8 = 360 GB/s, the ring bus bandwidth nccl-tests reports for 8
# GPUs without NVLink SHARP (460-480 GB/s with it). InfiniBand NDR: 400 Gb/s = 50 GB/s per GPU x 0.8 = 40 GB/s.
# The ring formulas below charge bytes at `bandwidth` as nccl-tests' bus bandwidth, so these are bus figures.
H100_BF16_PEAK = 989e12
H100_80GB = HardwareProfile(name="H100-80GB", peak_flops=0.75 * H100_BF16_PEAK, memory_bandwidth=0.9 * 3.35e12,
                            memory_bytes=80e9, devices_per_node=8, intra_node=Link(5e-6, 0.8 * 450e9),
                            inter_node=Link(1e-5, 0.8 * 50e9))
PROFILES = {"gpu": DEFAULT_PROFILE, "cpu": CPU_PROFILE, "a100": A100_80GB, "h100": H100_80GB}


def load_profile(spec) -> HardwareProfile:
    """'gpu', 'cpu', 'a100', 'h100' (PROFILES), a HardwareProfile, or the path of a profile JSON file.

    >>> load_profile("cpu").name, load_profile("h100").name
    ('cpu-gloo', 'H100-80GB')
    >>> load_profile(None) is None   # parallelize then uses the default ("gpu")
    True
    """
    import json

    if spec is None or isinstance(spec, HardwareProfile):
        return spec
    if spec in PROFILES:
        return PROFILES[spec]
    try:
        with open(spec, encoding="utf-8") as f:
            return HardwareProfile.from_json(json.load(f))
    except (OSError, ValueError) as exc:
        raise UserInputError(f"profile {spec!r} is neither one of {sorted(PROFILES)} nor a readable profile JSON "
                             f"file: {exc}") from exc
