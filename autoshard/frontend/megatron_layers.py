"""Which linears of the zoo's models are column and which row parallel (Megatron's pairing), by model name: the
table `megatron` hints (autoshard/zoo/hints.py) and the ColossalAI modes (autoshard/frontend/tp_modes.py) read.
It lives in the frontend, below the zoo, because the frontend's `parallel=` option reads it for a zoo model given
by name; nothing here imports the zoo.

>>> MEGATRON_LAYERS["llama"]["layers.*.attn.wo.weight"], MEGATRON_LAYERS["llama"]["layers.*.mlp.w1.weight"]
('S(1)', 'S(0)')
"""
from __future__ import annotations

_COLUMN, _ROW = "S(0)", "S(1)"


def _transformer(prefix_attn: str, prefix_mlp: str, qkv_bias: bool, out: str, fc_in: list[str], fc_out: str,
                 fc_bias: bool):
    rules = {f"{prefix_attn}.[qkv].weight": _COLUMN, f"{prefix_attn}.{out}.weight": _ROW}
    if qkv_bias:
        rules[f"{prefix_attn}.[qkv].bias"] = _COLUMN
    for name in fc_in:
        rules[f"{prefix_mlp}.{name}.weight"] = _COLUMN
        if fc_bias:
            rules[f"{prefix_mlp}.{name}.bias"] = _COLUMN
    rules[f"{prefix_mlp}.{fc_out}.weight"] = _ROW
    return rules


MEGATRON_LAYERS = {
    "mlp": {"layers.0.weight": _COLUMN, "layers.0.bias": _COLUMN, "layers.1.weight": _ROW},
    "gpt2": _transformer("layers.*.attn", "layers.*.mlp", True, "proj", ["fc1"], "fc2", True),
    "bert": _transformer("layers.*.attn", "layers.*.mlp", True, "proj", ["fc1"], "fc2", True),
    "vit": _transformer("layers.*.attn", "layers.*.mlp", True, "proj", ["fc1"], "fc2", True),
    "llama": _transformer("layers.*.attn", "layers.*.mlp", False, "wo", ["w1", "w3"], "w2", False),
    # Channel parallel convolutions: conv1 splits output channels (its batch norm follows), conv2
    # contracts them (partial sum, all-reduced before bn2).
    "resnet": {"stage*.*.conv1.weight": _COLUMN, "stage*.*.bn1.weight": "S(0)", "stage*.*.bn1.bias": "S(0)",
               "stage*.*.bn1.running_mean": "S(0)", "stage*.*.bn1.running_var": "S(0)",
               "stage*.*.conv2.weight": _ROW},
}
