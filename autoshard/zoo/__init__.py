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
from . import bert, gpt2, llama, mlp, resnet, vit

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

__all__ = ["FACTORIES", "bert", "gpt2", "llama", "mlp", "resnet", "vit"]
