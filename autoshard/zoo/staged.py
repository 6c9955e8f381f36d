"""Zoo models with pipeline stages annotated in the model itself (the MindSpore way).

`gpt2_staged` marks its modules with `autoshard.stage(module, k)`; `llama_staged` sets MindSpore's
`cell.pipeline_stage = k` attribute. Both split the layers evenly over `stages`, embeddings in the
first stage and the final norm and head in the last (alone when there are more than 2 stages): ready for
`parallelize(..., axis_names=("pp", ...))`.

>>> model, inputs, loss_fn = gpt2_staged()
>>> model.layers[1]._autoshard_stage
1
"""
from autoshard.frontend.stages import stage
from autoshard.zoo.gpt2 import gpt2
from autoshard.zoo.llama import llama


def _layer_stage(i: int, n_layers: int, stages: int) -> int:
    """Layers spread evenly; with more than 2 stages the first and last hold only embeddings / head."""
    if stages <= 2:
        return i * stages // n_layers
    return 1 + i * (stages - 2) // n_layers


def gpt2_staged(stages: int = 2, **sizes):
    """GPT-2 whose modules carry `autoshard.stage` marks for `stages` stages; returns (model, inputs, loss_fn).

    >>> model, inputs, loss_fn = gpt2_staged(stages=2, n_layers=4)
    >>> [layer._autoshard_stage for layer in model.layers], model.lm_head._autoshard_stage
    ([0, 0, 1, 1], 1)
    """
    model, inputs, loss_fn = gpt2(**sizes)
    for module in (model.wte, model.wpe, model.drop):
        stage(module, 0)
    for i, layer in enumerate(model.layers):
        stage(layer, _layer_stage(i, len(model.layers), stages))
    stage(model.ln_f, stages - 1)
    stage(model.lm_head, stages - 1)
    return model, inputs, loss_fn


def llama_staged(stages: int = 2, **sizes):
    """LLaMA whose modules carry MindSpore's `pipeline_stage` attribute; returns (model, inputs, loss_fn).

    >>> model, inputs, loss_fn = llama_staged(stages=4, n_layers=2)
    >>> [m.pipeline_stage for m in (model.tok_embeddings, *model.layers, model.output)]
    [0, 1, 2, 3]
    """
    model, inputs, loss_fn = llama(**sizes)
    model.tok_embeddings.pipeline_stage = 0
    for i, layer in enumerate(model.layers):
        layer.pipeline_stage = _layer_stage(i, len(model.layers), stages)
    model.norm.pipeline_stage = stages - 1
    model.output.pipeline_stage = stages - 1
    return model, inputs, loss_fn


def gpt2_staged4(**sizes):
    """`gpt2_staged` in 4 stages (2 pp ranks x 2 virtual stages for interleaved schedules).

    >>> model, inputs, loss_fn = gpt2_staged4()
    >>> model.wte._autoshard_stage, model.ln_f._autoshard_stage
    (0, 3)
    """
    return gpt2_staged(4, **sizes)


def llama_staged4(**sizes):
    """`llama_staged` in 4 stages.

    >>> model, inputs, loss_fn = llama_staged4()
    >>> model.norm.pipeline_stage
    3
    """
    return llama_staged(4, **sizes)
