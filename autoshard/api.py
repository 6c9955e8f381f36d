"""`parallelize`: plan a model on a mesh and return its Program (or PipelineProgram) -- the entry point.
It resolves the mesh, hints and options once, lets the pipeline search decide whether to pipeline, and
otherwise compiles the intra-op program (autoshard/passes/pass_lists.py).

Megatron's tensor parallelism of a two-layer MLP, every parameter's placement given:

>>> import autoshard
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> megatron = {"layers.0.weight": {"tp": "S(0)"}, "layers.0.bias": {"tp": "S(0)"},
...             "layers.1.weight": {"tp": "S(1)"}, "layers.1.bias": {"tp": "R"}}
>>> tp = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("tp",), hints=megatron)
>>> loss, out = tp.simulate(*inputs)  # both ranks in this process: equals the single device
>>> torch.allclose(loss, loss_fn(model(*inputs), *inputs))
True
"""
from __future__ import annotations

import functools

import torch

from autoshard.frontend.hints import Hints
from autoshard.frontend.request import DEFAULT_HEADROOM, CompileOptions, CompileRequest
from autoshard.frontend.tp_modes import apply_parallel_config
from autoshard.frontend.trace import reuse_exports
from autoshard.ir.errors import UserInputError
from autoshard.ir.gc_tuning import fewer_collections
from autoshard.ir.mesh import Mesh
from autoshard.ir.warn_once import warn_once, warning_scope
from autoshard.passes.pass_lists import reuse_normalized
from autoshard.program.parallel_module import ParallelModule
from autoshard.search.hand_plan_search import plan_with_hand_plans
from autoshard.search.mesh_search import check_devices, plan_on_devices
from autoshard.search.pipeline_search import choose_pipeline
from autoshard.solver.session import solver_session
from autoshard.solver.time_limit import describe_stopped


