"""A compile request: the model, the mesh, the example inputs, hints, the loss, a saved plan and the
compile options every pass reads. `parallelize` builds it once from the user's arguments (the options
parsed and checked there: the hardware profile and mixed-precision policy resolved, the random-number
mode and seed checked); the pipeline search and the compiler pass it on, changing fields with `replace`.

>>> options = CompileOptions.parse(profile="cpu", mixed_precision="bf16", seed=3)
>>> options.profile.name, options.mixed_precision.name, options.seed, options.rng
('cpu-gloo', 'bf16', 3, 'placement')
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from autoshard.cost.profiles import DEFAULT_PROFILE, HardwareProfile, load_profile
from autoshard.ir.errors import UserInputError
from autoshard.ir.mesh import Mesh
from autoshard.ir.mixed_precision import Policy, resolve_policy
from autoshard.runtime.compiled import require_cpp_compiler
from autoshard.runtime.rng import MODES

DEFAULT_HEADROOM = 0.1


def headroom_budget(profile: HardwareProfile, headroom: float = DEFAULT_HEADROOM) -> float:
    """The memory a plan may use per device when the user gives no budget: the device memory less the headroom.

    >>> headroom_budget(DEFAULT_PROFILE) / 1e9
    72.0
    """
    return profile.memory_bytes * (1 - headroom)


@dataclass(frozen=True)
class CompileOptions:
    """What `parallelize`'s keyword options become for the passes (see `parallelize` for each one's
    meaning). `memory_budget` is resolved by `parse`: the user's bytes, or the profile's device memory less
    `memory_headroom` (a share, default 10%: allocator fragmentation, communication buffers and the CUDA
    context live there); `checkpoint_budget` is the memory bound automatic recomputation aims at; `pipeline`
    is the PipelineConfig of a micro-batch program (autoshard/program/pipeline.py), None otherwise. `compile`
    compiles each rank's program with torch.compile (autoshard/runtime/compiled.py); it changes no plan.

    >>> CompileOptions().profile is DEFAULT_PROFILE
    True
    """

    profile: HardwareProfile = DEFAULT_PROFILE
    memory_budget: float | None = None
    memory_headroom: float = DEFAULT_HEADROOM
    optimizer_state_factor: float = 2.0
    zero: object = None
    checkpoint: object = None
    checkpoint_budget: float | None = None
    rng: str = "placement"
    seed: int | None = None
    mixed_precision: Policy | None = None
    pipeline: object = None
    fold_layers: bool = True
    compile: bool = False
    ilp_time_limit: float | None = None

    @classmethod
    def parse(cls, profile=None, mixed_precision=None, rng: str = "placement", seed=None, checkpoint=None,
              memory_budget=None, memory_headroom=DEFAULT_HEADROOM, compile: bool = False,
              **others) -> CompileOptions:
        """Check and resolve user-facing values: a profile name or file, a policy name, the rng mode and seed,
        the memory budget (default: the device memory less the headroom), and for `compile=True` that
        inductor has a C++ compiler (checked here, before any planning).
        `checkpoint="auto"` plans with activations kept and recomputes layers until `memory_budget` holds.

        >>> CompileOptions.parse(profile="gpu").memory_budget / 1e9  # 80 GB less 10%
        72.0
        >>> CompileOptions.parse(checkpoint="auto", memory_budget=1e9).memory_budget
        inf
        >>> CompileOptions.parse(rng="fast")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        autoshard.ir.errors.UserInputError: rng='fast' is not a random-number mode: use 'placement' (masks follow ...
        >>> CompileOptions.parse(compile=True).compile
        True
        >>> CompileOptions.parse(ilp_time_limit=0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        autoshard.ir.errors.UserInputError: ilp_time_limit=0: give the seconds each sharding ILP may search ...
        """
        if rng not in MODES:
            raise UserInputError(f"rng={rng!r} is not a random-number mode: use 'placement' (masks follow "
                                 "placements) or 'exact' (each rank's block of the single device's masks)")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise UserInputError(f"seed={seed!r}: give an int (or None for autoshard.manual_seed's)")
        if not isinstance(compile, bool):
            raise UserInputError(f"compile={compile!r}: give True (torch.compile each rank's program) or False")
        if compile:
            require_cpp_compiler()
        unknown = sorted(set(others) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise UserInputError(f"unknown compile option(s) {unknown}; the options are "
                                 f"{[f.name for f in dataclasses.fields(cls)]}")
        profile = load_profile(profile) or DEFAULT_PROFILE
        if isinstance(memory_headroom, bool) or not isinstance(memory_headroom, (int, float)) \
                or not 0 <= memory_headroom < 1:
            raise UserInputError(f"memory_headroom={memory_headroom!r}: give the share of device memory plans leave "
                                 "free, from 0 (none) to below 1, e.g. 0.1")
        limit = others.get("ilp_time_limit")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0
                                  or limit == float("inf")):
            raise UserInputError(f"ilp_time_limit={limit!r}: give the seconds each sharding ILP may search (a positive "
                                 "number), or None for the default scaled to the problem's size")
        if memory_budget is None:
            memory_budget = headroom_budget(profile, memory_headroom)
        elif isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)) or memory_budget <= 0:
            raise UserInputError(f"memory_budget={memory_budget!r}: give bytes per device (a positive number, or "
                                 "float('inf') for no bound)")
        options = cls(profile=profile, mixed_precision=resolve_policy(mixed_precision), rng=rng, seed=seed,
                      checkpoint=checkpoint, memory_budget=memory_budget, memory_headroom=memory_headroom,
                      compile=compile, **others)
        return options.recomputing_as_needed() if checkpoint == "auto" else options

    @property
    def budget_bytes(self) -> float:
        """The memory budget per device: `memory_budget`, or (options made without `parse`) the profile's memory
        less the headroom.

        >>> CompileOptions().budget_bytes / 1e9, CompileOptions(memory_budget=1e9).budget_bytes / 1e9
        (72.0, 1.0)
        """
        return headroom_budget(self.profile, self.memory_headroom) if self.memory_budget is None else \
            self.memory_budget

    def recomputing_as_needed(self) -> CompileOptions:
        """`checkpoint="auto"`: the ILP plans with activations kept (no bound); recomputation of repeated layers
        then brings the plan under the budget (`checkpoint_budget`, the memory budget unless given).

        >>> options = CompileOptions(memory_budget=1e9).recomputing_as_needed()
        >>> options.checkpoint, options.memory_budget, options.checkpoint_budget
        ('auto', inf, 1000000000.0)
        """
        budget = self.checkpoint_budget if self.checkpoint_budget is not None else self.memory_budget
        return self.replace(checkpoint="auto", checkpoint_budget=budget, memory_budget=float("inf"))

    @classmethod
    def of(cls, value) -> CompileOptions:
        """CompileOptions as given, or parsed from a dict of option names (tests and tools pass dicts).

        >>> CompileOptions.of({"profile": "cpu"}).profile.name
        'cpu-gloo'
        """
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise UserInputError(f"compile options must be a dict of option names or CompileOptions, not "
                                 f"{type(value).__name__}")
        return cls.parse(**value)

    def replace(self, **changes) -> CompileOptions:
        """A copy with `changes` (the options are frozen: a pass that plans under other options uses a copy).

        >>> CompileOptions().replace(memory_budget=float("inf")).memory_budget
        inf
        """
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class CompileRequest:
    """One compile: `model` (an nn.Module or fx.GraphModule), the `mesh`, the `example_inputs` (a tuple),
    `hints` (a dict, Hints or None), `loss_fn`, the `options`, a saved `plan` to apply instead of solving,
    `debug` (check the passes' invariants after every pass) and `plan_other_shapes` (the plan was made at
    other input shapes: apply its decisions where they still hold, `parallelize`'s module at a new batch size).

    >>> import torch
    >>> request = CompileRequest(torch.nn.Linear(4, 2), Mesh((2,), ("dp",)), (torch.randn(8, 4),))
    >>> request.replace(mesh=Mesh((4,), ("dp",))).mesh, request.options.rng
    (Mesh(dp=4), 'placement')
    """

    model: object
    mesh: Mesh
    example_inputs: tuple
    hints: object = None
    loss_fn: object = None
    options: CompileOptions = field(default_factory=CompileOptions)
    plan: object = None
    debug: bool = False
    plan_other_shapes: bool = False  # `plan` was made at other input shapes: re-specialise its decisions
    devices: int | None = None  # parallelize(devices=N): the mesh search plans each candidate mesh shape

    def replace(self, **changes) -> CompileRequest:
        """A copy with `changes` (e.g. the micro-batch program's mesh, inputs and options).

        >>> import torch
        >>> request = CompileRequest(torch.nn.Linear(4, 2), Mesh((2,), ("dp",)), (torch.randn(8, 4),))
        >>> request.replace(debug=True).debug, request.debug
        (True, False)
        """
        return dataclasses.replace(self, **changes)
