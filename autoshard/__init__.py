"""autoshard: an automatic parallelization compiler for unmodified PyTorch models.

>>> import autoshard
>>> autoshard.Mesh((2, 2), ("dp", "tp"))
Mesh(dp=2, tp=2)
"""
from . import strategies  # noqa: F401  (registers the sharding rules)
from .checkpoint import load_checkpoint, save_checkpoint
from .constrain import constrain
from .errors import AutoshardError, ExportError, HintError, PlanError, UserInputError
from .mesh import Mesh
from .placement import P, Partial, R, Replicate, S, Shard, Spec
from .plan import Plan
from .api import parallelize
from .program import Program
from .runtime.rng import manual_seed
from .stages import stage
from .viz import plot_timeline
from .weights.save import save_weights
from .weights.sources import load_weights

__all__ = ["AutoshardError", "ExportError", "HintError", "Mesh", "P", "Partial", "Plan", "PlanError", "Program", "R",
           "Replicate", "S", "Shard", "Spec", "UserInputError", "constrain", "load_checkpoint", "load_weights",
           "manual_seed", "parallelize", "plot_timeline", "save_checkpoint", "save_weights", "stage"]
__version__ = "0.1.0"