def parallelize(model, mesh=None, example_inputs=None, hints=None, loss_fn=None, axis_names=None, debug=False,
                profile=None, memory_budget=None, optimizer_state_factor=2.0, plan=None, pipeline=None,
                zero=None, checkpoint=None, parallel=None, rng: str = "placement", seed: int | None = None,
                mixed_precision=None, memory_headroom: float = DEFAULT_HEADROOM, fold_layers: bool = True,
                compile: bool = False, weights=None, init_fn=None, ilp_time_limit: float | None = None,
                devices: int | None = None, plan_other_shapes: bool = False):
    """Plan `model` on `mesh` and return the Program (no process group needed to plan); without
    `example_inputs`, return a ParallelModule: an nn.Module that plans on its first batch and trains as this
    rank's share under torchrun (autoshard/program/parallel_module.py; `weights` and `init_fn` are then where its
    shards come from, as `Program.module` takes them: a meta model is initialised by default).

    `hints` is a dict in the hint-file format (or a path to a JSON hint file); `loss_fn(outputs,
    *inputs)` makes the loss part of the sharded program (default: the sum of the outputs' means).
    `profile` is a `HardwareProfile`, "gpu" (default: 8-GPU NVLink nodes), "cpu", or a profile JSON path; `memory_budget` bounds the bytes
    per device (parameters with gradients and `optimizer_state_factor` x optimizer state, inputs and
    saved activations); it defaults to the profile's device memory less `memory_headroom` (a share, 10%)
    (`float("inf")`: no bound). A plan that does not fit is not refused while ZeRO or recomputation can
    make one fit: the planner climbs ZeRO-1/2/3 and recomputation of repeated layers by itself
    (autoshard/passes/memory_fit.py); `prog.plan.predicted["memory"]` breaks the memory down.
    `plan` (a Plan, or the path of a file written by `Plan.save`) replaces solving: its decisions (a pipeline's cut
    among them) are applied after checking they were made for this mesh, these hints, this model and these input
    shapes, and priced under this call's `profile` (a new calibration prices the same plan anew).
    `plan_other_shapes=True` applies a `plan` made at other sizes (another batch, sequence length or width):
    the model must trace to the same graph op for op (same depth, modules and dtypes), each decision must
    still divide its dims (a pipeline's cut is applied as saved), else PlanMismatchError; e.g. a plan
    made for a model at its real size on the meta device, trained on a narrow copy (see the example below).
    `zero` (1, 2, 3, or {axis name: stage}) applies ZeRO on the data-parallel axis: stage 1 shards the
    optimizer state, 2 also gradients, 3 also parameters (autoshard/passes/zero.py; train with
    autoshard.runtime.zero.ZeroOptimizer). Without it, ZeRO is chosen when only it fits `memory_budget`.
    `checkpoint` (module globs, e.g. ["layers.*"], or "auto": repeated layers while the prediction exceeds
    `memory_budget`; None: chosen by the memory budget) recomputes those regions' activations in backward (autoshard/passes/recompute.py).
    `parallel` takes ColossalAI's config, e.g. dict(tensor=dict(size=8, mode='3d')), as hints and mesh
    axis names (autoshard/frontend/tp_modes.py; `mesh` may then be None).
    `pipeline` (a dict: microbatches, schedule, virtual_stages, balance, split_points, axis) or a mesh
    axis named "pp" makes the program a pipeline over that axis (see autoshard/program/pipeline.py); an unnamed
    mesh lets the planner decide whether an axis is worth pipelining (`pipeline=False` never pipelines).
    Random ops (dropout) draw from `seed` (default: `autoshard.manual_seed`'s, 0) in `rng` mode:
    "placement" (copies of a tensor draw the same mask, shards independent ones) or "exact" (each rank
    its block of the single device's masks under `torch.manual_seed(seed)`; autoshard/runtime/rng.py).
    A model with many interchangeable repeated layers (a ModuleList of 8 or more) is traced and planned with
    three of them standing for all, then written out whole (autoshard/frontend/fold.py): the plan is the
    same, planning takes a fraction of the time; `fold_layers=False` traces every layer.
    `mixed_precision="bf16"` computes in bfloat16 from float32 master weights, whose gradients are reduced
    in float32 (FSDP2's policy; autoshard/ir/mixed_precision.py); "fp16" the same in float16, trained with a
    `LossScaler` (autoshard/runtime/loss_scale.py).
    `compile=True` compiles every rank's program (each pipeline stage's) with torch.compile's inductor,
    forward and backward, the collectives inside the graph as opaque ops making the same calls; random ops
    run as they do eagerly (same masks), so results equal the eager program's within float rounding
    (autoshard/runtime/compiled.py). It changes no plan; on the CPU it needs a C++ compiler ($CXX or g++).
    `devices` (instead of `mesh`) lets the planner choose the mesh too: it plans the model on each candidate mesh
    shape for that many devices and keeps the fastest predicted step (autoshard/search/mesh_search.py;
    `prog.plan.search["why_mesh"]` says what it compared).
    `ilp_time_limit` bounds the seconds each sharding ILP searches (default: scaled to its size,
    autoshard/solver/time_limit.py); a search it stops gives the best plan found, which the plan's summary and a warning
    say, with its optimality gap. Without it, a budget-bound search over more than `MIP_SEARCH_MAX_COLUMNS` (the
    same file) is not run (its start plan is kept, and said so); with it, every search runs.

    >>> [(r.collective, r.axis, r.path) for r in tp.plan.collectives()]  # tp: see the module docstring
    [('all_reduce', 'tp', 'layers.1')]

    The same decisions applied to the model at a quarter of the width and twice the batch:

    >>> narrow, narrow_inputs, _ = mlp(batch=16, in_dim=8, hidden=32, out_dim=8, n_layers=2)
    >>> same = parallelize(narrow, (2,), narrow_inputs, loss_fn=loss_fn, axis_names=("tp",), plan=tp.plan,
    ...                    plan_other_shapes=True)
    >>> [r.choice for r in same.plan.rows] == [r.choice for r in tp.plan.rows]
    True
    >>> torch.allclose(same.simulate(*narrow_inputs)[0], loss_fn(narrow(*narrow_inputs), *narrow_inputs))
    True
    """
    if parallel is not None:
        mesh, axis_names, hints = apply_parallel_config(model, parallel, mesh, axis_names, hints)
    mesh = _mesh_or_devices(mesh, axis_names, devices, example_inputs, plan)
    if hints is not None and not isinstance(hints, (dict, Hints)):
        hints = Hints.load(hints)  # a path; anything else gets an error saying what hints may be
    options = CompileOptions.parse(profile=profile, memory_budget=memory_budget, checkpoint=checkpoint, rng=rng,
                                   seed=seed, mixed_precision=mixed_precision, zero=zero,
                                   optimizer_state_factor=optimizer_state_factor, memory_headroom=memory_headroom,
                                   fold_layers=fold_layers, compile=compile, ilp_time_limit=ilp_time_limit)
    if plan_other_shapes and plan is None:
        raise UserInputError("plan_other_shapes=True applies a plan= made at other shapes; pass the plan")
    request = CompileRequest(model, mesh, example_inputs, hints, loss_fn, options, plan, debug, devices=devices,
                             plan_other_shapes=plan_other_shapes)
    if example_inputs is None:
        if plan is not None:
            raise UserInputError("plan= needs example_inputs (the plan is checked against the traced model); "
                                 "without them parallelize returns a module that plans on its first batch")
        planner = functools.partial(_plan_module, request, pipeline)
        return ParallelModule(model, mesh, planner, has_loss_fn=loss_fn is not None, weights=weights,
                              init_fn=init_fn, seed=seed or 0)
    if weights is not None or init_fn is not None:
        raise UserInputError("weights= and init_fn= are for the module parallelize returns without example_inputs; "
                             "with example_inputs pass them to prog.module(rank, comm, weights=..., init_fn=...)")
    return _compile(request, pipeline)


