"""Ready-made hint sets for the zoo models: data parallel, Megatron tensor parallel, and both.

>>> megatron("llama", "tp")["layers.*.attn.wo.weight"]
{'tp': 'S(1)'}
>>> plan_hints("gpt2", ("dp", "tp"), batch_axes=("dp",), tp_axis="tp")["input:0"]
{'dp': 'S(0)'}
"""
from __future__ import annotations

from autoshard.frontend.megatron_layers import MEGATRON_LAYERS
from autoshard.zoo.gpt2 import gpt2
from autoshard.zoo.llama import llama

NUM_INPUTS = {"mlp": 1, "gpt2": 1, "llama": 1, "bert": 2, "resnet": 2, "vit": 2}

def megatron(model: str, axis: str = "tp") -> dict:
    """Megatron-style (column then row parallel) hints for a zoo model on mesh axis `axis`.

    >>> megatron("gpt2", "tp")["layers.*.attn.[qkv].weight"], megatron("gpt2", "tp")["layers.*.mlp.fc2.weight"]
    ({'tp': 'S(0)'}, {'tp': 'S(1)'})
    """
    return {key: {axis: placement} for key, placement in MEGATRON_LAYERS[model].items()}


# Megatron-SP (Korthikanti et al. 2022): the residual stream and the norm/dropout regions are
# sharded along the sequence (dim 1) on the tp axis, from each row-parallel matmul's output to the
# next column-parallel matmul's input, which is gathered (R); row matmuls take their input split on
# the contracted (last) dim. The solver then puts an all-gather before
# each column matmul and a reduce-scatter after each row matmul; fuse_comm gives the all-gather its
# dual backward (reduce-scatter), the reduce-scatter's is an all-gather.
_SEQUENCE_REGIONS = {
    "gpt2": ["layers.*.ln1", "layers.*.ln2", "layers.*.attn.proj", "layers.*.mlp.fc2", "ln_f"],
    "llama": ["layers.*.attn_norm", "layers.*.ffn_norm", "norm"],  # wo/w2 output the partial sum itself
}
_COLUMN_MODULES = {"gpt2": ["layers.*.attn.[qkv]", "layers.*.mlp.fc1"],
                   "llama": ["layers.*.attn.[qkv]", "layers.*.mlp.w[13]"]}
_ROW_MODULES = {"gpt2": ["layers.*.attn.proj", "layers.*.mlp.fc2"], "llama": ["layers.*.attn.wo", "layers.*.mlp.w2"]}


def megatron_sp(model: str, axis: str = "tp") -> dict:
    """Megatron tensor parallel plus sequence parallel on mesh axis `axis` (gpt2, llama).

    >>> hints = megatron_sp("gpt2", "tp")
    >>> hints["layers.*.ln1:output"], hints["layers.*.mlp.fc1:input"]
    ({'tp': 'S(1)'}, {'tp': 'R'})
    """
    if model not in _SEQUENCE_REGIONS:
        raise KeyError(f"megatron_sp has sequence regions for {sorted(_SEQUENCE_REGIONS)}, not {model!r}; "
                       "write ':output' hints with S(1) on the tp axis for your model's norm/residual modules")
    hints = megatron(model, axis)
    hints.update({f"{m}:output": {axis: "S(1)"} for m in _SEQUENCE_REGIONS[model]})
    hints.update({f"{m}:input": {axis: "R"} for m in _COLUMN_MODULES[model]})
    hints.update({f"{m}:input": {axis: "S(2)"} for m in _ROW_MODULES[model]})
    return hints


def data_parallel(model: str, axes=("dp",)) -> dict:
    """Batch sharding of every input over `axes` (nested when several).

    >>> data_parallel("bert", ("dp", "sp"))
    {'input:0': {'dp': 'S(0)', 'sp': 'S(0)'}, 'input:1': {'dp': 'S(0)', 'sp': 'S(0)'}}
    """
    return {f"input:{i}": {axis: "S(0)" for axis in axes} for i in range(NUM_INPUTS[model])}


def plan_hints(model: str, axis_names, batch_axes=(), tp_axis: str | None = None) -> dict:
    """Data parallel on `batch_axes` plus Megatron on `tp_axis` (either may be absent).

    >>> sorted(plan_hints("mlp", ("dp", "tp"), batch_axes=("dp",), tp_axis="tp"))
    ['input:0', 'layers.0.bias', 'layers.0.weight', 'layers.1.weight']
    """
    hints = data_parallel(model, tuple(batch_axes)) if batch_axes else {}
    if tp_axis is not None:
        hints.update(megatron(model, tp_axis))
    return hints


def gpt2_wide():
    """GPT-2-style at a weight-heavy shape (dim 512, 2 x 16 tokens) where tensor parallelism pays.

    >>> model, (ids,), loss_fn = gpt2_wide()
    >>> model.wte.weight.shape, ids.shape
    (torch.Size([64, 512]), torch.Size([2, 16]))
    """
    return gpt2(batch=2, seq=16, dim=512)


def llama_wide():
    """Llama-style at a weight-heavy shape (dim 512, FFN 1024, 2 x 16 tokens).

    >>> model, (ids,), loss_fn = llama_wide()
    >>> model.layers[0].mlp.w1.weight.shape
    torch.Size([1024, 512])
    """
    return llama(batch=2, seq=16, dim=512, ffn_dim=1024)
