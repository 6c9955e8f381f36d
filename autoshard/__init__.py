"""autoshard: an automatic parallelization compiler for unmodified PyTorch models.

>>> import autoshard
>>> autoshard.Mesh((2, 2), ("dp", "tp"))
Mesh(dp=2, tp=2)
"""
from . import strategies  # noqa: F401  (registers the sharding rules)
from .constrain import constrain
from .errors import AutoshardError, ExportError, HintError, PlanError, UserInputError
from .mesh import Mesh
from .placement import P, R, S, Partial, Replicate, Shard, Spec
from .plan import Plan
from .program import Program, parallelize
from .checkpoint import load_checkpoint, save_checkpoint
from .viz import plot_timeline
from .stages import stage

__all__ = ["parallelize", "Program", "Plan", "Mesh", "Spec", "S", "R", "P", "Shard", "Replicate", "Partial",
           "AutoshardError", "ExportError", "HintError", "PlanError", "UserInputError", "constrain",
           "save_checkpoint", "load_checkpoint", "plot_timeline", "stage"]
__version__ = "0.1.0"
