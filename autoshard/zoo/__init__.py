"""Model zoo: small, randomly initialised models for exercising the sharding compiler.

Every factory is callable with no arguments and returns ``(model, example_inputs, loss_fn)``
where ``model(*example_inputs)`` works and ``loss_fn(output, *example_inputs)`` is a scalar.
Size keyword arguments allow bigger models; ``device="meta"`` builds without allocating.

- ``mlp``    -- stack of Linear layers with GELU; inputs ``(x,)``, loss ``mean(out**2)``
- ``gpt2``   -- GPT-2 decoder, tied ``lm_head``; inputs ``(ids,)``, next-token cross-entropy
- ``llama``  -- LLaMA decoder (RMSNorm, RoPE, SwiGLU, GQA); inputs ``(ids,)``, next-token CE
- ``bert``   -- BERT encoder classifier (mean pooled); inputs ``(ids, labels)``, cross-entropy
- ``resnet`` -- small ResNet with BasicBlocks; inputs ``(images, labels)``, cross-entropy
- ``vit``    -- Vision Transformer; inputs ``(images, labels)``, cross-entropy

>>> from autoshard.zoo import FACTORIES
>>> model, inputs, loss_fn = FACTORIES["gpt2"]()
"""
from autoshard.zoo import bert, gpt2, llama, mlp, resnet, vit

FACTORIES = {
    "mlp": mlp.mlp,
    "gpt2": gpt2.gpt2,
    "llama": llama.llama,
    "bert": bert.bert,
    "resnet": resnet.resnet,
    "vit": vit.vit,
}

# Re-export the factory functions (shadowing the submodule names in this namespace).
mlp = mlp.mlp
gpt2 = gpt2.gpt2
llama = llama.llama
bert = bert.bert
resnet = resnet.resnet
vit = vit.vit



def gpt2_dropout():
    """The zoo GPT-2 at GPT-2's dropout, 0.1 (`verify autoshard.zoo:gpt2_dropout` compares it with rng="exact").

    >>> gpt2_dropout()[0].cfg.dropout
    0.1
    """
    return gpt2(dropout=0.1)


def llama_dropout():
    """The zoo LLaMA with dropout 0.1 on the attention weights and residual branches.

    >>> llama_dropout()[0].cfg.dropout
    0.1
    """
    return llama(dropout=0.1)


__all__ = ["FACTORIES", "bert", "gpt2", "gpt2_dropout", "llama", "llama_dropout", "mlp", "resnet", "vit"]
