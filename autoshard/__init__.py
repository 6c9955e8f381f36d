"""autoshard: an automatic parallelization compiler for unmodified PyTorch models.

>>> import autoshard
>>> autoshard.Mesh((2, 2), ("dp", "tp"))
Mesh(dp=2, tp=2)
"""
from autoshard import strategies  # noqa: F401  (registers the sharding rules)
from autoshard.api import parallelize
from autoshard.frontend.constrain import constrain
from autoshard.frontend.stages import stage
from autoshard.ir.errors import (
           AutoshardError,
           ExportError,
           HintError,
           PlanError,
           UserInputError,
)
from autoshard.ir.mesh import Mesh
from autoshard.ir.placement import P, Partial, R, Replicate, S, Shard, Spec
from autoshard.plan.plan import Plan
from autoshard.program.parallel_module import ParallelModule
from autoshard.program.pipeline_program import PipelineProgram
from autoshard.program.program import Program
from autoshard.report.viz import plot_timeline
from autoshard.runtime.launch import communicator_for, init_distributed
from autoshard.runtime.loss_scale import LossScaler
from autoshard.runtime.rng import manual_seed
from autoshard.runtime.zero import ZeroOptimizer
from autoshard.weights.save import save_weights
from autoshard.weights.sources import load_weights
from autoshard.weights.training_checkpoint import load_checkpoint, save_checkpoint

__all__ = ["AutoshardError", "ExportError", "HintError", "LossScaler", "Mesh", "P", "ParallelModule", "Partial",
           "PipelineProgram", "Plan", "PlanError", "Program", "R", "Replicate", "S", "Shard", "Spec", "UserInputError",
           "ZeroOptimizer", "communicator_for", "constrain", "init_distributed", "load_checkpoint", "load_weights",
           "manual_seed", "parallelize", "plot_timeline", "save_checkpoint", "save_weights", "stage"]
__version__ = "0.1.0"
