"""Megatron-LM's tensor-parallel layout for each transformers family autoshard's zoo builds
(autoshard/zoo/transformers_families.py's FAMILIES), as hints on "tp", with data parallelism on "dp": `HINTS[family]`.

Column-parallel weights split their output features, row-parallel ones their input features; the column layers'
biases split with their outputs; everything else (embeddings, norms, heads, routers, the row layers' biases, added
after the all-reduce) replicated.

>>> HINTS["llama"]["model.layers.*.self_attn.o_proj.weight"]
{'tp': 'S(1)'}
>>> from autoshard.zoo.transformers_families import FAMILIES
>>> sorted(HINTS) == sorted(FAMILIES)  # every family the zoo builds
True
"""
from __future__ import annotations

_COL, _ROW, _REP = "S(0)", "S(1)", "R"


def _megatron(column: list[str], row: list[str], column_biases: list[str], replicated: list[str]) -> dict:
    """Tensor-parallel hints on "tp" for every parameter: column- and row-parallel weights, the column
    layers' biases split with their outputs, everything else (embeddings, norms, heads, routers, the row
    layers' biases, added after the all-reduce) replicated, as in Megatron-LM."""
    hints = {f"{m}.weight": {"tp": _COL} for m in column}
    hints.update({f"{m}.bias": {"tp": _COL} for m in column_biases})
    hints.update({f"{m}.weight": {"tp": _ROW} for m in row})
    hints.update({glob: {"tp": _REP} for glob in replicated})
    return hints


def _llama_like(qkv_bias=False, replicated=()):
    attn, mlp = "model.layers.*.self_attn", "model.layers.*.mlp"
    return _megatron([f"{attn}.[qkv]_proj", f"{mlp}.gate_proj", f"{mlp}.up_proj"],
                     [f"{attn}.o_proj", f"{mlp}.down_proj"], [f"{attn}.[qkv]_proj"] if qkv_bias else [],
                     ["model.embed_tokens.weight", "lm_head.weight", "*norm.weight", *replicated])


def _per_head_qkv(prefix: str, attn: str, embeddings: list[str], norms: list[str], biases: bool = True):
    """GPT-NeoX, Bloom and Falcon: one query_key_value layer laid out per head (or per kv group)."""
    column, row = [f"{prefix}.{attn}.query_key_value", f"{prefix}.mlp.dense_h_to_4h"], \
        [f"{prefix}.{attn}.dense", f"{prefix}.mlp.dense_4h_to_h"]
    return _megatron(column, row, column if biases else [],
                     embeddings + norms + ([f"{m}.bias" for m in row] if biases else []))


def _attention_mlp(layers: str, attns: list[str], qkv: tuple[str, str, str], out: str, up: str, down: str,
                   replicated: list[str], bias: bool = True):
    """Encoders and encoder-decoders: separate q, k, v layers in each attention of `layers`."""
    column = [f"{layers}.{a}.{p}" for a in attns for p in qkv] + [f"{layers}.{up}"]
    row = [f"{layers}.{a}.{out}" for a in attns] + [f"{layers}.{down}"]
    return _megatron(column, row, column if bias else [], replicated + ([f"{m}.bias" for m in row] if bias else []))


_MIXTRAL = {**{k: v for k, v in _llama_like(replicated=["model.layers.*.mlp.gate.weight"]).items()  # the router
               if "_proj.weight" not in k or ".mlp." not in k},
            # Experts' 3-D weights [experts, out, in]: the ffn dim is 1 of gate_up_proj and 2 of down_proj.
            "model.layers.*.mlp.experts.gate_up_proj": {"tp": "S(1)"},
            "model.layers.*.mlp.experts.down_proj": {"tp": "S(2)"}}
_BART_SHARED = ["model.shared.weight", "*embed_positions.weight", "*layer_norm.*", "*layernorm_embedding.*"]

