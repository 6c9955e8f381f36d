"""Every model family the installed `transformers` ships with a trainable head, built tiny and generically.

`families()` lists each model type of transformers' auto mappings once, with the first head it offers in
`HEAD_MAPPINGS` order (causal LM, masked LM, seq2seq LM, speech seq2seq, CTC, audio classification, contrastive
image-text, image / video classification, sequence classification, token classification). `build(family)`
makes a random instance from the family's own config class, shrunk by rules over the config's fields (`tiny_config`: every
integer field named like a layer count, a width, a head count, a feed-forward width, a vocabulary or a
position table is made small, every dropout 0, recursively into sub-configs), never written per family; and a
synthetic batch of the kind its `main_input_name` asks for (token ids, pixel values, raw audio, audio
features), with the labels of its head, so the loss is the model's own (`model_loss`). The first of a few
candidate input shapes on which the model's forward runs is taken. Nothing is downloaded; weights come from
`torch.manual_seed(0)`.

The model's forward takes the example inputs positionally (``model(input_ids, labels)``); its class is a
subclass of the transformers class that maps them to keyword arguments (with fixed ones such as
``return_loss=True`` for contrastive models), so parameter names stay transformers'.

Every family is also a FACTORY of this module by name (a module `__getattr__`):

    python -m autoshard verify autoshard.zoo.architectures:llama --mesh 2 --axis-names dp --simulate

The sweep over all of them is benchmarks/architectures.py (`python -m benchmarks --only architectures`).

>>> fams = families()
>>> fams["llama"], fams["roberta"], fams["vit"]
('causal-lm', 'causal-lm', 'image-classification')
>>> model, inputs, loss_fn = build("llama")
>>> [tuple(t.shape) for t in inputs], model.config.num_hidden_layers, model.config.hidden_size
([(4, 8), (4, 8)], 2, 32)
>>> loss_fn(model(*inputs), *inputs).dim()
0
"""
from __future__ import annotations

import dataclasses
import functools
import re

import torch

BATCH, SEQ, VOCAB, WIDTH, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 4, 8, 128, 32, 4, 2, 8, 64, 2
IMAGE, CLASSES, EXPERTS, POSITIONS = 32, 3, 4, 64
MAX_PARAMETERS = 20_000_000  # a config the rules left big is refused, not built

# (auto-mapping name, head): a family's head is the first of these that it has.
HEAD_MAPPINGS = [
    ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "causal-lm"),
    ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "masked-lm"),
    ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "seq2seq-lm"),
    ("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "speech-seq2seq"),
    ("MODEL_FOR_CTC_MAPPING_NAMES", "ctc"),
    ("MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES", "audio-classification"),
    ("MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES", "contrastive"),
    ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "image-classification"),
    ("MODEL_FOR_VIDEO_CLASSIFICATION_MAPPING_NAMES", "video-classification"),
    ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "sequence-classification"),
    ("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "token-classification"),
]

# Field-name rules of `tiny_config`, first match wins: (regex on the field name, the small value).
_INT_RULES = [
    (r"(^|_)(num_)?(local_|routed_)?experts?$|^n_routed_experts$|^num_experts$", EXPERTS),
    (r"experts_per_tok|^top_?k$|experts_per_token", 2),
    (r"^n_group$|expert_groups$", 2),
    (r"topk_group$", 1),
    (r"key_value_heads|kv_heads", KV_HEADS),
    (r"heads?$|^n_head$|num_heads", HEADS),
    (r"head_dim|^d_kv$|attention_head_size", HEAD_DIM),
    (r"lora_rank$|^state_size$|^d_state$|time_step_rank$", 2 * HEAD_DIM),
    (r"layers$|^n_layer$|^num_layers$|^depth$|num_blocks$|^n_layers$|block_repeats$", LAYERS),
    (r"intermediate_size|ffn_dim|^d_ff$|^n_inner$|ffn_hidden_size|inner_dim|^d_inner$|mlp_dim", FFN),
    (r"vocab_size$", VOCAB),
    (r"max_position_embeddings|^n_positions$|max_.*positions$|max_seq_len|^n_ctx$", POSITIONS),
    (r"^image_size$|^img_size$", IMAGE),
    ((r"hidden_size$|^d_model$|^n_embd$|embed_dim$|^dim$|^hidden_dim$|^d_embed$|embedding_size$|"
     r"^projection_dim$|^word_embed_proj_dim$|_hidden_dim$|^conv_dim$|^hidden_sizes$|^embed_dims$|channels$"), WIDTH),
]
_DROPOUT = re.compile(r"drop_connect|dropout|drop_prob|pdrop|layerdrop|drop_path|drop_rate|mask_time_prob|mask_feature_prob")
_TOKEN_ID = re.compile(r"token_id$|token_index$|_token_id$")
_SKIP = {"num_labels", "num_channels", "patch_size", "num_mel_bins", "feature_size", "input_feat_size"}


