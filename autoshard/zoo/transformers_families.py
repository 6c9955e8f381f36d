"""Tiny models of the Hugging Face `transformers` families people train, as autoshard FACTORIES.

Each factory takes no arguments and returns ``(model, example_inputs, loss_fn)``: a randomly
initialised model (2 layers, hidden size 32, 4 heads, grouped-query attention where the family has
it, vocabulary 128, dropout 0) built from the family's own config class, example inputs of batch 4
(sequence 8; 16 x 16 images for ViT) that include the labels, and `model_loss`, which picks the
family's own training loss (`labels=`) out of the model's output. Nothing is downloaded; weights come
from `torch.manual_seed(0)`. `transformers` is imported when a factory is called, so autoshard itself
does not need it (it is in the `test` extra).

The model's `forward` takes the example inputs positionally (``model(input_ids, labels)``,
``model(pixel_values, labels)``): its class is a subclass of the transformers class that only maps
positional tensors to the keyword arguments of the original `forward`, so parameter names stay the
transformers names (``model.layers.0.self_attn.q_proj.weight``) and checkpoints in the transformers
layout load as they are.

`HINTS[family]` (autoshard/zoo/transformers_hints.py) is data parallelism on mesh axis "dp" (the batch dim of every input) plus
Megatron-style tensor parallelism on axis "tp": column-parallel ``S(0)`` on the query/key/value and
up/gate weights (and their biases), row-parallel ``S(1)`` on the attention output and down
projections (GPT-2's `Conv1D` stores weights transposed: ``S(1)`` is its column, ``S(0)`` its row).

    python -m autoshard verify autoshard.zoo.transformers_families:llama --mesh 2,2 --axis-names dp,tp --simulate

>>> model, inputs, loss_fn = llama()
>>> [tuple(t.shape) for t in inputs], type(model).__name__
([(4, 8), (4, 8)], 'LlamaForCausalLM')
>>> loss_fn(model(*inputs), *inputs).dim()
0
"""
from __future__ import annotations

import contextlib

import torch

BATCH, SEQ, VOCAB, HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 4, 8, 128, 32, 4, 2, 64, 2
IMAGE, PATCH, CLASSES = 16, 4, 10


def model_loss(outputs, *inputs):
    """The model's own training loss: the `loss` field of the transformers output (computed from the
    `labels` the factory passes as an example input).

    >>> model_loss({"loss": torch.tensor(2.0), "logits": torch.zeros(2)})
    tensor(2.)
    """
    return outputs["loss"]


def _transformers():
    import transformers
    transformers.logging.set_verbosity_error()  # no warnings or banners from building tiny models
    transformers.logging.disable_progress_bar()
    return transformers


_POSITIONAL: dict = {}


def _positional(model, names: tuple[str, ...]):
    """`model` with a forward that takes `names` positionally (its class becomes a cached subclass)."""
    base = type(model)
    cls = _POSITIONAL.get((base, names))
    if cls is None:
        def forward(self, *inputs):
            return base.forward(self, **dict(zip(names, inputs)))
        forward.__doc__ = f"{base.__name__}.forward({', '.join(names)}) with positional tensors"
        cls = type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__,
                                            "__doc__": f"{base.__name__} whose forward takes ({', '.join(names)})"})
        _POSITIONAL[(base, names)] = cls
    model.__class__ = cls
    return model


def _build(model_class: str, config_class: str, names=("input_ids", "labels"), attn_implementation=None,
           device=None, **config):
    """Seeded random `model_class(config_class(**config))` in training mode, forward over `names`."""
    transformers = _transformers()
    torch.manual_seed(0)
    cfg = getattr(transformers, config_class)(**config)
    cfg.use_cache = False
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    # "meta": shapes only, nothing allocated (models at their real size); None: the caller's default device
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = getattr(transformers, model_class)._from_config(cfg, **kwargs)
    model.train()  # verify trains; every dropout probability is 0, so train and eval agree
    return _positional(model, names)


def _tokens(low: int = 3, shape=(BATCH, SEQ)):
    """Token ids away from the special ids (0..2: pad / bos / eos in these configs)."""
    return torch.randint(low, VOCAB, shape)


