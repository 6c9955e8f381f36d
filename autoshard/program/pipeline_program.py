"""PipelineProgram: a pipelined Program — per-rank stage GraphModules, plan with stage table, simulator.

Rank r of the full mesh has a pp coordinate (which stages it runs) and an intra-op rank on the mesh
without the pp axis (which shards it holds); its stage modules are that intra-op rank's GraphModule
split by `autoshard.stage`. Everything a verify run needs (`assemble`, `param_spec`, `output_specs`)
has the same meaning as on Program, on global tensors of the full batch.

The examples pipeline a three-layer MLP over pp, data-parallel on dp:

>>> import torch
>>> import autoshard
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=3)
>>> prog = autoshard.parallelize(model, (2, 2), inputs, loss_fn=loss_fn, axis_names=("pp", "dp"),
...                              hints={"input:0": {"dp": "S(0)"}}, pipeline={"microbatches": 2})
"""
from __future__ import annotations

import functools

import torch
import torch.utils._pytree as pytree

from autoshard.cost.axis_cost import needs_grad
from autoshard.cost.pipeline_schedule import rank_memory
from autoshard.ir import meta
from autoshard.ir.errors import UserInputError
from autoshard.ir.placement import local_shape, unshard_tensors
from autoshard.lowering.rank_module import build_rank_module
from autoshard.lowering.stages import split_stages
from autoshard.program.program import Program
from autoshard.runtime.communicator import DistCommunicator
from autoshard.runtime.pipeline import (
    PipelineRankModule,
    SequentialStages,
    simulated_rank_step,
)
from autoshard.runtime.rng import RankRng, drawn_ops
from autoshard.runtime.simulator import run_ranks


class StageGraphs(list):
    """One rank's stage GraphModules (a list of StageGraph), printed one after the other.

    >>> print(prog.graph(3))  # doctest: +ELLIPSIS
    # stage 1: (linear_default_2) -> (div_tensor, add_tensor_2)
    ...
    """

    def __repr__(self) -> str:
        return "\n\n".join(repr(s) for s in self)


