"""A transformers model inside a user's own module, the usual way to return its loss: `LossOf(inner)`
whose forward is `inner(input_ids=ids, labels=labels).loss`. Its parameter names carry the wrapper's
`inner.` prefix, while the checkpoint the inner model writes (`save_pretrained`) does not; autoshard's
default initialisation and `weights=` find the transformers model inside (autoshard/weights/).

    python -m autoshard verify autoshard.zoo.wrapped:wrapped_llama --mesh 2,2 --axis-names dp,tp --simulate

`HINTS` is the Llama family's data and tensor parallelism (autoshard/zoo/transformers_hints.py) under `inner.`.

>>> model, inputs, loss_fn = wrapped_llama()
>>> type(model.inner).__name__, next(iter(dict(model.named_parameters())))
('LlamaForCausalLM', 'inner.model.embed_tokens.weight')
>>> model(*inputs).dim()
0
>>> HINTS["inner.lm_head.weight"]
{'tp': 'R'}
"""
from __future__ import annotations

import torch

from autoshard.zoo.transformers_families import DECODER, model_loss
from autoshard.zoo.transformers_hints import HINTS as FAMILY_HINTS

# The Llama family's DP + Megatron TP hints, under the wrapper's `inner.`.
HINTS = {key if key.startswith(("input:", "*")) else f"inner.{key}": value for key, value in FAMILY_HINTS["llama"].items()}


class LossOf(torch.nn.Module):
    """`inner`'s training loss for (input_ids, labels): a transformers causal LM wrapped in a plain module.

    >>> LossOf(torch.nn.Identity()).inner
    Identity()
    """

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, ids, labels):
        """The loss of `inner` on (ids, labels), as the transformers model computes it.

        >>> model(*inputs).shape
        torch.Size([])
        """
        return model_loss(self.inner(input_ids=ids, labels=labels))


def wrapped_llama():
    """`LossOf(LlamaForCausalLM)` (the zoo's transformers Llama, its head tied to the embedding), seeded;
    inputs (input_ids, labels); the output is the loss, so no loss_fn.

    >>> model, (ids, labels), loss_fn = wrapped_llama()
    >>> model.inner.lm_head.weight is model.inner.model.embed_tokens.weight, loss_fn
    (True, None)
    """
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**DECODER, "tie_word_embeddings": True})
    config.use_cache = False
    model = LossOf(transformers.LlamaForCausalLM._from_config(config))
    model.train()
    ids = torch.randint(3, DECODER["vocab_size"], (4, 8))
    return model, (ids, ids.clone()), None