def _small(name: str, value):
    """The small value of an integer field (or of each element of a list of integers), or None to keep it."""
    if name in _SKIP:
        return None
    for pattern, small in _INT_RULES:
        if re.search(pattern, name):
            if isinstance(value, bool):
                return None
            if isinstance(value, int) and value > small:
                return small
            if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) and not isinstance(v, bool)
                                                                   for v in value):
                if pattern.startswith("layers$"):  # per-stage depths: one layer per stage
                    return type(value)(min(v, 1) for v in value)
                if "heads" in pattern or "head$" in pattern:
                    return type(value)(min(v, 2) for v in value)  # per-stage heads: 2 divides every stage width
                return type(value)(min(v, small) for v in value)
            return None
    if re.fullmatch(r"depths", name) and isinstance(value, (list, tuple)):
        return type(value)(min(v, 1) for v in value)
    return None


def tiny_config(config):
    """{field: small value} for the config instance `config` (its defaults): the fields `_INT_RULES` shrink,
    dropouts 0, token ids beyond the small vocabulary moved inside it, sub-configs shrunk the same way.

    >>> import transformers
    >>> small = tiny_config(transformers.LlamaConfig())
    >>> small["hidden_size"], small["num_hidden_layers"], small["num_key_value_heads"], small["vocab_size"]
    (32, 2, 2, 128)
    """
    changes = {}
    fields = [f.name for f in dataclasses.fields(config)] if dataclasses.is_dataclass(config) else list(vars(config))
    for name in fields:
        value = _read(config, name)
        if _is_config(value):
            changes[name] = type(value)(**tiny_config(value))
        elif isinstance(value, float) and not isinstance(value, bool) and _DROPOUT.search(name) and value > 0:
            changes[name] = 0.0
        elif value is None and name == "vocab_size":
            changes[name] = VOCAB  # a head over tokens needs one (ESM, CTC models leave it to the user)
        elif value is None and name == "pad_token_id" and "vocab_size" in fields:
            changes[name] = 0  # models that compare ids with it (ESM) need one; 0 is never drawn as a token
        elif name == "use_cache" and value is True:
            changes[name] = False  # a sub-config's cache would be returned (export cannot take a DynamicCache)
        elif isinstance(value, float) and name.endswith("_coefficient") and value > 1:
            changes[name] = 1.0  # EfficientNet-style width / depth multipliers
        elif (small := _small(name, value)) is not None:
            changes[name] = small
    vocab = changes.get("vocab_size", _read(config, "vocab_size"))
    if isinstance(vocab, int):
        moved = 0
        for name in fields:
            value = _read(config, name)
            if _TOKEN_ID.search(name) and isinstance(value, int) and not isinstance(value, bool) and value >= vocab:
                moved += 1
                changes[name] = vocab - moved  # the last ids of the small vocabulary, one each
    return changes


def per_layer_lists(config, changes: dict) -> dict:
    """{field: small value} for `config`'s per-layer lists once `changes` shrinks its layer count from N to L: a list
    of N entries (a type or a source layer per layer) keeps its first L, a rising list of layer indices those below
    L. A config that validates its layers against each other (`layer_types`, the layers an indexer or a hybrid block
    sits on) fails with its lists at full length, or with `tiny_config`'s per-stage rule applied to an index list.

    >>> from types import SimpleNamespace as Config
    >>> per_layer_lists(Config(num_hidden_layers=6, layer_types=["s", "s", "f", "s", "s", "f"], index_layers=[2, 5],
    ...                        kv_source_layers=[0, 1, 2, 2, 4, 5]), {"num_hidden_layers": 2})
    {'layer_types': ['s', 's'], 'index_layers': [], 'kv_source_layers': [0, 1]}
    """
    name, n = next(((name, _read(config, name)) for name in _LAYER_COUNTS
                    if name in changes and isinstance(_read(config, name), int)), (None, None))
    if name is None:
        return {}
    small = changes[name]
    out = {}
    for field, value in vars(config).items():
        if field == name or not isinstance(value, (list, tuple)) or not value:
            continue
        if len(value) == n and all(isinstance(v, (str, int)) for v in value):
            out[field] = type(value)(value[:small])
        elif (re.search(r"layers$|layer_ids$", field) and all(isinstance(v, int) for v in value)
              and list(value) == sorted(set(value)) and value[-1] < n):
            out[field] = type(value)(v for v in value if v < small)
    return out