def causal_lm(model_class: str, config_class: str, attn_implementation=None, tokens=(BATCH, SEQ), **config):
    """A seeded random transformers causal LM (`model_class` of `config_class(**config)`) with inputs
    (input_ids, labels) of shape `tokens` (batch, sequence) and `model_loss`; the factories here (and
    autoshard/zoo/transformers_moe.py) use it.

    >>> model, (ids, labels), loss_fn = causal_lm("LlamaForCausalLM", "LlamaConfig", **DECODER)
    >>> type(model).__name__, tuple(ids.shape)
    ('LlamaForCausalLM', (4, 8))
    """
    model = _build(model_class, config_class, attn_implementation=attn_implementation, **config)
    ids = _tokens(shape=tokens)
    return model, (ids, ids.clone()), model_loss  # causal LM: the model shifts the labels itself


DECODER = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
                "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "max_position_embeddings": 2 * SEQ,
                "attention_dropout": 0.0, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}


def llama():
    """LlamaForCausalLM (RMSNorm, RoPE, SwiGLU, GQA 4 heads on 2 kv heads); inputs (input_ids, labels).

    >>> model, inputs, loss_fn = llama()
    >>> model.model.layers[0].self_attn.k_proj.out_features  # 2 kv heads of 8
    16
    """
    return causal_lm("LlamaForCausalLM", "LlamaConfig", **DECODER)


# Llama 3's published shapes (Meta's model cards): layers, width, heads, kv heads, FFN width.
LLAMA3_SHAPES = {"8b": (32, 4096, 32, 8, 14336), "70b": (80, 8192, 64, 8, 28672), "405b": (126, 16384, 128, 8, 53248)}


def llama3(size: str = "8b", batch: int = 16, seq: int = 8192, device: str = "meta"):
    """LlamaForCausalLM at a Llama 3 shape (vocabulary 128256, RoPE theta 500000), on the meta device by default:
    for planning at scale (`python -m autoshard plan autoshard.zoo.transformers_families:llama3_8b ...`).

    >>> model, (ids, labels), loss_fn = llama3("8b", batch=2, seq=16)
    >>> sum(p.numel() for p in model.parameters()) // 10**6, ids.device.type
    (8030, 'meta')
    """
    layers, width, heads, kv_heads, ffn = LLAMA3_SHAPES[size]
    model = _build("LlamaForCausalLM", "LlamaConfig", device=device, vocab_size=128256, hidden_size=width,
                   intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
                   num_key_value_heads=kv_heads, max_position_embeddings=max(seq, 8192), rope_theta=500000.0,
                   attention_dropout=0.0, tie_word_embeddings=False)
    ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
    return model, (ids, ids.clone()), model_loss


def llama3_8b():
    """Llama 3 8B, global batch 16 x 8192 tokens (the planning benchmark's case), on the meta device.

    >>> llama3_8b()[1][0].shape
    torch.Size([16, 8192])
    """
    return llama3("8b", batch=16)


def llama3_70b():
    """Llama 3 70B, global batch 64 x 8192 tokens, on the meta device.

    >>> llama3_70b()[1][0].shape
    torch.Size([64, 8192])
    """
    return llama3("70b", batch=64)


def llama3_405b():
    """Llama 3 405B, global batch 64 x 8192 tokens, on the meta device.

    >>> llama3_405b()[1][0].shape
    torch.Size([64, 8192])
    """
    return llama3("405b", batch=64)


def mistral():
    """MistralForCausalLM with a sliding window of 4 tokens (shorter than the sequence of 8).

    >>> model, inputs, loss_fn = mistral()
    >>> model.config.sliding_window
    4
    """
    return causal_lm("MistralForCausalLM", "MistralConfig", sliding_window=4, **DECODER)


def qwen2():
    """Qwen2ForCausalLM (Llama with biases on q/k/v).

    >>> model, inputs, loss_fn = qwen2()
    >>> model.model.layers[0].self_attn.q_proj.bias.shape
    torch.Size([32])
    """
    return causal_lm("Qwen2ForCausalLM", "Qwen2Config", **DECODER)


