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
from autoshard.program.program import Program
from autoshard.report.viz import plot_timeline
from autoshard.runtime.rng import manual_seed
from autoshard.weights.save import save_weights
from autoshard.weights.sources import load_weights
from autoshard.weights.training_checkpoint import load_checkpoint, save_checkpoint

__all__ = ["AutoshardError", "ExportError", "HintError", "Mesh", "P", "Partial", "Plan", "PlanError", "Program", "R",
           "Replicate", "S", "Shard", "Spec", "UserInputError", "constrain", "load_checkpoint", "load_weights",
           "manual_seed", "parallelize", "plot_timeline", "save_checkpoint", "save_weights", "stage"]
__version__ = "0.1.0"