_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def decoder_start(config) -> dict:
    """{"decoder_start_token_id": the pad id} for an encoder-decoder config that names no decoder start token: the
    model shifts its labels right behind it (T5's convention, which its released configs state; transformers 5's
    T5Config no longer has the field, and T5, LongT5, Switch Transformers and Pop2Piano read it).

    >>> from types import SimpleNamespace as Config
    >>> decoder_start(Config(is_encoder_decoder=True, pad_token_id=0))
    {'decoder_start_token_id': 0}
    """
    pad = _read(config, "pad_token_id")
    if _read(config, "is_encoder_decoder") and _read(config, "decoder_start_token_id") is None \
            and isinstance(pad, int):
        return {"decoder_start_token_id": pad}
    return {}


def equal_heads(config, changes: dict) -> dict:
    """{kv heads field: the small head count} where `config` has as many key/value heads as query heads and
    `changes` shrinks them apart: multi-head latent attention (DeepSeek V2/V3, MiniCPM3) expands its latent into
    one key and value per head, so its kv heads must stay the head count.

    >>> from types import SimpleNamespace as Config
    >>> equal_heads(Config(num_attention_heads=128, num_key_value_heads=128),
    ...             {"num_attention_heads": 4, "num_key_value_heads": 2})
    {'num_key_value_heads': 4}
    """
    heads, kv = "num_attention_heads", "num_key_value_heads"
    if isinstance(_read(config, heads), int) and _read(config, heads) == _read(config, kv) and heads in changes \
            and changes.get(kv) != changes[heads]:
        return {kv: changes[heads]}
    return {}


def head_dim(config, changes: dict) -> dict:
    """{"head_dim": the small width over the small head count} for a config whose `head_dim` is None: Ministral and
    Hunyuan read it as given (`getattr(config, "head_dim", width // heads)` finds None) where others derive it.

    >>> from types import SimpleNamespace as Config
    >>> head_dim(Config(head_dim=None, hidden_size=4096, num_attention_heads=32),
    ...          {"hidden_size": 32, "num_attention_heads": 4})
    {'head_dim': 8}
    """
    width = _small_head_width(config, changes)
    if "head_dim" in vars(config) and _read(config, "head_dim") is None and width is not None:
        return {"head_dim": width}
    return {}


def rotary_dim(config, changes: dict) -> dict:
    """{"rotary_dim": the small head width} where a config rotates more dims than a small head has (GPT-J and
    CodeGen rotate 64 of each head's dims; at width 32 over 4 heads a head has 8).

    >>> from types import SimpleNamespace as Config
    >>> rotary_dim(Config(rotary_dim=64, n_embd=4096, n_head=16), {"n_embd": 32, "n_head": 4})
    {'rotary_dim': 8}
    """
    rotated, width = _read(config, "rotary_dim"), _small_head_width(config, changes)
    if isinstance(rotated, int) and width is not None and rotated > width:
        return {"rotary_dim": width}
    return {}


def _small_head_width(config, changes: dict) -> int | None:
    """The small model's width over its head count (`changes` over `config`'s own, under either family of names)."""
    def small(*names):  # a changed name first: `hidden_size` may read a config's `n_embd` unchanged
        found = [changes[n] for n in names if n in changes] + [_read(config, n) for n in names]
        return next((v for v in found if isinstance(v, int)), None)
    width, heads = small("hidden_size", "n_embd"), small("num_attention_heads", "n_head")
    return width // heads if width is not None and heads else None