def qwen3():
    """Qwen3ForCausalLM (per-head RMSNorm on queries and keys).

    >>> model, inputs, loss_fn = qwen3()
    >>> model.model.layers[0].self_attn.q_norm.weight.shape
    torch.Size([8])
    """
    return causal_lm("Qwen3ForCausalLM", "Qwen3Config", head_dim=HIDDEN // HEADS, **DECODER)


def gemma2():
    """Gemma2ForCausalLM: local (sliding window 4) and global layers, attention and final logit
    soft-capping, eager attention (what transformers recommends for training Gemma 2).

    >>> model, inputs, loss_fn = gemma2()
    >>> model.config.layer_types
    ['sliding_attention', 'full_attention']
    """
    return causal_lm("Gemma2ForCausalLM", "Gemma2Config", attn_implementation="eager", head_dim=HIDDEN // HEADS,
                      query_pre_attn_scalar=HIDDEN // HEADS, sliding_window=4, **DECODER)


def phi3():
    """Phi3ForCausalLM: fused qkv_proj and gate_up_proj.

    >>> model, inputs, loss_fn = phi3()
    >>> model.model.layers[0].self_attn.qkv_proj.out_features  # q 32 + k 16 + v 16
    64
    """
    return causal_lm("Phi3ForCausalLM", "Phi3Config", resid_pdrop=0.0, embd_pdrop=0.0, **DECODER)


def gpt_neox():
    """GPTNeoXForCausalLM: fused per-head query_key_value, partial rotary, parallel residual.

    >>> model, inputs, loss_fn = gpt_neox()
    >>> model.gpt_neox.layers[0].attention.query_key_value.out_features
    96
    """
    return causal_lm("GPTNeoXForCausalLM", "GPTNeoXConfig", vocab_size=VOCAB, hidden_size=HIDDEN,
                      intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      max_position_embeddings=2 * SEQ, attention_dropout=0.0, hidden_dropout=0.0,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)


def opt():
    """OPTForCausalLM: learned positions, pre-LayerNorm, biases everywhere, tied lm_head.

    >>> model, inputs, loss_fn = opt()
    >>> model.lm_head.weight is model.model.decoder.embed_tokens.weight
    True
    """
    return causal_lm("OPTForCausalLM", "OPTConfig", vocab_size=VOCAB, hidden_size=HIDDEN, ffn_dim=FFN,
                      word_embed_proj_dim=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      max_position_embeddings=2 * SEQ, dropout=0.0, attention_dropout=0.0, layerdrop=0.0,
                      pad_token_id=1, bos_token_id=2, eos_token_id=2)


def bloom():
    """BloomForCausalLM: ALiBi positions, fused per-head query_key_value, embedding LayerNorm.

    >>> model, inputs, loss_fn = bloom()
    >>> model.transformer.h[0].self_attention.query_key_value.out_features
    96
    """
    return causal_lm("BloomForCausalLM", "BloomConfig", vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=LAYERS,
                      n_head=HEADS, hidden_dropout=0.0, attention_dropout=0.0, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2)


def falcon():
    """FalconForCausalLM, new decoder architecture (Falcon-40B/180B): grouped query_key_value on
    2 kv heads, parallel attention and MLP.

    >>> model, inputs, loss_fn = falcon()
    >>> model.transformer.h[0].self_attention.query_key_value.out_features  # (4 + 2 * 2) heads of 8
    64
    """
    return causal_lm("FalconForCausalLM", "FalconConfig", vocab_size=VOCAB, hidden_size=HIDDEN,
                      num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_kv_heads=KV_HEADS,
                      new_decoder_architecture=True, ffn_hidden_size=FFN, max_position_embeddings=2 * SEQ,
                      hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=1, eos_token_id=2)


def gpt2():
    """GPT2LMHeadModel: Conv1D layers (weights stored [in, out]), learned positions, tied lm_head.

    >>> model, inputs, loss_fn = gpt2()
    >>> model.transformer.h[0].attn.c_attn.weight.shape  # Conv1D: [in, out]
    torch.Size([32, 96])
    """
    return causal_lm("GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS,
                      n_head=HEADS, n_inner=FFN, n_positions=2 * SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
                      attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)


def gpt2_dropout():
    """GPT2LMHeadModel at GPT-2's default dropout (0.1 on embeddings, residuals and attention weights, the
    last inside scaled_dot_product_attention): verify compares it with rng="exact".

    >>> model, inputs, loss_fn = gpt2_dropout()
    >>> model.config.resid_pdrop, model.config.attn_pdrop, model.training
    (0.1, 0.1, True)
    """
    return causal_lm("GPT2LMHeadModel", "GPT2Config", attn_implementation="sdpa", vocab_size=VOCAB, n_embd=HIDDEN,
                      n_layer=LAYERS, n_head=HEADS, n_inner=FFN, n_positions=2 * SEQ, resid_pdrop=0.1,
                      embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=1, eos_token_id=2)


def _seq2seq(model_class: str, config_class: str, **config):
    model = _build(model_class, config_class, names=("input_ids", "labels"), **config)
    return model, (_tokens(), _tokens()), model_loss  # the model builds decoder inputs from the labels


def t5():
    """T5ForConditionalGeneration: encoder-decoder, relative position buckets, RMS LayerNorm;
    inputs (input_ids, labels).

    >>> model, inputs, loss_fn = t5()
    >>> model.decoder.block[0].layer[1].EncDecAttention.q.out_features
    32
    """
    return _seq2seq("T5ForConditionalGeneration", "T5Config", vocab_size=VOCAB, d_model=HIDDEN,
                    d_kv=HIDDEN // HEADS, d_ff=FFN, num_layers=LAYERS, num_decoder_layers=LAYERS, num_heads=HEADS,
                    relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
                    pad_token_id=0, eos_token_id=2, decoder_start_token_id=0)


def bart():
    """BartForConditionalGeneration: encoder-decoder, learned positions, tied embeddings;
    inputs (input_ids, labels).

    >>> model, inputs, loss_fn = bart()
    >>> len(model.model.encoder.layers), len(model.model.decoder.layers)
    (2, 2)
    """
    return _seq2seq("BartForConditionalGeneration", "BartConfig", vocab_size=VOCAB, d_model=HIDDEN,
                    encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=HEADS,
                    decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN,
                    max_position_embeddings=2 * SEQ, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                    classifier_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0, pad_token_id=1,
                    bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=2)


def roberta():
    """RobertaForMaskedLM: masked language modelling, labels -100 except at the masked positions.

    >>> model, inputs, loss_fn = roberta()
    >>> int((inputs[1] != -100).sum())  # every other position is masked
    16
    """
    model = _build("RobertaForMaskedLM", "RobertaConfig", vocab_size=VOCAB, hidden_size=HIDDEN,
                   num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FFN,
                   max_position_embeddings=SEQ + 2, type_vocab_size=1, hidden_dropout_prob=0.0,
                   attention_probs_dropout_prob=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    ids = _tokens()
    labels = torch.full_like(ids, -100)
    labels[:, ::2] = ids[:, ::2]
    ids = ids.clone()
    ids[:, ::2] = VOCAB - 1  # the <mask> token of this tiny vocabulary
    return model, (ids, labels), model_loss


def vit():
    """ViTForImageClassification on 16 x 16 RGB images in 4 x 4 patches, 10 classes; inputs
    (pixel_values, labels).

    >>> model, inputs, loss_fn = vit()
    >>> [tuple(t.shape) for t in inputs]
    [(4, 3, 16, 16), (4,)]
    """
    model = _build("ViTForImageClassification", "ViTConfig", names=("pixel_values", "labels"), image_size=IMAGE,
                   patch_size=PATCH, num_channels=3, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                   num_attention_heads=HEADS, intermediate_size=FFN, hidden_dropout_prob=0.0,
                   attention_probs_dropout_prob=0.0, num_labels=CLASSES)
    pixels = torch.randn(BATCH, 3, IMAGE, IMAGE)
    return model, (pixels, torch.randint(0, CLASSES, (BATCH,))), model_loss


def mixtral():
    """MixtralForCausalLM: 4 experts, top-2 routing, the load-balancing loss in the training loss.
    Experts run as `batched_mm` (a gather of each token's expert weights and a bmm), which has
    float64 kernels; see `mixtral_grouped_mm` for transformers' default.

    >>> model, inputs, loss_fn = mixtral()
    >>> model.model.layers[0].mlp.experts.gate_up_proj.shape  # [experts, 2 * ffn, hidden]
    torch.Size([4, 128, 32])
    """
    return causal_lm("MixtralForCausalLM", "MixtralConfig", num_local_experts=4, num_experts_per_tok=2,
                      output_router_logits=True, router_aux_loss_coef=0.01, router_jitter_noise=0.0,
                      experts_implementation="batched_mm", **DECODER)


def mixtral_grouped_mm():
    """Mixtral with transformers' default experts implementation, `torch._grouped_mm` (no float64
    kernel on CPU: verify it with `dtype=torch.float32`).

    >>> model, inputs, loss_fn = mixtral_grouped_mm()
    >>> model.config._experts_implementation
    'grouped_mm'
    """
    return causal_lm("MixtralForCausalLM", "MixtralConfig", num_local_experts=4, num_experts_per_tok=2,
                      output_router_logits=True, router_aux_loss_coef=0.01, router_jitter_noise=0.0, **DECODER)


def mixtral_eager():
    """Mixtral with `experts_implementation="eager"`: a Python loop over the experts that received
    tokens (`for expert_idx in expert_hit`), which torch.export cannot trace (data-dependent control
    flow), so autoshard raises an ExportError naming that line; not in FAMILIES.

    >>> model, inputs, loss_fn = mixtral_eager()
    >>> model.config._experts_implementation
    'eager'
    """
    return causal_lm("MixtralForCausalLM", "MixtralConfig", num_local_experts=4, num_experts_per_tok=2,
                      output_router_logits=True, router_aux_loss_coef=0.01, router_jitter_noise=0.0,
                      experts_implementation="eager", **DECODER)


def beam():
    """BeamForCausalLM (sliding-window and full attention layers, 2 dense layers); inputs (input_ids, labels). Its
    forward builds one attention mask per layer type in `for layer_type in set(config.layer_types)`, an order set by
    the process's string hash seed: traced in canonical order (autoshard/frontend/canonical.py), every process gets
    the same graph. Not in FAMILIES (its own tests: tests/test_canonical_trace.py).

    >>> model, inputs, loss_fn = beam()
    >>> sorted(set(model.config.layer_types))
    ['full_attention', 'sliding_attention']
    """
    config = {**DECODER, "head_dim": HIDDEN // HEADS, "max_position_embeddings": 4 * SEQ}
    model = _build("BeamForCausalLM", "BeamConfig", sliding_window=SEQ // 2, moe_intermediate_size=FFN // 4,
                   num_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, **config)
    ids = _tokens(shape=(BATCH, 2 * SEQ))
    return model, (ids, ids.clone()), model_loss


# WavLM at hidden size 64 with a narrow 7-layer feature encoder: on a (2, 2) mesh under WAVLM_BUDGET, in float64 as
# verify plans it, each of its sharding ILPs takes HiGHS 15-25 s to solve exactly, and planning took 2 minutes before
# the solver's time limits (tests/passes/test_ilp_time_limit.py).
WAVLM_SAMPLES = 1600
WAVLM_BUDGET = 2_793_508  # bytes per device: 0.6 x its unbudgeted float32 plan's on (2, 2)


def wavlm():
    """WavLMForSequenceClassification (convolutional feature encoder, gated relative position bias, 2 layers of hidden
    size 64, 3 classes) on 0.1 s of 16 kHz audio; inputs (input_values, labels). Not in FAMILIES (its own tests:
    tests/passes/test_ilp_time_limit.py).

    >>> model, inputs, loss_fn = wavlm()
    >>> [tuple(t.shape) for t in inputs], model.config.conv_dim
    ([(4, 1600), (4,)], (64, 64, 64, 64, 64, 64, 64))
    """
    transformers = _transformers()
    defaults = transformers.WavLMConfig()
    model = _build("WavLMForSequenceClassification", "WavLMConfig", names=("input_values", "labels"),
                   hidden_size=2 * HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                   intermediate_size=2 * FFN, conv_dim=(2 * HIDDEN,) * 7, conv_stride=defaults.conv_stride,
                   conv_kernel=defaults.conv_kernel, num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
                   hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
                   final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, num_labels=3)
    audio = torch.randn(BATCH, WAVLM_SAMPLES)
    return model, (audio, torch.randint(0, 3, (BATCH,))), model_loss


FAMILIES = {
    "llama": llama, "mistral": mistral, "qwen2": qwen2, "qwen3": qwen3, "gemma2": gemma2, "phi3": phi3,
    "gpt_neox": gpt_neox, "opt": opt, "bloom": bloom, "falcon": falcon, "gpt2": gpt2, "t5": t5, "bart": bart,
    "roberta": roberta, "vit": vit, "mixtral": mixtral, "mixtral_grouped_mm": mixtral_grouped_mm,
}
