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

Not in FACTORIES (its own tests: tests/zoo/test_moe.py, tests/multirank/test_moe_verify.py):

- ``moe_llama`` -- LLaMA whose feed-forward is a top-2 mixture of 4 SwiGLU experts with a fixed capacity
  per expert (GShard's formulation: fixed shapes, so it traces and its experts shard over a mesh axis,
  expert parallelism, autoshard/zoo/moe.py); inputs ``(ids,)``, next-token CE plus the balancing loss;
  ``moe_llama_dropped`` (capacity factor 0.5) and ``moe_llama_uneven`` (a skewed router) for tests

>>> from autoshard.zoo import FACTORIES
>>> model, inputs, loss_fn = FACTORIES["gpt2"]()
"""
from autoshard.zoo import bert, gpt2, llama, mlp, moe, resnet, vit

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
moe_llama, moe_llama_dropped, moe_llama_uneven = moe.moe_llama, moe.moe_llama_dropped, moe.moe_llama_uneven



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


__all__ = ["FACTORIES", "bert", "gpt2", "gpt2_dropout", "llama", "llama_dropout", "mlp", "moe_llama",
           "moe_llama_dropped", "moe_llama_uneven", "resnet", "vit"]