def _read(config, name: str):
    """`config.name`, or None where the config refuses to give one value (Gemma 4 raises on a global read of a
    field that varies per layer: the small value is then the per-layer configs' business)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 (transformers' per-layer access errors are not AttributeErrors)
        return None


def _is_config(value) -> bool:
    return hasattr(value, "to_dict") and hasattr(value, "model_type") and not isinstance(value, type)


def _transformers():
    import transformers
    transformers.logging.set_verbosity_error()  # no warnings or banners from building tiny models
    transformers.logging.disable_progress_bar()
    return transformers


@functools.cache
def families() -> dict[str, str]:
    """{model type: head} of every family with a trainable head in the installed transformers, sorted.

    >>> len(families()) > 300, families()["t5"], families()["wav2vec2"], families()["clip"]
    (True, 'seq2seq-lm', 'ctc', 'contrastive')
    """
    from transformers.models.auto import modeling_auto
    found = {}
    for mapping, head in HEAD_MAPPINGS:
        for family in getattr(modeling_auto, mapping, {}):
            found.setdefault(family, head)
    return dict(sorted(found.items()))


def model_class_name(family: str) -> str:
    """The transformers class of `family`'s head.

    >>> model_class_name("gpt2"), model_class_name("vit")
    ('GPT2LMHeadModel', 'ViTForImageClassification')
    """
    from transformers.models.auto import modeling_auto
    head = families()[family]
    name = next(m for m, h in HEAD_MAPPINGS if h == head)
    cls = getattr(modeling_auto, name)[family]
    return cls[0] if isinstance(cls, (list, tuple)) else cls


def model_loss(outputs, *inputs):
    """The model's own training loss: the `loss` field of the transformers output.

    >>> model_loss({"loss": torch.tensor(2.0)})
    tensor(2.)
    """
    return outputs["loss"]


_POSITIONAL: dict = {}


def positional(model, names: tuple[str, ...], fixed: tuple = ()):
    """`model` whose forward takes the tensors `names` positionally, plus the keyword arguments `fixed`
    (pairs) on every call; its class becomes a cached subclass of its transformers class.

    >>> m = positional(torch.nn.Linear(2, 2), ("input",))
    >>> type(m).__name__, m(torch.ones(1, 2)).shape
    ('Linear', torch.Size([1, 2]))
    """
    base = getattr(type(model), "positional_base", type(model))  # a model made positional before: its original class
    key = (base, names, fixed)
    cls = _POSITIONAL.get(key)
    if cls is None:
        def forward(self, *inputs):
            return base.forward(self, **dict(zip(names, inputs)), **dict(fixed))
        forward.__doc__ = f"{base.__name__}.forward({', '.join(names)}) with positional tensors"
        cls = type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__, "positional_base": base,
                                            "__doc__": f"{base.__name__} whose forward takes ({', '.join(names)})"})
        _POSITIONAL[key] = cls
    model.__class__ = cls
    return model


def _find(config, *names, default=None):
    """The first integer field among `names` in `config` or its sub-configs (depth first)."""
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    for value in vars(config).values():
        if _is_config(value):
            found = _find(value, *names)
            if found is not None:
                return found
    return default


def _tokens(config, shape):
    vocab = _find(config, "vocab_size", default=VOCAB)
    return torch.randint(3, max(vocab, 4), shape)


def candidate_inputs(model, head: str):
    """Candidate (names, tensors, fixed keyword pairs) batches for `model`'s head, most likely first.

    >>> model, inputs, _ = build("vit")
    >>> [names for names, _, _ in candidate_inputs(model, "image-classification")][0]
    ('pixel_values', 'labels')
    """
    config = model.config
    main = getattr(model, "main_input_name", "input_ids")
    labels_of = {
        "causal-lm": lambda x: x.clone(),
        "seq2seq-lm": lambda x: _tokens(config, (BATCH, SEQ)),
        "speech-seq2seq": lambda x: _tokens(config, (BATCH, SEQ)),
        "ctc": lambda x: _tokens(config, (BATCH, 2)),
        "token-classification": lambda x: torch.randint(0, CLASSES, (BATCH, SEQ)),
    }
    if head == "masked-lm":
        def masked(x):
            labels = torch.full_like(x, -100) if x.dtype == torch.long else torch.full((BATCH, SEQ), -100)
            labels[:, ::2] = x[:, ::2] if x.dtype == torch.long else 5
            return labels
        labels_of[head] = masked
    label = labels_of.get(head, lambda x: torch.randint(0, CLASSES, (BATCH,)))
    if head == "contrastive":  # text and images, the model's own contrastive loss
        ids = _tokens(config, (BATCH, SEQ))
        return [(("input_ids", "pixel_values"), (ids, x), (("return_loss", True),))
                for x in _main_inputs(config, "pixel_values")]
    return [((main, "labels"), (x, label(x)), ()) for x in _main_inputs(config, main)]


def _main_inputs(config, main: str) -> list:
    """Candidate tensors for the model's main input."""
    if main == "input_ids":
        return [_tokens(config, (BATCH, SEQ))]
    if main in ("pixel_values", "pixel_values_videos"):
        channels = _find(config, "num_channels", default=3)
        size = _find(config, "image_size", "img_size", default=IMAGE)
        frames = _find(config, "num_frames", default=None)
        shapes = [(BATCH, channels, size, size), (BATCH, channels, IMAGE, IMAGE), (BATCH, channels, 224, 224)]
        if frames is not None:
            shapes = [(BATCH, frames, channels, size, size), (BATCH, channels, frames, size, size)] + shapes
        return [torch.randn(s) for s in shapes]
    if main == "input_values":
        bins, frames = _find(config, "num_mel_bins"), _find(config, "max_length")
        spectrogram = [torch.randn(BATCH, frames, bins)] if bins and frames else []  # e.g. AST: [frames, mel bins]
        return [torch.randn(BATCH, n) for n in (3200, 16000)] + spectrogram
    if main == "input_features":
        bins = _find(config, "num_mel_bins", "input_feat_size", "feature_size", default=80)
        source = _find(config, "max_source_positions", default=None)
        lengths = [2 * source] if source else []
        lengths += [64, 128]
        return [torch.randn(BATCH, bins, n) for n in lengths] + [torch.randn(BATCH, n, bins) for n in lengths]
    return [_tokens(config, (BATCH, SEQ))]


