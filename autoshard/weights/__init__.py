"""Model weights in and out of rank modules without the full model on any rank: sources (safetensors
files, the transformers layout, DCP directories, state dicts), the replayed initialisation, each rank's
blocks (`rank_weights`), `save_weights` and its single-device reader `load_weights`.
"""
from autoshard.weights.load import rank_weights
from autoshard.weights.replay import module_inits, replay_init
from autoshard.weights.save import save_weights
from autoshard.weights.sources import (
           DcpWeights,
           InitWeights,
           SafetensorsWeights,
           StateDictWeights,
           load_weights,
           open_weights,
)

__all__ = ["DcpWeights", "InitWeights", "SafetensorsWeights", "StateDictWeights", "load_weights", "module_inits",
           "open_weights", "rank_weights", "replay_init", "save_weights"]