_TP = {
    "llama": _llama_like(), "mistral": _llama_like(), "qwen2": _llama_like(qkv_bias=True), "qwen3": _llama_like(),
    "gemma2": _llama_like(),
    "phi3": _megatron(["model.layers.*.self_attn.qkv_proj", "model.layers.*.mlp.gate_up_proj"],
                      ["model.layers.*.self_attn.o_proj", "model.layers.*.mlp.down_proj"], [],
                      ["model.embed_tokens.weight", "lm_head.weight", "*norm.weight"]),
    "gpt_neox": _per_head_qkv("gpt_neox.layers.*", "attention", ["gpt_neox.embed_in.weight", "lm_head.weight"],
                              ["*layer_norm.*", "*layernorm.*"]),
    "bloom": _per_head_qkv("transformer.h.*", "self_attention", ["transformer.word_embeddings.weight"],
                           ["*layernorm.*", "transformer.ln_f.*"]),
    "falcon": _per_head_qkv("transformer.h.*", "self_attention", ["transformer.word_embeddings.weight"],
                            ["*.ln_*"], biases=False),
    "opt": _attention_mlp("model.decoder.layers.*", ["self_attn"], ("q_proj", "k_proj", "v_proj"), "out_proj", "fc1",
                          "fc2", ["model.decoder.embed_*", "*layer_norm.*"]),
    # Conv1D keeps weights as [in, out]: column parallel is S(1), row parallel S(0); column biases S(0).
    "gpt2": {"transformer.h.*.attn.c_attn.weight": {"tp": "S(1)"}, "transformer.h.*.attn.c_attn.bias": {"tp": "S(0)"},
             "transformer.h.*.mlp.c_fc.weight": {"tp": "S(1)"}, "transformer.h.*.mlp.c_fc.bias": {"tp": "S(0)"},
             "transformer.h.*.attn.c_proj.weight": {"tp": "S(0)"}, "transformer.h.*.mlp.c_proj.weight": {"tp": "S(0)"},
             **{glob: {"tp": _REP} for glob in ("transformer.wte.weight", "transformer.wpe.weight", "*.ln_*",
                                                "*.c_proj.bias")}},
    "t5": {**_attention_mlp("encoder.block.*", ["layer.0.SelfAttention"], ("q", "k", "v"), "o",
                            "layer.1.DenseReluDense.wi", "layer.1.DenseReluDense.wo",
                            ["shared.weight", "*layer_norm.weight", "*relative_attention_bias.weight"], bias=False),
           **_attention_mlp("decoder.block.*", ["layer.0.SelfAttention", "layer.1.EncDecAttention"], ("q", "k", "v"),
                            "o", "layer.2.DenseReluDense.wi", "layer.2.DenseReluDense.wo", [], bias=False)},
    "bart": {**_attention_mlp("model.encoder.layers.*", ["self_attn"], ("q_proj", "k_proj", "v_proj"), "out_proj",
                              "fc1", "fc2", _BART_SHARED),
             **_attention_mlp("model.decoder.layers.*", ["self_attn", "encoder_attn"], ("q_proj", "k_proj", "v_proj"),
                              "out_proj", "fc1", "fc2", [])},
    "roberta": _attention_mlp("roberta.encoder.layer.*", ["attention"], ("self.query", "self.key", "self.value"),
                              "output.dense", "intermediate.dense", "output.dense",
                              ["roberta.embeddings.*", "lm_head.*", "*LayerNorm.*"]),
    "vit": _attention_mlp("vit.layers.*", ["attention"], ("q_proj", "k_proj", "v_proj"), "o_proj", "mlp.fc1",
                          "mlp.fc2", ["vit.embeddings.*", "classifier.*", "*layernorm*"]),
    "mixtral": _MIXTRAL, "mixtral_grouped_mm": _MIXTRAL,
}

# Data parallelism: the batch dim of every example input (input ids or pixels, and labels) on "dp".
DATA_PARALLEL = {"input:0": {"dp": "S(0)"}, "input:1": {"dp": "S(0)"}}

HINTS = {family: {**DATA_PARALLEL, **tp} for family, tp in _TP.items()}