class BuildError(RuntimeError):
    """No tiny instance of a family could be built, or its forward ran on no candidate batch.

    >>> str(BuildError("x"))
    'x'
    """


def build(family: str):
    """(model, example_inputs, model_loss) of `family`: the tiny random model of its head (training mode) and
    the first candidate batch on which its forward returns a loss. A config the rules cannot shrink is built
    again with the fields its config ties together kept tied (`per_layer_lists`, `equal_heads`, `decoder_start`,
    `head_dim`, `rotary_dim`), then with only its layer counts and dropouts shrunk.

    >>> model, (ids, labels), _ = build("distilbert")
    >>> type(model).__name__, int((labels != -100).sum())  # masked LM: every other position
    ('DistilBertForMaskedLM', 16)
    """
    transformers = _transformers()
    head = families()[family]
    model_cls = getattr(transformers, model_class_name(family))
    config_cls = model_cls.config_class
    defaults = config_cls()
    changes = tiny_config(defaults)
    tied = {**per_layer_lists(defaults, changes), **equal_heads(defaults, changes), **decoder_start(defaults),
            **head_dim(defaults, changes), **rotary_dim(defaults, changes)}
    attempts = [changes, {**changes, **tied},
                {k: v for k, v in changes.items() if _DROPOUT.search(k) or re.search(r"layers$|depth", k)}]
    errors = []
    for kwargs in attempts:
        try:
            config = config_cls(**kwargs, **({"num_labels": CLASSES} if "classification" in head else {}))
            if hasattr(config, "use_cache"):
                config.use_cache = False
            with torch.device("meta"):  # sized before anything is allocated
                size = sum(p.numel() for p in model_cls._from_config(config).parameters())
            if size > MAX_PARAMETERS:
                raise BuildError(f"{size / 1e6:.0f}M parameters after shrinking, over {MAX_PARAMETERS / 1e6:.0f}M")
            torch.manual_seed(0)
            model = model_cls._from_config(config)
            model.train()
        except Exception as exc:  # noqa: BLE001 (the next attempt, then a BuildError naming each)
            errors.append(f"{type(exc).__name__}: {_first_line(exc)}")
            continue
        for names, tensors, fixed in candidate_inputs(model, head):
            torch.manual_seed(0)
            positional(model, names, fixed)
            try:
                loss = model_loss(model(*tensors))
                if loss is None or loss.dim() != 0:
                    raise ValueError("the model returned no scalar loss")
            except Exception as exc:  # noqa: BLE001 (any failure: the next candidate batch)
                errors.append(f"{names[0]} {tuple(tensors[0].shape)}: {type(exc).__name__}: {_first_line(exc)}")
                continue
            model.zero_grad(set_to_none=True)
            return model, tensors, model_loss
    raise BuildError(f"{family} ({head}): " + " / with layer counts only: ".join(dict.fromkeys(errors[:1] + errors[-1:])))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def __getattr__(name: str):
    """Each family as a zero-argument FACTORY: `autoshard.zoo.architectures:<family>`."""
    if name.startswith("__") or name not in families():
        raise AttributeError(name)
    factory = functools.partial(build, name)
    factory.__name__ = name
    return factory
