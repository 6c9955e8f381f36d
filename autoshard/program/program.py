"""Program: the compiled result — plan, per-rank modules, history, simulator (`parallelize` returns it).

>>> import autoshard
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> prog = autoshard.parallelize(model, mesh=(2,), axis_names=("dp",), example_inputs=inputs,
...                              loss_fn=loss_fn, hints={"input:0": {"dp": "S(0)"}})
>>> prog.plan.grad_reduce["layers.0.weight"]
('dp',)
>>> loss, out = prog.simulate(*inputs)  # both ranks in this process: equals the single device
>>> torch.allclose(loss, loss_fn(model(*inputs), *inputs))
True

Megatron's tensor parallelism of the same MLP (every parameter's placement given), used by some
examples below:

>>> tp = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("tp",),
...                            hints={"layers.0.weight": {"tp": "S(0)"}, "layers.0.bias": {"tp": "S(0)"},
...                                   "layers.1.weight": {"tp": "S(1)"}, "layers.1.bias": {"tp": "R"}})
"""
from __future__ import annotations

import functools

import torch

from autoshard.ir import meta
from autoshard.ir.errors import UserInputError
from autoshard.ir.placement import (
    R,
    Shard,
    Spec,
    local_shape,
    shard_slices,
    unshard_tensors,
)
from autoshard.lowering.rank_module import attr_names, build_rank_module
from autoshard.passes.manager import CompileState, History
from autoshard.passes.random_ops import describe_random_ops
from autoshard.plan.plan import Plan
from autoshard.report.timeline import planned_timeline
from autoshard.runtime.compiled import compile_rank_graph
from autoshard.runtime.rank_module import RankModule
from autoshard.runtime.rank_program import RankProgram
from autoshard.runtime.rng import RankRng, drawn_ops
from autoshard.runtime.simulator import run_ranks
from autoshard.weights import DcpWeights, open_weights, rank_weights
from autoshard.weights.training_checkpoint import load_checkpoint


