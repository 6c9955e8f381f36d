"""The prefix that puts a checkpoint's keys onto the model's names: a checkpoint written by a model that
the planned model wraps (transformers' `save_pretrained` of `self.inner`) names its tensors without the
wrapper's `inner.`; loading it needs no renaming when one prefix maps its keys onto the model's names.

>>> names = {"inner.lm_head.weight", "inner.model.norm.weight", "head.weight"}
>>> checkpoint_prefix(["lm_head.weight", "model.norm.weight"], names, "checkpoint 'ckpt'")
'inner.'
"""
from __future__ import annotations

from autoshard.weights.training_checkpoint import CheckpointError


def checkpoint_prefix(keys, names, where: str) -> str:
    """The prefix `p` under which the checkpoint's `keys` are the model's `names` (`p + key` in `names`):
    "" when every key is already a name; else the prefix that maps the most keys, if it maps more than
    "" does. Two prefixes that map equally many (a wrapper holding two copies of the checkpoint's model)
    are a CheckpointError naming both (`where`: the checkpoint, for the message).

    >>> checkpoint_prefix(["a.weight"], {"a.weight", "x.a.weight"}, "checkpoint 'c'")
    ''
    >>> checkpoint_prefix(["a.weight"], {"student.a.weight", "teacher.a.weight"}, "checkpoint 'c'")
    Traceback (most recent call last):
    ...
    autoshard.weights.training_checkpoint.CheckpointError: checkpoint 'c' fits the model under several prefixes ('student.', 'teacher.': each maps 1 of its 1 keys): pass a state dict whose keys are the model's names, e.g. {prefix + key: tensor for key, tensor in autoshard.load_weights(path).items()}
    """
    keys, names = list(keys), set(names)
    direct = sum(key in names for key in keys)
    if direct == len(keys):
        return ""
    by_suffix: dict = {}
    for name in names:
        for i, char in enumerate(name):
            if char == ".":
                by_suffix.setdefault(name[i + 1:], set()).add(name[:i + 1])
    candidates = {prefix for key in keys if key not in names for prefix in by_suffix.get(key, ())}
    scores = {prefix: sum(prefix + key in names for key in keys) for prefix in candidates}
    best = max(scores.values(), default=0)
    if best <= direct:
        return ""
    winners = sorted(prefix for prefix, score in scores.items() if score == best)
    if len(winners) > 1:
        raise CheckpointError(f"{where} fits the model under several prefixes ({', '.join(map(repr, winners))}: each "
                              f"maps {best} of its {len(keys)} keys): pass a state dict whose keys are the model's "
                              "names, e.g. {prefix + key: tensor for key, tensor in autoshard.load_weights(path).items()}")
    return winners[0]