def _compile(request: CompileRequest, pipeline):
    """The Program of one request: on its mesh (`_compile_on_mesh`), or on the best of the candidate meshes for
    `request.devices`."""
    request = request.replace(example_inputs=_traceable_inputs(request.model, request.example_inputs))
    # Candidates trace the same shapes and meet the same ILPs; each warning is told once per call.
    with fewer_collections(), reuse_exports(), reuse_normalized(), warning_scope(), \
            solver_session(request.options.ilp_time_limit):
        on_mesh = functools.partial(_compile_on_mesh, pipeline=pipeline)
        prog = on_mesh(request) if request.devices is None else \
            plan_on_devices(request, request.devices, on_mesh, pipeline)
        if prog.state.ilp_stopped:
            warn_once(f"autoshard: {describe_stopped(prog.state.ilp_stopped)}. A process that plans on its own may "
                      "get another plan: plan once and give the plan to every rank (plan=; verify and parallelize "
                      "without example_inputs do)", stacklevel=4)
        return prog


def _compile_on_mesh(request: CompileRequest, pipeline):
    """The Program of `request` on its mesh: a pipeline when asked for or when the search prefers one, else the flat
    program the ILP and the hand plans give."""
    prog = choose_pipeline(request, pipeline, unnamed=not request.mesh.named)
    return prog if prog is not None else plan_with_hand_plans(request)


def _mesh_or_devices(mesh, axis_names, devices, example_inputs, plan) -> Mesh:
    """The mesh to plan on: `mesh`, or with `devices` a stand-in the mesh search replaces by each candidate."""
    if devices is None:
        if mesh is None:
            raise UserInputError("parallelize needs mesh= (e.g. mesh=(2, 2, 2)) or devices= (e.g. devices=8: the "
                                 "planner then chooses the mesh shape)")
        return Mesh.of(mesh, axis_names)
    if mesh is not None or axis_names is not None:
        raise UserInputError(f"give mesh= or devices=, not both (devices={devices!r} lets the planner choose the mesh "
                             "shape and each axis's role; a mesh fixes them)")
    if example_inputs is None or plan is not None:
        raise UserInputError("devices= plans with example inputs and no saved plan (parallelize(model, devices=8, "
                             "example_inputs=...)); to train under torchrun, plan once with devices=, save the plan "
                             "(prog.plan.save) and pass its mesh and plan= to parallelize")
    check_devices(devices)
    return Mesh((devices,))


def _plan_module(request: CompileRequest, pipeline, model, batch, plan=None, other_shapes: bool = False):
    """ParallelModule's planner: `request` for `model` (its meta twin) at `batch`'s shapes, solving, or applying
    `plan` (made at other shapes when `other_shapes`)."""
    if plan is not None:  # the plan carries the hints (and ZeRO) it was made with
        request = request.replace(hints=None, options=request.options.replace(zero=None))
    return _compile(request.replace(model=model, example_inputs=tuple(batch), plan=plan,
                                    plan_other_shapes=other_shapes), pipeline)


def _traceable_inputs(model, example_inputs):
    """Real example inputs of a model on the meta device are traced as meta tensors (only their shapes
    and dtypes matter), so that a meta model plans with the inputs it will be run with.

    >>> with torch.device("meta"):
    ...     net = torch.nn.Linear(2, 2)
    >>> _traceable_inputs(net, (torch.ones(3, 2),))[0].device
    device(type='meta')
    """
    params = list(model.parameters()) if isinstance(model, torch.nn.Module) else []
    if not params or any(p.device.type != "meta" for p in params) or not isinstance(example_inputs, (tuple, list)):
        return example_inputs
    return type(example_inputs)(x.to("meta") if isinstance(x, torch.Tensor) else x for x in example_inputs)
