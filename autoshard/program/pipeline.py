"""Pipeline parallelism: options, the micro-batch program, and `parallelize_pipeline`.

A pipelined program is an intra-op program on the mesh without the `pp` axis, traced at the
micro-batch shape (batch / micro-batches), whose nodes `cut_stages` assigns to `pp size x virtual`
stages; each rank of the pp axis runs its stages' GraphModules under a torch.distributed.pipelining
schedule (autoshard/runtime/pipeline.py). Every micro-batch's loss is a mean over its own batch, so
the step's loss is the mean over micro-batches and the gradients are summed then divided by their
number: equal to one full-batch step for batch-mean losses (the default loss and cross-entropy).

>>> import autoshard
>>> from autoshard.cost.profiles import DEFAULT_PROFILE
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=3)
>>> prog = autoshard.parallelize(model, (2, 2), inputs, loss_fn=loss_fn, axis_names=("pp", "dp"),
...                              pipeline={"microbatches": 2, "schedule": "gpipe"})
>>> prog.plan.pipeline["stages"], prog.config.schedule
(2, 'GPipe')
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch

from autoshard.cost.profiles import Link
from autoshard.frontend.request import CompileOptions, CompileRequest
from autoshard.frontend.stages import StageAnnotations, collect_annotations
from autoshard.ir.errors import AutoshardError, UserInputError
from autoshard.ir.mesh import Mesh
from autoshard.passes.pass_lists import compile_state, recut, recuttable
from autoshard.program.pipeline_program import PipelineProgram
from autoshard.solver.errors import MemoryBudgetError
from autoshard.solver.problem import IlpProblem

# Our names -> torch.distributed.pipelining schedule class names (get_schedule_class).
SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved1f1b": "Interleaved1F1B", "loopedbfs": "LoopedBFS",
             "interleavedzerobubble": "InterleavedZeroBubble", "zbvzerobubble": "ZBVZeroBubble"}
MULTI_STAGE = {"Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble"}
V_STYLE = {"ZBVZeroBubble"}  # stage s on pp rank s for s < p, then back: 2p-1-s
SOLO_AXIS = "stage_device"  # the intra-op axis of a mesh that is only a pipeline
_DEFAULT_LINK = Link(5e-6, 2.0e11)  # a pp axis's link when no profile says
OPTION_KEYS = {"axis", "microbatches", "schedule", "virtual_stages", "balance", "split_points"}


@dataclass(frozen=True)
class PipelineConfig:
    """What the pipeline is: its mesh axis and size, stages per rank, schedule, micro-batches, cut.

    >>> zbv = PipelineConfig("pp", pp_size=2, microbatches=4, schedule="ZBVZeroBubble", virtual=2)
    >>> zbv.num_stages, [zbv.stage_rank(s) for s in range(4)]  # V-shaped: stages 0 and 3 on pp rank 0
    (4, [0, 1, 1, 0])
    """

    axis: str
    pp_size: int
    microbatches: int
    schedule: str = "1F1B"
    virtual: int = 1
    annotations: StageAnnotations | None = None
    link: Link = _DEFAULT_LINK
    action_s: float = 0.0  # the runtime's fixed cost per schedule action (HardwareProfile.pipeline_action_s)
    tensor_s: float = 0.0  # and per tensor an action sends beyond its first (HardwareProfile.pipeline_tensor_s)
    split_backward: float = 1.0  # a backward split in I and W over the fused one (HardwareProfile's factor)
    # The share of a stage-to-stage message's transfer its sending rank's compute pays (1 - HardwareProfile's
    # comm_overlap: gloo's copies on CPU ranks share the cores with the compute; a GPU's NIC or NVLink none).
    send_share: float = 0.0
    # Ranks sharing a host's cores (HardwareProfile.host_cores, 0: none): the stage times were measured with
    # `rates_ranks` ranks busy at once, and `host_ranks` of this pipeline's ranks share one host.
    host_cores: int = 0
    rates_ranks: int = 1
    host_ranks: int = 1

    def message_seconds(self, tensors: int) -> float:
        """What an action sending `tensors` tensors pays besides its first (each is a message of its own).

        >>> PipelineConfig("pp", 2, 4, tensor_s=1e-4).message_seconds(7)
        0.0006000000000000001
        """
        return self.tensor_s * max(tensors - 1, 0)

    @property
    def shares_cores(self) -> bool:
        """Whether busy ranks run faster while others idle: more ranks than cores, when calibrated or now.

        >>> PipelineConfig("pp", 4, 8).shares_cores, PipelineConfig("pp", 4, 8, host_cores=2, host_ranks=4).shares_cores
        (False, True)
        """
        return self.host_cores > 0 and max(self.rates_ranks, self.host_ranks) > self.host_cores

    @property
    def num_stages(self) -> int:
        """Stages in all: pp size x stages per rank.

        >>> prog.config.num_stages
        2
        """
        return self.pp_size * self.virtual

    def stage_rank(self, stage: int) -> int:
        """The pp coordinate that runs `stage` (round robin; V-shaped for ZBVZeroBubble).

        >>> [PipelineConfig("pp", 2, 4, "Interleaved1F1B", virtual=2).stage_rank(s) for s in range(4)]
        [0, 1, 0, 1]
        """
        if self.schedule in V_STYLE:
            block, pos = divmod(stage, self.pp_size)
            return pos if block % 2 == 0 else self.pp_size - 1 - pos
        return stage % self.pp_size

    def stages_of(self, pp_coord: int) -> list[int]:
        """The stages pp rank `pp_coord` runs, in order.

        >>> PipelineConfig("pp", 2, 4, "ZBVZeroBubble", virtual=2).stages_of(0)
        [0, 3]
        """
        return [s for s in range(self.num_stages) if self.stage_rank(s) == pp_coord]

    def to_json(self) -> dict:
        """The plan's `pipeline` record of the configuration.

        >>> prog.config.to_json()  # doctest: +NORMALIZE_WHITESPACE
        {'axis': 'pp', 'pp_size': 2, 'microbatches': 2, 'schedule': 'GPipe', 'virtual_stages': 1, 'stages': 2,
         'cut': 'automatic'}
        """
        return {"axis": self.axis, "pp_size": self.pp_size, "microbatches": self.microbatches,
                "schedule": self.schedule, "virtual_stages": self.virtual, "stages": self.num_stages,
                "cut": self.annotations.source if self.annotations else "automatic"}


def schedule_name(name) -> str:
    """torch's schedule class name for a user's spelling (case, '_', '-' and spaces ignored; short names).

    >>> schedule_name("1f1b"), schedule_name("zero-bubble"), schedule_name("Interleaved")
    ('1F1B', 'InterleavedZeroBubble', 'Interleaved1F1B')
    """
    key = str(name).replace("_", "").replace("-", "").replace(" ", "").lower()
    key = {"zerobubble": "interleavedzerobubble", "zb": "interleavedzerobubble", "zbv": "zbvzerobubble",
           "interleaved": "interleaved1f1b"}.get(key, key)
    if key not in SCHEDULES:
        raise UserInputError(f"unknown pipeline schedule {name!r}; choose one of "
                             f"{sorted(set(SCHEDULES.values()))} (case-insensitive)")
    return SCHEDULES[key]


def check_options(options) -> dict:
    """The `pipeline=` argument as a dict of known options (None or True: defaults).

    >>> check_options({"microbatches": 4}), check_options(True)
    ({'microbatches': 4}, {})
    >>> check_options({"micro_batches": 4})
    Traceback (most recent call last):
    ...
    autoshard.ir.errors.UserInputError: unknown pipeline option(s) ['micro_batches']; known: ['axis', 'balance', ...]
    """
    if options is None or options is True:
        return {}
    if not isinstance(options, dict):
        raise UserInputError("pipeline= takes a dict such as {'microbatches': 4, 'schedule': '1f1b'}; got "
                             f"{type(options).__name__}")
    unknown = set(options) - OPTION_KEYS
    if unknown:
        raise UserInputError(f"unknown pipeline option(s) {sorted(unknown)}; known: {sorted(OPTION_KEYS)}")
    return dict(options)


def make_config(mesh: Mesh, axis: str, options: dict, annotations, batch: int, profile) -> PipelineConfig:
    """Check the user's pipeline options against the mesh and the batch; fill defaults (2 x pp size
    micro-batches; 2 stages per rank for the interleaved schedules).

    >>> config = make_config(prog.mesh, "pp", {"schedule": "interleaved"}, None, 8, DEFAULT_PROFILE)
    >>> config.microbatches, config.virtual, config.num_stages
    (4, 2, 4)
    """
    schedule = schedule_name(options.get("schedule", "1f1b"))
    default_virtual = 2 if schedule in MULTI_STAGE else 1
    virtual = options.get("virtual_stages", default_virtual)
    if not isinstance(virtual, int) or virtual < 1:
        raise UserInputError(f"virtual_stages must be an int >= 1, got {virtual!r}")
    if schedule not in MULTI_STAGE and virtual != 1:
        raise UserInputError(f"schedule {schedule} runs one stage per rank; virtual_stages={virtual} needs an "
                             "interleaved schedule (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble)")
    if schedule in V_STYLE and virtual != 2:
        raise UserInputError(f"schedule {schedule} runs exactly 2 stages per rank; set virtual_stages=2")
    p = mesh.shape[mesh.axis(axis)]
    m = options.get("microbatches", 2 * p)
    if not isinstance(m, int) or m < 1:
        raise UserInputError(f"microbatches must be an int >= 1, got {m!r}")
    if batch % m:
        raise UserInputError(f"the batch of {batch} (dim 0 of the inputs) does not split into {m} micro-batches; "
                             f"choose microbatches dividing {batch}")
    if schedule in MULTI_STAGE and m % p:
        raise UserInputError(f"schedule {schedule} needs the micro-batches ({m}) to be a multiple of the pp axis "
                             f"size ({p})")
    link = profile.link(mesh.shape, mesh.axis(axis))
    return PipelineConfig(axis, p, m, schedule, virtual, annotations, link, profile.pipeline_action_s,
                          profile.pipeline_tensor_s, profile.split_backward_factor, 1.0 - profile.comm_overlap,
                          profile.host_cores, profile.rates_ranks, min(mesh.size, profile.devices_per_node))


def batch_size(example_inputs) -> int:
    """Dim 0 of the inputs (every input must have the same): what micro-batches split.

    >>> batch_size(inputs)
    8
    """
    sizes = {tuple(x.shape)[:1] for x in example_inputs if isinstance(x, torch.Tensor)}
    if len(sizes) != 1 or () in sizes:
        raise UserInputError("pipelining splits every input along dim 0 into micro-batches, so every input needs "
                             f"the same dim 0 (the batch); got shapes {[tuple(x.shape) for x in example_inputs]}")
    return sizes.pop()[0]


def microbatch_inputs(example_inputs, m: int) -> tuple:
    """Example inputs of one micro-batch (the shape the pipelined program is traced at).

    >>> microbatch_inputs(inputs, 4)[0].shape
    torch.Size([2, 32])
    """
    return tuple(x[: x.shape[0] // m] for x in example_inputs)


def inner_mesh(mesh: Mesh, axis: str) -> Mesh:
    """The mesh without the pp axis (the intra-op plan's mesh); a pure pipeline gets one size-1 axis.

    >>> inner_mesh(prog.mesh, "pp"), inner_mesh(Mesh((4,), ("pp",)), "pp")
    (Mesh(dp=2), Mesh(stage_device=1))
    """
    keep = [i for i, name in enumerate(mesh.names) if name != axis]
    if not keep:  # a pure pipeline: each stage on one device (a size-1 axis keeps the passes uniform)
        return Mesh((1,), (SOLO_AXIS,))
    return Mesh(tuple(mesh.shape[i] for i in keep), tuple(mesh.names[i] for i in keep))


def inner_profile(profile, mesh: Mesh, axis: str):
    """The profile for the mesh without the pp axis: each remaining axis keeps its link of the full mesh.

    >>> inner_profile(DEFAULT_PROFILE, prog.mesh, "pp").axis_links == (DEFAULT_PROFILE.link((2, 2), 1),)
    True
    """
    links = tuple(profile.link(mesh.shape, i) for i, name in enumerate(mesh.names) if name != axis) \
        or (profile.intra_node,)
    return dataclasses.replace(profile, axis_links=links)


def _warn_batch_statistics(model, microbatches: int) -> None:
    """BatchNorm in training normalises each micro-batch by its own statistics: not the full-batch step."""
    norms = [path for path, m in model.named_modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
             and m.training] if isinstance(model, torch.nn.Module) else []
    if norms and microbatches > 1:
        warnings.warn(f"autoshard: {len(norms)} BatchNorm module(s) in training mode (e.g. {norms[0]!r}) see one "
                      f"micro-batch at a time ({microbatches} per step), so their statistics and the step differ "
                      "from a full-batch step; use microbatches=1, eval-mode norms, or LayerNorm/GroupNorm",
                      stacklevel=3)


REPLANS = 3  # plans against a tighter budget when the fullest pp rank overflows it after the cut


class PipelineNotReplanned(AutoshardError):
    """A pipeline whose fullest pp rank overflowed the budget and that the caller did not want planned again against
    a tighter one (`parallelize_pipeline`'s `worth_replanning`: e.g. a search that knows it cannot win).

    >>> issubclass(PipelineNotReplanned, AutoshardError)  # a search records it as the candidate's row
    True
    """


def parallelize_pipeline(request: CompileRequest, axis: str, options: dict, worth_replanning=None,
                         planned: PipelineProgram | None = None):
    """Plan the pipelined program of `request` over mesh axis `axis` with pipeline `options`: the intra-op
    plan on the other axes at micro-batch shape, then the cut. `parallelize` calls it for a mesh axis named
    "pp" (or `pipeline={"axis": ...}`); a saved pipelined plan in `request.plan` is applied, not solved. A plan whose
    fullest pp rank overflows the budget is planned again against a tighter one, unless `worth_replanning(program)`
    (the overflowing PipelineProgram) gives a reason not to: PipelineNotReplanned says it. `planned` is this
    compile's result when the caller has it already (`recut_pipeline`'s cut: what a fresh compile gives): only the
    plans against a tighter budget are made.

    >>> piped = parallelize_pipeline(CompileRequest(model, prog.mesh, inputs, loss_fn=loss_fn), "pp",
    ...                              {"microbatches": 4})
    >>> piped.inner_mesh, piped.config.microbatches, piped.state.traced.gm.graph is not None
    (Mesh(dp=2), 4, True)
    """
    options = check_options(options)
    mesh, model = request.mesh, request.model
    example_inputs = _inputs(request)
    annotations = collect_annotations(model, request.hints, options.get("balance"), options.get("split_points"))
    if annotations is None and request.plan is not None:
        # a saved plan's cut is one of its decisions, applied as made: cut again under another profile (a user's
        # new calibration) the cost-balanced cut may fall elsewhere, and the saved placements with it
        annotations = StageAnnotations(node_stages={r.name: r.stage for r in request.plan.rows if r.kind != "comm"},
                                       source=request.plan.pipeline["cut"])
    profile = request.options.profile
    config = make_config(mesh, axis, options, annotations, batch_size(example_inputs), profile)
    _warn_batch_statistics(model, config.microbatches)
    micro = request.replace(mesh=inner_mesh(mesh, axis),
                            example_inputs=microbatch_inputs(example_inputs, config.microbatches),
                            options=request.options.replace(profile=inner_profile(profile, mesh, axis),
                                                            pipeline=config))
    state, history = (planned.state, planned.history) if planned is not None else compile_state(micro, pipeline=True)
    budget = CompileOptions.of(request.options).budget_bytes
    fullest = state.predicted.memory_bytes_per_rank  # the fullest pp rank's, counted after the cut
    tightened = budget
    for _ in range(REPLANS if request.plan is None else 0):
        if fullest <= budget:
            break
        reason = worth_replanning(PipelineProgram(state, history, mesh, config)) if worth_replanning else None
        if reason:
            raise PipelineNotReplanned(f"a {config.pp_size}-stage {config.schedule} pipeline with {config.microbatches} "
                                       f"micro-batches overflows the budget ({fullest / 2**30:.3g} GiB on its fullest "
                                       f"pp rank): {reason}")
        # solve counted a pp rank's share of the parameters and activations with equal stages (param_share,
        # activation_share); the fullest rank after the cut holds more (a tied weight on two ranks, the head's
        # outputs on the last, a cut that cannot move enough layers off a rank): plan again against a budget
        # tightened by as much, which may take the memory ladder a rung higher
        tightened *= budget / fullest
        state, history = compile_state(micro.replace(options=micro.options.replace(memory_budget=tightened)),
                                       pipeline=True)
        fullest = state.predicted.memory_bytes_per_rank
    if fullest > budget and request.plan is None:
        raise pipeline_memory_error(fullest, budget, config)
    return PipelineProgram(state, history, mesh, config)


def _inputs(request: CompileRequest) -> tuple:
    """The request's example inputs as a tuple (a lone tensor is one input)."""
    inputs = request.example_inputs
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def recut_pipeline(request: CompileRequest, prog: PipelineProgram, options: dict,
                   worth_replanning=None) -> PipelineProgram:
    """`prog` (planned from `request` by `parallelize_pipeline`) under other pipeline `options` of the same axis
    and micro-batch count (a schedule, stages per rank): its micro-batch program is not planned again, only cut
    again (`recut`); the result is the program `parallelize_pipeline(request, axis, options)` returns. A cut whose
    fullest pp rank does not fit the budget, or whose schedule keeps other activations in flight (`recuttable`), is
    planned in full (`worth_replanning`: as `parallelize_pipeline`'s).

    >>> again = recut_pipeline(CompileRequest(model, prog.mesh, inputs, loss_fn=loss_fn), prog,
    ...                        {"microbatches": 2, "schedule": "1f1b"})
    >>> again.config.schedule, again.plan.pipeline["stages"]
    ('1F1B', 2)
    """
    options = check_options(options)
    config = make_config(prog.mesh, prog.config.axis, options, prog.config.annotations, batch_size(_inputs(request)),
                         request.options.profile)
    if not recuttable(prog.config, config):  # its ILP counts other activations in flight: plan it afresh
        return parallelize_pipeline(request, prog.config.axis, options, worth_replanning)
    recutted = PipelineProgram(*recut(prog.state, prog.history, config), prog.mesh, config)
    if recutted.state.predicted.memory_bytes_per_rank > CompileOptions.of(request.options).budget_bytes:
        # a fresh compile at this budget would give this very cut: only the plans against a tighter one are made
        return parallelize_pipeline(request, prog.config.axis, options, worth_replanning, planned=recutted)
    return recutted


def pipeline_memory_error(fullest: float, budget: float, config: PipelineConfig) -> MemoryBudgetError:
    """The refusal of a pipeline whose fullest pp rank does not fit the budget, even planned against a tighter one.

    >>> str(pipeline_memory_error(80e9, 72e9, PipelineConfig("pp", 4, 8))).split(":")[0]
    'no plan fits the memory budget of 67.055 GiB (72000000000 bytes) per device'
    """
    problem = IlpProblem([1], [[0.0]], memory=[[fullest]], budget=budget, kinds=["the fullest pp rank"],
                         names=[f"pp rank of a {config.pp_size}-stage {config.schedule} pipeline"])
    return MemoryBudgetError(problem, searched=f"the fullest of {config.pp_size} pp ranks after the cut, planned "
                                               "again against a budget tightened by its excess")
