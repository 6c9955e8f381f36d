"""RankProgram: what a rank's runtime needs of a compiled program, as a plain value — the mesh, the specs of
inputs, outputs and stored parameters, the gradient reductions, the ZeRO config and, for a pipeline, its
axis, the pp rank of each stage and the tied parameters. Rank modules, ZeroOptimizer, gradient clipping
and loss scaling read only this, and so do saving and loading weights and checkpoints (autoshard/weights/); the
compiler's Program builds it (`prog.rank_program`).

>>> import autoshard
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
...                              hints={"input:0": {"dp": "S(0)"}})
>>> rp = prog.rank_program
>>> rp.input_specs, rp.grad_reduce["layers.0.weight"], rp.zero
([[S(0)]], ('dp',), None)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from autoshard.ir.errors import UserInputError
from autoshard.ir.mesh import Mesh


@dataclass(frozen=True)
class RankProgram:
    """The per-rank view of one plan (see the module docstring). `inputs` holds (shape, dtype) of each
    global input as planned; `attr_names` maps each parameter and buffer FQN to its attribute on the
    rank's GraphModule, `params` says which of them are parameters.

    >>> rp.param_spec("layers.0.weight"), sorted(rp.params)[:1]
    ([R], ['layers.0.bias'])
    """

    mesh: Mesh
    input_specs: list
    inputs: tuple
    output_spec: object  # the outputs' pytree spec (None: a flat list)
    output_specs: list  # specs of (loss, *flat outputs)
    param_specs: dict
    attr_names: dict
    params: frozenset
    grad_reduce: dict
    zero: object = None  # ZeroConfig (autoshard/passes/zero.py) or None
    pp_axis: str | None = None  # a pipeline's mesh axis
    stage_ranks: tuple = ()  # the pp rank of each stage
    tied_params: dict = field(default_factory=dict)  # FQN -> stages holding a copy
    microbatches: int = 1  # a pipeline's micro-batches per step: its inputs are the full batch
    num_stages: int = 1
    schedule: str = ""  # a pipeline's torch.distributed.pipelining schedule class name
    boundary_values: dict = field(default_factory=dict)  # value between stages -> (local shape, dtype, needs grad)
    param_meta: dict = field(default_factory=dict)  # parameter FQN -> (global shape, dtype)
    buffer_meta: dict = field(default_factory=dict)  # buffer FQN -> (global shape, dtype)
    non_persistent: frozenset = frozenset()  # buffers a state dict leaves out
    aliases: dict = field(default_factory=dict)  # a tied parameter's first FQN -> its other names
    plan_fingerprint: str = ""  # the plan's fingerprint, which checkpoints record
    first_stage: dict = field(default_factory=dict)  # a pipeline's FQN -> the first stage using it (its owner)

    def param_spec(self, fqn: str):
        """The spec parameter or buffer `fqn` is stored with (KeyError for a name the model lacks).

        >>> rp.param_spec("layers.1.weight")
        [R]
        """
        return self.param_specs[fqn]

    def check_inputs(self, inputs) -> None:
        """Global inputs must match the example inputs the program was traced with (count, shape, dtype);
        a pipeline's are the full batch: dim 0 is the micro-batch's times the micro-batches.

        >>> rp.check_inputs((torch.randn(4, 32),))
        Traceback (most recent call last):
        ...
        autoshard.ir.errors.UserInputError: input 0 is torch.float32 (4, 32) but the program was planned for ...
        """
        m = self.microbatches
        if m > 1 and len(inputs) == len(self.inputs) and all(isinstance(x, torch.Tensor) and x.dim() for x in inputs):
            if any(x.shape[0] % m for x in inputs):
                raise UserInputError(f"the batch ({[x.shape[0] for x in inputs]}) must split into {m} micro-batches")
            inputs = [x[: x.shape[0] // m] for x in inputs]
        if len(inputs) != len(self.inputs):
            raise UserInputError(f"the program takes {len(self.inputs)} inputs (like the example inputs), got "
                                 f"{len(inputs)}")
        for i, (x, (shape, dtype)) in enumerate(zip(inputs, self.inputs)):
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape or x.dtype != dtype:
                got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
                raise UserInputError(f"input {i} is {got} but the program was planned for {dtype} "
                                     f"{shape}; re-plan with example inputs of the new shape")

    def split_microbatches(self, inputs) -> list[tuple]:
        """The full batch as `microbatches` global micro-batches (dim 0 chunks, in order).

        >>> [mb[0].shape for mb in rp.split_microbatches((torch.randn(8, 32),))]
        [torch.Size([8, 32])]
        """
        m = self.microbatches
        return [tuple(x.chunk(m, 0)[i] for x in inputs) for i in range(m)]