class Program:
    """Plan + per-rank modules + runtime helpers for one model on one mesh (what `parallelize` returns).

    >>> prog
    Program(Mesh(dp=2), fingerprint=...)
    Plan on Mesh(dp=2): ...
    """

    def __init__(self, state: CompileState, history: History):
        self.state = state
        self.mesh = state.mesh
        self.traced = state.traced
        self.history = history
        self.grad_reduce = state.grad_reduce
        self.zero = state.zero  # ZeroConfig: the runtime shards optimizer state (and more)
        self.attr_names = attr_names(state)
        self._graphs: dict = {}
        self.output_spec = self.traced.output_spec
        inputs = [n for n in state.gm.graph.nodes if n.op == "placeholder" and n.meta.get(meta.KIND) == "input"]
        self.input_specs = [n.meta[meta.SPEC] for n in inputs]
        self._output_specs = [getattr(a, "meta", {}).get(meta.SPEC) for a in
                              next(n for n in state.gm.graph.nodes if n.op == "output").args[0]]

    @functools.cached_property
    def plan(self) -> Plan:
        """The Plan: every tensor's placement, every collective, predicted costs (see autoshard.plan.plan).

        >>> prog.plan.mesh
        Mesh(dp=2)
        """
        return Plan.from_state(self.state)

    def __repr__(self) -> str:
        return f"Program({self.mesh!r}, fingerprint={self.plan.fingerprint})\n{self.plan.summary()}"

    @functools.cached_property
    def random_ops(self) -> list:
        """The random ops (dropout, ...) in the single device's order of draws, with their placements.

        >>> prog.random_ops  # the MLP draws nothing
        []
        """
        return describe_random_ops(self.state)

    microbatch_count = 1  # micro-batches per step (a pipeline's draw its masks over the whole batch)

    def rank_rng(self, coord, needed=None) -> RankRng:
        """The random stream of the rank at (intra-op) mesh `coord`, drawing the ops numbered in `needed`
        (default: all); the mode and seed are parallelize's `rng=` and `seed=` (autoshard/runtime/rng.py).

        >>> prog.rank_rng((1,)).mode
        'placement'
        """
        options = self.state.options
        return RankRng(self.random_ops, options.rng, options.seed, coord,
                       self.state.mesh.shape, microbatches=self.microbatch_count, needed=needed)

    def draw(self, collapse=(), color_by: str = "auto"):
        """The sharded graph as a picture, like `prog.plan.draw(...)`: SVG in notebooks, text in terminals.

        >>> import warnings
        >>> with warnings.catch_warnings():  # without graphviz's `dot`: the built-in layout, with a warning
        ...     warnings.simplefilter("ignore")
        ...     picture = tp.draw(collapse=["layers.1"])
        >>> "<svg" in picture.svg
        True
        """
        return self.plan.draw(collapse, color_by)

    def planned_timeline(self):
        """The step this plan predicts (print it, or `.plot()` it in a notebook): a flat program's with the
        runtime's overlap, the compute and each mesh axis's link, the gradient sync under the backward of
        earlier layers; a pipelined program's schedule run on the predicted stage times.

        >>> timeline = prog.planned_timeline()
        >>> [timeline.row_name(row) for row in timeline.ranks], timeline.span() > 0
        (['compute', 'link dp'], True)
        """
        return planned_timeline(self)

    def graph(self, rank: int) -> torch.fx.GraphModule:
        """Rank `rank`'s GraphModule: local parameter shards, local shapes, visible collectives (cached).

        >>> gm = prog.graph(1)
        >>> gm.layers_0_weight.shape, "inputs_0" in gm.code
        (torch.Size([128, 32]), True)
        """
        if not isinstance(rank, int) or not 0 <= rank < self.mesh.size:
            raise UserInputError(f"rank {rank!r} is outside the mesh {self.mesh!r} (ranks 0..{self.mesh.size - 1})")
        if rank not in self._graphs:
            self._graphs[rank] = build_rank_module(self.state, rank)
        return self._graphs[rank]

    def module(self, rank: int, comm, weights=None, init_fn=None, seed: int = 0, strict: bool = True) -> RankModule:
        """A fresh trainable module for `rank` talking through `comm` (its own parameter copies); under
        torchrun `comm` is `autoshard.runtime.launch.communicator_for(prog.mesh)`.

        `weights` fills this rank's shards without the full model ever being on the rank: a
        `.safetensors` file or a directory (one file, or the transformers layout with
        `model.safetensors.index.json`; only this rank's slices are read), a `save_checkpoint`
        directory (DCP, real ranks), a state dict, or "init" (the model's initialisation replayed
        module by module under `seed`: `init_fn(module)` when given, else inside a transformers model
        (anywhere in a wrapper) that model's `_init_weights`, else each module's `reset_parameters`). A
        checkpoint written by a model the planned one wraps (`save_pretrained` of `self.inner`) is read
        under the wrapper's prefix. Without it the shards are cut from the model's own tensors; a model on
        the meta device needs `weights`. See autoshard/weights/.

        >>> from autoshard.runtime.simulator import run_ranks   # one thread per rank, module(r, comm) each
        >>> losses = run_ranks(prog, lambda module: module(*module.local_inputs(*inputs))[0])
        >>> torch.allclose(losses[0] + losses[1], loss)          # batch-sharded: each rank holds a partial sum
        True
        """
        source = open_weights(weights) if weights is not None else None
        module = self.module_of_blocks(rank, comm, self.rank_tensors(rank, source, init_fn=init_fn, seed=seed,
                                                                     strict=strict))
        if isinstance(source, DcpWeights):  # DCP reads each rank's pieces into the module's shards in place
            load_checkpoint(source.path, module)
        return module

    def module_of_blocks(self, rank: int, comm, blocks) -> RankModule:
        """Like `module`, its parameters and buffers given as this rank's blocks ({FQN: block}, e.g. another
        module's of the same plan at other input shapes; None: cut from the model's own tensors).

        >>> from autoshard.runtime.simulator import run_ranks
        >>> run_ranks(prog, lambda m: prog.module_of_blocks(m.rank, m.comm, None).gm.layers_0_weight.shape)[0]
        torch.Size([128, 32])
        """
        gm = self.compiled(build_rank_module(self.state, rank, local=blocks), comm)
        return RankModule(gm, comm, self.rank_program, self.rank_rng(comm.coord, needed=drawn_ops(gm)), self)

    def compiled(self, gm: torch.fx.GraphModule, comm) -> torch.fx.GraphModule:
        """`gm`, run with the communicator `comm`, compiled in place by torch.compile when planned with
        `compile=True`, else as it is (autoshard/runtime/compiled.py).

        >>> prog.compiled(prog.graph(0), None) is prog.graph(0)  # planned without compile=True: unchanged
        True
        """
        options = self.state.options
        return compile_rank_graph(gm, comm, options.mixed_precision is not None) if options.compile else gm

    def rank_tensors(self, rank: int, weights, keep=None, init_fn=None, seed: int = 0, strict: bool = True):
        """{FQN: block} of rank `rank` (intra-op rank, for a pipeline) from `weights` (see `module`; for a DCP
        directory uninitialised blocks, which `module` fills), or None (cut from the model's own tensors).

        >>> prog.rank_tensors(0, None) is None   # a model with real weights: cut from them
        True
        """
        if weights is None:
            meta_tensors = [f for f, t in {**self.traced.params, **self.traced.buffers}.items()
                            if t.device.type == "meta" and (keep is None or f in keep)]
            if meta_tensors:
                raise UserInputError(f"the model was planned on the meta device ({meta_tensors[0]!r} has no values): "
                                     "pass weights= to prog.module (a safetensors file or directory, a "
                                     "save_checkpoint directory, a state dict, or 'init')")
            return None
        source = open_weights(weights)
        if isinstance(source, DcpWeights):
            if keep is not None:
                raise UserInputError("a save_checkpoint directory cannot be loaded into a pipeline rank yet: load it "
                                     "into a flat plan and write it with autoshard.save_weights, then pass that")
            return {fqn: torch.empty(local_shape(t.shape, self.param_spec(fqn), self.state.mesh.shape), dtype=t.dtype)
                    for fqn, t in {**self.traced.params, **self.traced.buffers}.items()}
        return rank_weights(self.rank_program, rank, source, self.state.model, self.traced.buffers, keep=keep,
                            init_fn=init_fn, seed=seed, strict=strict)

    def assemble(self, blocks_by_rank: dict, spec) -> torch.Tensor:
        """The global tensor from every rank's block (sums partial axes).

        >>> prog.assemble({0: torch.zeros(4, 3), 1: torch.ones(4, 3)}, prog.input_specs[0]).shape
        torch.Size([8, 3])
        """
        return unshard_tensors({self.mesh.coord(r): b for r, b in blocks_by_rank.items()}, spec, self.mesh.shape)

    @property
    def output_specs(self):
        """Specs of (loss, *flat outputs) as the rank modules return them.

        >>> prog.output_specs
        [[P], [S(0)]]
        """
        return self._output_specs

    def canonical_param(self, fqn: str) -> str:
        """The FQN a tied parameter is held under (its first name in the traced graph).

        >>> prog.canonical_param("layers.1.weight")  # the MLP ties nothing: every name is its own
        'layers.1.weight'
        """
        for first, others in self.traced.aliases.items():
            if fqn in others:
                return first
        return fqn

    def param_spec(self, fqn: str):
        """The spec parameter `fqn` is stored with (KeyError for a name the model does not have).

        >>> tp.param_spec("layers.0.weight"), tp.param_spec("layers.1.weight")
        ([S(0)], [S(1)])
        """
        return self.rank_program.param_spec(fqn)

    def local_batch(self, rank: int, global_batch: int) -> slice:
        """The rows of a global batch of `global_batch` samples that `rank` loads (dim 0 of every input),
        so that each data-parallel coordinate reads only its own slice of each batch; feed them to
        `module.local_inputs_of_rows`. Ranks that differ only on axes the batch is not split on load the
        same rows.

        >>> [prog.local_batch(r, 64) for r in range(2)]  # the batch is split in two on dp
        [slice(0, 32, None), slice(32, 64, None)]
        """
        specs = {tuple(int(isinstance(p, Shard) and p.dim == 0) for p in spec) for spec in self.input_specs
                 if len(spec)}
        if len(specs) > 1:
            raise UserInputError(f"the inputs split their batch (dim 0) on different mesh axes ({self.input_specs}); "
                                 "load whole batches and call module.local_inputs(*batch)")
        spec = self.input_specs[0]
        rows = shard_slices((global_batch,), Spec([p if isinstance(p, Shard) and p.dim == 0 else R for p in spec]),
                            self.state.mesh.coord(self.intra_rank(rank)), self.state.mesh.shape)
        return rows[0]

    def intra_rank(self, rank: int) -> int:
        """The rank on the mesh that shards tensors (a pipeline's mesh without its pp axis).

        >>> prog.intra_rank(1)
        1
        """
        return rank

    def check_inputs(self, inputs) -> None:
        """Global inputs must match the example inputs the program was traced with (count, shape, dtype).

        >>> prog.check_inputs((torch.randn(4, 32),))
        Traceback (most recent call last):
        ...
        autoshard.ir.errors.UserInputError: input 0 is torch.float32 (4, 32) but the program was planned for ...
        """
        self.rank_program.check_inputs(inputs)

    @functools.cached_property
    def rank_program(self) -> RankProgram:
        """What every rank's runtime needs of this program, as a plain value (autoshard/runtime/rank_program.py).

        >>> prog.rank_program.output_specs == prog.output_specs
        True
        """
        return RankProgram(**self._rank_program_fields())

    @functools.cached_property
    def param_specs(self) -> dict:
        """{FQN: spec} of every parameter and buffer: the rank program's `param_specs`, without building it (the
        pipeline and mesh searches read them of candidates they may not keep).

        >>> prog.param_specs == prog.rank_program.param_specs
        True
        """
        return {n.meta[meta.PATH]: n.meta[meta.SPEC] for n in self.state.gm.graph.nodes
                if n.op == "placeholder" and n.meta.get(meta.KIND) in ("param", "buffer")}

    def _rank_program_fields(self) -> dict:
        placeholders = [n for n in self.state.gm.graph.nodes if n.op == "placeholder"]
        inputs = [n.meta["val"] for n in placeholders if n.meta.get(meta.KIND) == "input"]
        return {"mesh": self.state.mesh, "input_specs": self.input_specs,
                "inputs": tuple((tuple(v.shape), v.dtype) for v in inputs), "output_spec": self.output_spec,
                "output_specs": self.output_specs,
                "param_specs": self.param_specs,
                "attr_names": self.attr_names, "params": frozenset(self.traced.params),
                "grad_reduce": self.grad_reduce, "zero": self.zero,
                "param_meta": {fqn: (tuple(t.shape), t.dtype) for fqn, t in self.traced.params.items()},
                "buffer_meta": {fqn: (tuple(t.shape), t.dtype) for fqn, t in self.traced.buffers.items()},
                "non_persistent": self.traced.non_persistent, "aliases": dict(self.traced.aliases),
                "plan_fingerprint": self.plan.fingerprint}

    def simulate(self, *inputs, timeout_s: float = 60.0):
        """Run all ranks in this process (threads); return the global (loss, outputs) like the model.

        >>> loss, out = tp.simulate(*inputs)
        >>> torch.allclose(out, model(*inputs), atol=1e-6)
        True
        """
        import torch.utils._pytree as pytree

        self.check_inputs(inputs)

        def step(module):
            loss, outputs = module(*module.local_inputs(*inputs))
            return [loss.detach(), *[o.detach() for o in pytree.tree_leaves(outputs)]]

        results = run_ranks(self, step, timeout_s=timeout_s)
        flat = [self.assemble({r: results[r][i] for r in results}, spec)
                for i, spec in enumerate(self._output_specs)]
        outputs = pytree.tree_unflatten(flat[1:], self.output_spec) if self.output_spec is not None else flat[1:]
        return flat[0], outputs