class PipelineProgram(Program):
    """The pipelined program on `mesh` (full mesh, pp axis included): what `parallelize` returns for a
    mesh with a pp axis.

    >>> prog  # doctest: +ELLIPSIS
    PipelineProgram(Mesh(pp=2, dp=2), 2 stages over 'pp', 1F1B, 2 micro-batches, fingerprint=...)
    Plan on Mesh(dp=2): ...
    """

    def __init__(self, state, history, mesh, config):
        super().__init__(state, history)
        self.inner_mesh = state.mesh
        self.mesh = mesh
        self.config = config
        self.pp_axis = mesh.axis(config.axis)
        self.tied_params = self._tied_params()
        self.search_records: dict = {}  # the pipeline search's records of this plan (`record`)
        if state.options.rng == "exact":
            self._check_batch_first_draws()

    def _check_batch_first_draws(self) -> None:
        """rng="exact" draws a batch-dependent mask over the whole batch and gives micro-batch m block m of
        its dim 0, so dim 0 must be batch-major: a multiple of the micro-batch size (batch, or batch x
        tokens flattened). A sequence-first activation would get the wrong block: refuse it by name."""
        examples = [n.meta["val"] for n in self.state.gm.graph.nodes
                    if n.op == "placeholder" and n.meta.get(meta.KIND) == "input" and n.meta["val"].dim()]
        if not examples or self.config.microbatches == 1:
            return
        rows = examples[0].shape[0]
        for op in self.random_ops:
            if op.batched and (not op.shape or op.shape[0] % rows):
                raise UserInputError(
                    f"rng='exact' in a pipeline cannot honour {op.target} at {op.path}: its draw {list(op.shape)} "
                    f"depends on the batch but its dim 0 is not a multiple of the micro-batch's {rows} rows (a "
                    "sequence-first activation?), so micro-batch m's block of the whole batch's mask is not block "
                    "m of dim 0; use rng='placement', or keep the batch first")

    @property
    def microbatch_count(self) -> int:
        """Micro-batches per step: rng="exact" draws each mask over the whole batch, block m per micro-batch.

        >>> prog.microbatch_count
        2
        """
        return self.config.microbatches

    @functools.cached_property
    def _planned(self):
        return self.planned_timeline()

    @property
    def predicted_step_s(self) -> float:
        """The predicted step (the schedule run on the predicted stage times), without building the plan: the
        pipeline search compares many candidates and keeps few.

        >>> prog.predicted_step_s == prog.plan.pipeline["predicted_step_s"]
        True
        """
        return self._planned.span()

    @property
    def predicted_bubble(self) -> float:
        """The share of the predicted step a pp rank idles (the plan's `pipeline["predicted_bubble"]`).

        >>> 0 < prog.predicted_bubble < 1
        True
        """
        return self._planned.bubble_fraction()

    @property
    def predicted_work_s(self) -> float:
        """The predicted step without its bubble, which no schedule of this micro-batch program can beat
        (autoshard/search/microbatch_search.py `least_step`): the busy share of the step; where ranks share their
        host's cores, the least step the timeline found (ranks in the bubble leave their cores to the busy ones).

        >>> prog.predicted_work_s < prog.predicted_step_s
        True
        """
        least = self._planned.least_s
        return least if least is not None else self.predicted_step_s * (1 - self.predicted_bubble)

    def record(self, key: str, value) -> None:
        """Keep the pipeline search's record `key` (why this micro-batch count, schedule, ...) in the plan's
        `pipeline` record, without building the plan for a candidate the search may drop.

        >>> prog.record("schedule_search", [])
        >>> prog.search_records, prog.plan.pipeline["schedule_search"]
        ({'schedule_search': []}, [])
        """
        self.search_records[key] = value
        if "plan" in self.__dict__:  # built already (a cached property)
            self.plan.pipeline[key] = value

    @functools.cached_property
    def plan(self):
        """The intra-op plan of one micro-batch, with each row's stage and the `pipeline` record (stage
        table, schedule, predicted step and bubble).

        >>> sorted({row.stage for row in prog.plan.rows}), prog.plan.pipeline["stage_ranks"]
        ([0, 1], [0, 1])
        """
        plan = super().plan
        stages = self.state.pipeline_stages
        plan.pipeline = {**self.config.to_json(), "stage_table": stages,
                         "predicted_step_s": self.predicted_step_s, "predicted_bubble": self.predicted_bubble,
                         "tied_params": {k: list(v) for k, v in sorted(self.tied_params.items())},
                         "stage_ranks": [self.config.stage_rank(s) for s in range(self.config.num_stages)],
                         "memory_bytes_per_pp_rank": [sum(parts.values()) for parts in rank_memory(self.state,
                                                                                                   self.config)],
                         **self.search_records}
        for row, node in zip(plan.rows, (n for n in self.state.gm.graph.nodes if meta.SPEC in n.meta)):
            row.stage = node.meta.get(meta.STAGE)
        return plan

    def __repr__(self) -> str:
        c = self.config
        return (f"PipelineProgram({self.mesh!r}, {c.num_stages} stages over {c.axis!r}, {c.schedule}, "
                f"{c.microbatches} micro-batches, fingerprint={self.plan.fingerprint})\n{self.plan.summary()}")

    def _tied_params(self) -> dict:
        """Parameter FQN -> the stages using it, for parameters used by more than one stage."""
        out = {}
        for node in self.state.gm.graph.nodes:
            if node.op == "placeholder" and node.meta.get(meta.KIND) == "param":
                stages = sorted({u.meta[meta.STAGE] for u in node.users if meta.STAGE in u.meta})
                if len(stages) > 1:
                    out[node.meta[meta.PATH]] = tuple(stages)
        return out

    # ---------------------------------------------------------------------------------------- ranks
    def inner_rank(self, rank: int) -> int:
        """Rank `rank`'s rank on the mesh without the pp axis (which shards it holds).

        >>> [prog.inner_rank(r) for r in range(4)]
        [0, 1, 0, 1]
        """
        coord = list(self.mesh.coord(rank))
        del coord[self.pp_axis]
        return self.inner_mesh.rank(tuple(coord))

    def intra_rank(self, rank: int) -> int:
        """A pipeline rank shards tensors as its rank on the mesh without pp (`inner_rank`).

        >>> prog.intra_rank(3)
        1
        """
        return self.inner_rank(rank)

    def local_batch(self, rank: int, global_batch: int) -> list[slice]:
        """The rows of a global batch of `global_batch` samples that `rank` loads: one slice per micro-batch
        (micro-batch m is the m-th chunk of dim 0, split on the batch axes like a whole batch of an intra-op
        program). Load `torch.cat([x[s] for s in rows])` and call `module.train_step(*rows, local_rows=True)`.

        >>> prog.local_batch(0, 16), prog.local_batch(1, 16)  # rank 1 is dp coordinate 1
        ([slice(0, 4, None), slice(8, 12, None)], [slice(4, 8, None), slice(12, 16, None)])
        """
        m = self.config.microbatches
        if global_batch % m:
            raise UserInputError(f"local_batch: a global batch of {global_batch} does not split into the plan's "
                                 f"{m} micro-batches; give a multiple of {m}")
        size = global_batch // m
        block = super().local_batch(rank, size)
        return [slice(i * size + block.start, i * size + block.stop) for i in range(m)]

    def pp_coord(self, rank: int) -> int:
        """Rank `rank`'s coordinate on the pp axis.

        >>> [prog.pp_coord(r) for r in range(4)]
        [0, 0, 1, 1]
        """
        return self.mesh.coord(rank)[self.pp_axis]

    def stages_of(self, rank: int) -> list[int]:
        """The stages rank `rank` runs.

        >>> prog.stages_of(0), prog.stages_of(3)
        ([0], [1])
        """
        return self.config.stages_of(self.pp_coord(rank))

    def graph(self, rank: int) -> StageGraphs:
        """Rank `rank`'s stage GraphModules (local shards, local shapes, visible collectives).

        >>> [(s.index, s.inputs) for s in prog.graph(0)]
        [(0, ['inputs_0'])]
        """
        if not isinstance(rank, int) or not 0 <= rank < self.mesh.size:
            raise UserInputError(f"rank {rank!r} is outside the mesh {self.mesh!r} (ranks 0..{self.mesh.size - 1})")
        stages = split_stages(super().graph(self.inner_rank(rank)), self.config.num_stages)
        return StageGraphs(stages[s] for s in self.stages_of(rank))

    def stage_tensors(self, stages) -> set:
        """FQNs of the parameters and buffers the given stages use (what a rank running them holds).

        >>> sorted(prog.stage_tensors({1}))  # the last stage adds the last bias (the cut falls before it)
        ['layers.2.bias']
        """
        return {n.meta[meta.PATH] for n in self.state.gm.graph.nodes if n.op == "placeholder"
                and n.meta.get(meta.KIND) in ("param", "buffer") and any(u.meta.get(meta.STAGE) in stages for u in n.users)}

    def all_stage_graphs(self, inner_rank: int, stages=None, local=None) -> list:
        """Every stage of one intra-op rank, sharing one fresh set of parameter shards; with `stages`, only
        the parameters those stages use get storage (the rest are meta tensors). `local` ({FQN: block},
        `rank_tensors`) supplies them instead of the model's own tensors.

        >>> first, second = prog.all_stage_graphs(0, stages={1})
        >>> first.gm.layers_0_weight.device, second.gm.layers_2_bias.device
        (device(type='meta'), device(type='cpu'))
        """
        keep = None if stages is None else self.stage_tensors(stages)
        return split_stages(build_rank_module(self.state, inner_rank, keep, local), self.config.num_stages)

    def module(self, rank: int, comm, weights=None, init_fn=None, seed: int = 0, strict: bool = True):
        """Rank `rank`'s trainable pipeline module (PipelineRankModule: a real rank, it runs a
        torch.distributed.pipelining schedule); `comm` is its communicator on the full mesh, e.g.
        `autoshard.runtime.launch.communicator_for(prog.mesh)` under torchrun. `weights` and the rest: as
        Program.module (only the tensors of this rank's stages are read). See autoshard/runtime/pipeline.py
        for one that runs in this process.

        >>> from autoshard.runtime.launch import communicator_for
        >>> module = prog.module(rank, communicator_for(prog.mesh))  # doctest: +SKIP
        """
        local = self.rank_tensors(self.inner_rank(rank), weights, keep=self.stage_tensors(set(self.stages_of(rank))),
                                  init_fn=init_fn, seed=seed, strict=strict)
        return self.module_of_blocks(rank, comm, local)

    def module_of_blocks(self, rank: int, comm, blocks):
        """Like `module`, the tensors of this rank's stages given as blocks ({FQN: block}; None: cut from the
        model's own tensors), as Program.module_of_blocks.

        >>> module = prog.module_of_blocks(rank, communicator_for(prog.mesh), None)  # doctest: +SKIP
        """
        inner_rank = self.inner_rank(rank)
        inner = DistCommunicator(self.inner_mesh, inner_rank, {a: comm.groups.get(a) for a in self.inner_mesh.names},
                                 comm.mesh_group, exact=comm.exact, timeout=comm.timeout)
        mine = self.stages_of(rank)
        stages = self.all_stage_graphs(inner_rank, stages=set(mine), local=blocks)  # other stages' stay meta
        mine = [stages[s] for s in mine]
        for stage in mine:
            self.compiled(stage.gm, inner)
        return PipelineRankModule(mine, inner, comm, rank, self.rank_program, self.stages_rng(inner.coord, mine), self)

    def stages_rng(self, coord, stage_graphs) -> RankRng:
        """The random stream of the stages `stage_graphs` at intra-op mesh `coord` (the ops they draw).

        >>> prog.stages_rng((0,), prog.all_stage_graphs(0)).mode
        'placement'
        """
        return self.rank_rng(coord, needed=drawn_ops(torch.nn.ModuleList([s.gm for s in stage_graphs])))

    # ---------------------------------------------------------------------------------------- data
    def _rank_program_fields(self) -> dict:
        c = self.config
        flags = needs_grad(self.state.gm.graph)
        boundary = {}
        for node in self.state.gm.graph.nodes:  # every value a stage may send or receive
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and meta.SPEC in node.meta:
                boundary[node.name] = (local_shape(val.shape, node.meta[meta.SPEC], self.inner_mesh.shape), val.dtype,
                                       bool(flags.get(node)))
        return {**super()._rank_program_fields(), "pp_axis": c.axis, "microbatches": c.microbatches,
                "stage_ranks": tuple(c.stage_rank(s) for s in range(c.num_stages)),
                "tied_params": self.tied_params, "num_stages": c.num_stages, "schedule": c.schedule,
                "boundary_values": boundary, "first_stage": self._first_stages()}

    def _first_stages(self) -> dict:
        """FQN -> the first stage using it (a pipeline's owner of a tensor several stages use)."""
        first: dict = {}
        for stage in range(self.config.num_stages):
            for fqn in self.stage_tensors({stage}):
                first.setdefault(fqn, stage)
        return first

    def microbatches(self, inputs) -> list[tuple]:
        """The full batch as `microbatches` global micro-batches (dim 0 chunks, in order).

        >>> [mb[0].shape for mb in prog.microbatches(inputs)]
        [torch.Size([4, 32]), torch.Size([4, 32])]
        """
        return self.rank_program.split_microbatches(inputs)

    def assemble(self, blocks_by_rank: dict, spec) -> torch.Tensor:
        """The global tensor from ranks' blocks (one rank per intra-op coordinate counts); blocks that are
        lists hold one block per micro-batch and assemble to their concatenation along dim 0 (0-dim values,
        like a per-micro-batch loss, to their mean).

        >>> blocks = {r: [torch.full((2, 1), r), torch.full((2, 1), 10 + r)] for r in range(4)}  # 2 micro-batches
        >>> prog.assemble(blocks, prog.input_specs[0]).flatten().tolist()  # dp shards; one pp rank per coordinate
        [0, 0, 1, 1, 10, 10, 11, 11]
        """
        by_coord = {}
        for rank, block in sorted(blocks_by_rank.items()):
            if block is not None:
                by_coord.setdefault(self.inner_mesh.coord(self.inner_rank(rank)), block)
        first = next(iter(by_coord.values()))
        if isinstance(first, list):
            parts = [unshard_tensors({c: b[i] for c, b in by_coord.items()}, spec, self.inner_mesh.shape)
                     for i in range(len(first))]
            return torch.cat(parts) if parts[0].dim() else torch.stack(parts).mean()
        return unshard_tensors(by_coord, spec, self.inner_mesh.shape)

    def simulate(self, *inputs, timeout_s: float = 60.0):
        """Run the pipeline in this process: one thread per intra-op rank runs every stage of every
        micro-batch in order (GPipe order; the schedule changes timing, not values).

        >>> loss, out = prog.simulate(*inputs)
        >>> torch.allclose(loss, loss_fn(model(*inputs), *inputs)), torch.allclose(out, model(*inputs), atol=1e-6)
        (True, True)
        """
        self.check_inputs(inputs)
        results = run_ranks(InnerRanks(self), lambda module: simulated_rank_step(module, inputs, train=False),
                            timeout_s=timeout_s)
        ranks = {self.mesh.rank(self._full_coord(r)): res for r, res in results.items()}
        flat = [self.assemble({r: res[i] for r, res in ranks.items()}, spec)
                for i, spec in enumerate(self.output_specs)]
        outputs = pytree.tree_unflatten(flat[1:], self.output_spec) if self.output_spec is not None else flat[1:]
        return flat[0], outputs

    def _full_coord(self, inner_rank: int, pp: int = 0) -> tuple:
        coord = list(self.inner_mesh.coord(inner_rank))
        coord.insert(self.pp_axis, pp)
        return tuple(coord)


class InnerRanks:
    """What the thread simulator needs: the intra-op mesh, and a module per intra-op rank that runs all
    stages (the pp ranks of one intra-op coordinate, in one thread).

    >>> from autoshard.runtime.simulator import run_ranks
    >>> InnerRanks(prog).mesh, sorted(run_ranks(InnerRanks(prog), lambda module: module.rank))
    (Mesh(dp=2), [0, 1])
    """

    def __init__(self, program: PipelineProgram):
        self.program = program
        self.mesh = program.inner_mesh

    def module(self, inner_rank, comm, weights=None, **options):
        """Intra-op rank `inner_rank`'s SequentialStages: every stage, run in order (`weights`, `init_fn`,
        `seed`, `strict`: as Program.module).

        >>> from autoshard.runtime.simulator import run_ranks
        >>> type(run_ranks(InnerRanks(prog), lambda module: module)[0]).__name__
        'SequentialStages'
        """
        program = self.program
        stages = program.all_stage_graphs(inner_rank, local=program.rank_tensors(inner_rank, weights, **options))
        for stage in stages:
            program.compiled(stage.gm, comm)
        return SequentialStages(stages, comm, program.rank_program, program.stages_rng(comm.coord, stages), program)
