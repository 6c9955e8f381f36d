"""transformers' mixture-of-experts families as autoshard FACTORIES: Qwen2-MoE here, Mixtral in
autoshard/zoo/transformers_families.py (both tiny, random weights, the family's own training loss).

transformers routes tokens by sorting them by expert, with per-expert counts that depend on the data, and
runs the experts as `torch._grouped_mm` (the default; no float64 kernel on the CPU, so verify compares in
float32) or as `batched_mm` (each token's expert weights gathered, then a bmm). Both trace with
torch.export and plan; the experts' stacked weights ``[E, out, in]`` shard on their feature dims (tensor
parallel) but not on the expert dim: a row block of the sorted tokens belongs to an expert only through
the data. A hint sharding the expert dim (expert parallelism) is therefore gathered before the grouped
matmul, with a warning naming the op; autoshard/zoo/moe.py is the MoE model whose routing has fixed
shapes and whose experts shard.

>>> model, inputs, loss_fn = qwen2_moe()
>>> model.model.layers[0].mlp.experts.gate_up_proj.shape  # [experts, 2 * moe ffn, hidden]
torch.Size([4, 64, 32])
>>> loss_fn(model(*inputs), *inputs).dim()
0
"""
from __future__ import annotations

from autoshard.zoo.transformers_families import (
    DECODER,
    causal_lm,
    mixtral_grouped_mm,
)
from autoshard.zoo.transformers_hints import DATA_PARALLEL

_QWEN2_MOE = {**DECODER, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
              "shared_expert_intermediate_size": 64, "norm_topk_prob": True, "output_router_logits": True,
              "router_aux_loss_coef": 0.01}


def qwen2_moe():
    """Qwen2MoeForCausalLM: 4 routed experts (top-2, gates renormalised) plus a gated shared expert, the
    load-balancing loss in the training loss; experts as `torch._grouped_mm` (verify in float32).

    >>> model, inputs, loss_fn = qwen2_moe()
    >>> model.config._experts_implementation, model.model.layers[0].mlp.shared_expert.gate_proj.out_features
    ('grouped_mm', 64)
    """
    return causal_lm("Qwen2MoeForCausalLM", "Qwen2MoeConfig", **_QWEN2_MOE)


# The routed experts' stacked weights of each family (hint globs), and the hint that asks for expert
# parallelism on an axis named "ep" (the tokens' batch dim on it too).
EXPERT_WEIGHTS = {"mixtral": ["model.layers.*.mlp.experts.gate_up_proj", "model.layers.*.mlp.experts.down_proj"],
                  "qwen2_moe": ["model.layers.*.mlp.experts.gate_up_proj", "model.layers.*.mlp.experts.down_proj"]}
FACTORIES = {"mixtral": mixtral_grouped_mm, "qwen2_moe": qwen2_moe}


def expert_parallel_hints(family: str, axis: str = "ep") -> dict:
    """Hints asking for the experts sharded on `axis` (dim 0 of their stacked weights) and the batch there.

    >>> expert_parallel_hints("qwen2_moe")["model.layers.*.mlp.experts.down_proj"]
    {'ep': 'S(0)'}
    """
    hints = {key: {axis: value["dp"]} for key, value in DATA_PARALLEL.items()}
    hints.update({glob: {axis: "S(0)"} for glob in EXPERT_WEIGHTS[family]})
    return hints
