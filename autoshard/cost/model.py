"""Cost model: alpha-beta collectives per mesh axis (ring formulas) and compute from FLOPs over peak.

Hardware profiles are data. The default is 8-GPU nodes with NVLink inside a node and a slower network
between nodes: the innermost mesh axes whose sizes multiply to at most 8 are intra-node, the rest
inter-node (DESIGN: axis order is slow -> fast).

Byte conventions (also what the runtime counts): all_reduce/reduce_scatter/all_to_all carry the
rank's input tensor, all_gather the gathered output.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from autoshard.ir.collective_table import TABLE, collective_for, direction_bytes
from autoshard.ir.errors import UserInputError
from autoshard.ir.placement import Partial, Placement, Shard
from autoshard.ir.redistribute import plan_redistribute

INF = float("inf")


@dataclass(frozen=True)
class Link:
    """One collective link: per-message latency (s) and bandwidth (bytes/s).

    >>> link = Link(alpha=1e-5, bandwidth=1e9)   # 10 us per message, 1 GB/s
    >>> round(all_reduce_time(1e6, 4, link), 6)
    0.00156
    """

    alpha: float
    bandwidth: float


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

    def to_json(self) -> dict:
        """The profile as a JSON object (what `calibrate` writes and `from_json` reads).

        >>> HardwareProfile().to_json()["intra_node"]
        [5e-06, 200000000000.0]
        """
        return {"name": self.name, "peak_flops": self.peak_flops, "memory_bandwidth": self.memory_bandwidth,
                "memory_bytes": self.memory_bytes, "devices_per_node": self.devices_per_node,
                "intra_node": [self.intra_node.alpha, self.intra_node.bandwidth],
                "inter_node": [self.inter_node.alpha, self.inter_node.bandwidth],
                "axis_links": [[link.alpha, link.bandwidth] for link in self.axis_links],
                "fused_attention": self.fused_attention}

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
                fields[key] = Link(*fields[key])
        if "axis_links" in fields:
            fields["axis_links"] = tuple(Link(*pair) for pair in fields["axis_links"])
        return cls(**fields)

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


def all_reduce_time(nbytes: float, k: int, link: Link) -> float:
    """Seconds of a ring all-reduce of `nbytes` over `k` ranks: 2(k-1)/k of the bytes plus 2(k-1) latencies.

    >>> all_reduce_time(1e6, 4, Link(1e-5, 1e9))
    0.00156
    """
    return 0.0 if k == 1 else 2 * (k - 1) / k * nbytes / link.bandwidth + 2 * (k - 1) * link.alpha


def all_gather_time(out_bytes: float, k: int, link: Link) -> float:
    """Seconds of a ring all-gather producing `out_bytes` per rank (also a reduce-scatter of that input).

    >>> all_gather_time(1e6, 4, Link(1e-5, 1e9))
    0.00078
    """
    return 0.0 if k == 1 else (k - 1) / k * out_bytes / link.bandwidth + (k - 1) * link.alpha


reduce_scatter_time = all_gather_time


def all_to_all_time(local_bytes: float, k: int, link: Link) -> float:
    """Seconds of an all-to-all of `local_bytes` per rank over `k` ranks.

    >>> all_to_all_time(1e6, 4, Link(1e-5, 1e9))
    0.00078
    """
    return 0.0 if k == 1 else (k - 1) / k * local_bytes / link.bandwidth + (k - 1) * link.alpha


# Each emitted collective (autoshard.comm's "op") as the ring collectives its forward and backward run
# (ir/collective_table.py); the ILP, predict, the stage table and the scale search all price
# communication through `collective_time`.
COLLECTIVES = {name: (row.forward, row.backward) for name, row in TABLE.items()}
_RING = {"all_reduce": all_reduce_time, "all_gather": all_gather_time, "reduce_scatter": reduce_scatter_time,
         "all_to_all": all_to_all_time}


def collective_time(op: str, fwd_bytes: float, bwd_bytes: float, k: int, link: Link) -> float:
    """Seconds of one emitted collective, forward and backward: a direction that moves no bytes (a chunk's
    forward is a local slice; a value without a gradient has no backward) costs nothing.

    >>> link = Link(1e-5, 1e9)
    >>> collective_time("reduce_scatter", 1e6, 1e6, 4, link) == reduce_scatter_time(1e6, 4, link) + all_gather_time(1e6, 4, link)
    True
    >>> collective_time("chunk", 0, 0, 4, link)   # forward slice, no gradient: free
    0.0
    """
    total = 0.0
    for ring, nbytes in zip(COLLECTIVES[op], (fwd_bytes, bwd_bytes)):
        if ring is not None and nbytes > 0:
            total += _RING[ring](nbytes, k, link)
    return total


def collective_latency(op: str, fwd_bytes: float, bwd_bytes: float, k: int, link: Link) -> float:
    """The part of `collective_time` that does not shrink with the bytes (per-message latencies).

    >>> round(collective_latency("all_gather_sum_grad", 1e6, 1e6, 4, Link(1e-5, 1e9)), 9)  # 2 x 3 steps of 10 us
    6e-05
    """
    return collective_time(op, fwd_bytes, bwd_bytes, k, Link(link.alpha, math.inf))


@functools.lru_cache(maxsize=65536)  # the ILP prices the same conversion of the same bytes many times over
def conversion_time(src: Placement, dst: Placement, nbytes: float, k: int, link: Link,
                    with_backward: bool = True) -> float:
    """Forward (+ backward, for values with a gradient) time of turning `src` into `dst` on one axis;
    `nbytes`: the tensor's bytes, whole on this axis.

    >>> from autoshard.ir.placement import P, R, S
    >>> conversion_time(S(0), R, 1e6, 4, Link(1e-5, 1e9))   # all-gather forward, nothing backward
    0.00078
    >>> conversion_time(P, R, 1e6, 4, Link(1e-5, 1e9))      # all-reduce
    0.00156
    """
    if src == dst:
        return 0.0
    if isinstance(dst, Partial):
        return INF  # making a partial sum out of a full tensor is never needed (even on a size-1 axis)
    if k == 1:
        return 0.0
    name = collective_for(src, dst)
    src_bytes, dst_bytes = (nbytes / k if isinstance(p, Shard) else nbytes for p in (src, dst))
    return collective_time(name, *direction_bytes(name, src_bytes, dst_bytes, with_backward), k, link)


@functools.lru_cache(maxsize=65536)
def fused_gather_saving(src, dst, partial_axes, global_bytes: float, mesh_shape, profile: HardwareProfile) -> float:
    """Seconds fuse_comm saves on the chain `plan_redistribute(src, dst)` followed by a gradient
    all-reduce on each of `partial_axes`: where the last step on such an axis is an all-gather, the
    two become one all_gather_sum_grad (its backward a reduce-scatter of the gathered block), so the
    all-reduce of the `dst` block and the gather's free backward give way to that reduce-scatter.

    >>> from autoshard.ir.placement import R, S, Spec
    >>> link = HardwareProfile().link((2, 2), 1)
    >>> saving = fused_gather_saving(Spec([S(0), S(0)]), Spec([S(0), R]), (1,), 1e6, (2, 2), HardwareProfile())
    >>> math.isclose(saving, all_reduce_time(5e5, 2, link) - reduce_scatter_time(5e5, 2, link))
    True
    """
    steps, spec, blocks = plan_redistribute(src, dst), src, []
    for step in steps:
        spec = step.apply(spec)
        blocks.append(global_bytes / math.prod(mesh_shape[a] for a, p in enumerate(spec) if isinstance(p, Shard)))
    saving = 0.0
    for axis in partial_axes:
        last = next((i for i in reversed(range(len(steps))) if steps[i].axis == axis), None)
        if last is None or steps[last].op != "all_gather":
            continue
        k, link = mesh_shape[axis], profile.link(mesh_shape, axis)
        gathered = blocks[last]
        saving += (collective_time("grad_all_reduce", 0, blocks[-1], k, link)
                   + collective_time("all_gather", gathered, 0, k, link)
                   - collective_time("all_gather_sum_grad", gathered, gathered, k, link))
    return saving


@functools.lru_cache(maxsize=65536)
def redistribution_time(src, dst, global_bytes: float, mesh_shape, profile: HardwareProfile,
                        with_backward: bool = True) -> float:
    """Forward (+ backward) seconds of the exact collectives `plan_redistribute(src, dst)` emits.

    >>> from autoshard.ir.placement import R, S, Spec
    >>> redistribution_time(Spec([S(0), R]), Spec([R, R]), 1e6, (2, 2), HardwareProfile())
    7.500000000000001e-06
    """
    try:
        steps = plan_redistribute(src, dst)
    except Exception:  # noqa: BLE001  (an impossible conversion, e.g. to a partial sum)
        return INF
    total, spec = 0.0, src
    for step in steps:
        local = global_bytes / math.prod(mesh_shape[a] for a, p in enumerate(spec) if isinstance(p, Shard))
        k, link = mesh_shape[step.axis], profile.link(mesh_shape, step.axis)
        after = step.apply(spec)
        out = global_bytes / math.prod(mesh_shape[a] for a, p in enumerate(after) if isinstance(p, Shard))
        total += collective_time(step.op, *direction_bytes(step.op, local, out, with_backward), k, link)
        spec = after
    return total
