"""Mixture-of-experts LLaMA: the zoo LLaMA whose feed-forward is a top-k routed mixture of SwiGLU experts.

Routing is data dependent; here it is written with fixed shapes (GShard's capacity formulation), so it
traces with torch.export (no unbacked sizes, no data-dependent branches) and every op has an ordinary
sharding rule:

1. tokens ``[B, T, D]`` are reshaped into groups ``[G, S, D]`` of ``group_size`` S tokens each (G = B*T/S;
   a model hyperparameter, not tied to any mesh). The group size, not the number of groups, is fixed, so
   a group's routing does not depend on the rest of the batch: a pipeline's micro-batches and gradient
   accumulation's slices (whole groups each) route exactly as the whole batch does;
2. the router (a linear ``D -> E``, plus an optional fixed `router_bias` to skew the routing) gives
   probabilities over the E experts; each token picks its top-k experts; the k gates are renormalised to
   sum to 1 over the chosen experts (Mixtral's rule);
3. each expert takes at most C = ceil(capacity_factor * S * k / E) tokens per group (at most S). Slots are
   given in priority order: every token's first choice before any second choice, tokens in order within
   a choice (GShard); a choice past its expert's capacity is dropped (it adds 0; the residual carries the
   token on, and its gate is not renormalised over the surviving choices);
4. the slot of each choice is a cumulative sum over the group of the one-hot expert mask (integers,
   exact in any dtype); the dispatch mask ``[G, S, E, C]`` is built from pointwise comparisons with
   ``arange(E)`` and ``arange(C)`` (no scatter, no sort), and the combine weights are the same mask times
   the gates;
5. ``gsec,gsd->gecd`` dispatches, the experts are batched einsums over stacked weights ``w1, w3 [E, D, F]``
   and ``w2 [E, F, D]``, and ``gsec,gecd->gsd`` combines.

Parallelism is then placements: data parallel shards G; expert parallel moves ``[G, E, C, D]`` from
sharded groups to sharded experts (``S(0) -> S(1)``: one all-to-all there and one back, each way) with the
expert weights sharded on E; tensor parallel shards F. The planner chooses among them by cost.

What the formulation costs: every expert computes C slots per group whatever the routing (E*C ~
capacity_factor * k * S token-expert products instead of k * S), the dispatch and combine einsums cost
2 * S*E*C*D multiply-adds each per group, and the masks ``[G, S, E, C]`` (several, kept for the backward)
take G*S*E*C elements each. Load imbalance costs no extra compute or communication (the shapes are fixed):
it shows as dropped tokens, which the model's quality pays, not its step time.

The Switch-Transformer load-balancing loss (E * sum_e f_e * p_e, f_e the fraction of a group's tokens whose
first choice is e, p_e the group's mean router probability of e), averaged over the groups as GShard does
(so it, too, is the same per micro-batch), is added to the loss with weight `aux_loss_coef`.

>>> model, (ids,), loss_fn = moe_llama()
>>> logits, aux = model(ids)
>>> logits.shape, model.layers[0].moe.w1.shape, model.layers[0].moe.capacity(16)
(torch.Size([8, 16, 64]), torch.Size([4, 32, 64]), 10)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autoshard.zoo.llama import Attention, Llama, LlamaConfig, RMSNorm, llama_loss


@dataclass
class MoEConfig(LlamaConfig):
    """A LlamaConfig plus the mixture's sizes (`ffn_dim` is each expert's hidden size).

    >>> MoEConfig().n_experts, MoEConfig().top_k
    (4, 2)
    """

    n_experts: int = 4
    top_k: int = 2
    group_size: int = 16  # tokens per routing group (S)
    capacity_factor: float = 1.25
    router_bias: tuple[float, ...] | None = None  # a fixed skew added to the router logits (uneven routing)
    aux_loss_coef: float = 0.01


def _uniform_(weight, fan_in):
    """nn.Linear's default initialisation (uniform within 1/sqrt(fan_in)) for a stacked expert weight."""
    bound = 1.0 / math.sqrt(fan_in)
    with torch.no_grad():
        weight.uniform_(-bound, bound)


class MoE(nn.Module):
    """Top-k routed SwiGLU experts with a fixed capacity per expert and group (see the module docstring).

    >>> moe = MoE(MoEConfig())
    >>> y, aux = moe(torch.randn(2, 8, 32))
    >>> y.shape, moe.w2.shape
    (torch.Size([2, 8, 32]), torch.Size([4, 64, 32]))
    """

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        E, D, Fd = cfg.n_experts, cfg.dim, cfg.ffn_dim
        self.n_experts, self.top_k, self.group_size = E, cfg.top_k, cfg.group_size
        self.capacity_factor, self.aux_loss_coef = cfg.capacity_factor, cfg.aux_loss_coef
        self.skew = cfg.router_bias
        self.router = nn.Linear(D, E, bias=False)
        self.w1 = nn.Parameter(torch.empty(E, D, Fd))
        self.w3 = nn.Parameter(torch.empty(E, D, Fd))
        self.w2 = nn.Parameter(torch.empty(E, Fd, D))
        if cfg.router_bias is not None:
            if len(cfg.router_bias) != E:
                raise ValueError(f"router_bias has {len(cfg.router_bias)} entries; give one per expert ({E})")
            self.register_buffer("router_bias", torch.empty(E), persistent=False)
        self.reset_parameters()

    def reset_parameters(self):
        """Experts as nn.Linear initialises its weights; the router's skew from the config.

        >>> moe = MoE(MoEConfig(router_bias=(1.0, 0.0, 0.0, 0.0))); moe.reset_parameters(); moe.router_bias.tolist()
        [1.0, 0.0, 0.0, 0.0]
        """
        _uniform_(self.w1, self.w1.shape[1])
        _uniform_(self.w3, self.w3.shape[1])
        _uniform_(self.w2, self.w2.shape[1])
        if self.skew is not None:
            with torch.no_grad():
                self.router_bias.copy_(torch.tensor(self.skew, dtype=self.router_bias.dtype))

    def capacity(self, tokens_per_group: int) -> int:
        """Slots per expert and group: ceil(capacity_factor * S * k / E), at most S (a token picks an
        expert at most once).

        >>> MoE(MoEConfig()).capacity(16), MoE(MoEConfig(capacity_factor=4.0)).capacity(16)
        (10, 16)
        """
        wanted = math.ceil(self.capacity_factor * tokens_per_group * self.top_k / self.n_experts)
        return max(1, min(tokens_per_group, wanted))

    def route(self, xg):
        """Group tokens ``[G, S, D]`` -> (dispatch mask, combine weights) ``[G, S, E, C]`` and the
        load-balancing loss (already times `aux_loss_coef`).

        >>> dispatch, combine, aux = MoE(MoEConfig(capacity_factor=0.5)).route(torch.randn(1, 16, 32))
        >>> dispatch.shape, int(dispatch.sum()) <= 4 * 4 < 2 * 16  # 4 slots per expert: most choices dropped
        (torch.Size([1, 16, 4, 4]), True)
        """
        G, S, _ = xg.shape
        E, K, C = self.n_experts, self.top_k, self.capacity(S)
        logits = self.router(xg)
        if self.skew is not None:
            logits = logits + self.router_bias
        probs = logits.softmax(-1)                                            # [G, S, E]
        gate, choice = probs.topk(K, dim=-1)                                  # [G, S, K]
        gate = gate / gate.sum(-1, keepdim=True)                              # Mixtral: renormalised over the top k
        experts = torch.arange(E, device=xg.device)
        chosen = choice.transpose(1, 2).unsqueeze(-1) == experts              # [G, K, S, E], choice-major
        hits = chosen.to(torch.int64)
        # 1-based queue position of each choice at its expert: first choices before second ones.
        position = (hits.reshape(G, K * S, E).cumsum(1).reshape(G, K, S, E) * hits).sum(-1)   # [G, K, S]
        slots = torch.arange(1, C + 1, device=xg.device)
        in_slot = (position.unsqueeze(-1) == slots).to(xg.dtype)              # [G, K, S, C]; none past C: dropped
        chosen = chosen.to(xg.dtype)
        dispatch = torch.einsum("gkse,gksc->gsec", chosen, in_slot)
        combine = torch.einsum("gkse,gksc->gsec", chosen * gate.transpose(1, 2).unsqueeze(-1), in_slot)
        # Switch Transformer's balancing loss per group, E * sum_e (share of first choices at e) * (mean
        # probability of e), averaged over the groups.
        share = chosen[:, 0].mean(1)                                          # [G, E]
        aux = self.aux_loss_coef * E * (share * probs.mean(1)).sum(-1).mean()
        return dispatch, combine, aux

    def forward(self, x):
        """x ``[B, T, D]`` -> (``[B, T, D]``, the load-balancing loss); B*T must divide into groups.

        >>> MoE(MoEConfig())(torch.randn(4, 8, 32))[0].shape
        torch.Size([4, 8, 32])
        """
        B, T, D = x.shape
        if (B * T) % self.group_size:
            raise ValueError(f"{B * T} tokens do not split into groups of {self.group_size} (group_size)")
        xg = x.reshape(B * T // self.group_size, self.group_size, D)
        dispatch, combine, aux = self.route(xg)
        expert_in = torch.einsum("gsec,gsd->gecd", dispatch, xg)                          # [G, E, C, D]
        hidden = F.silu(torch.einsum("gecd,edf->gecf", expert_in, self.w1)) * \
            torch.einsum("gecd,edf->gecf", expert_in, self.w3)
        expert_out = torch.einsum("gecf,efd->gecd", hidden, self.w2)
        y = torch.einsum("gsec,gecd->gsd", combine, expert_out)
        return y.reshape(B, T, D), aux


class MoEBlock(nn.Module):
    """Pre-norm block: x + attn(attn_norm(x)), then + moe(ffn_norm(x)); returns the block's balancing loss too.

    >>> [name for name, _ in MoEBlock(MoEConfig()).named_children()]
    ['attn_norm', 'attn', 'ffn_norm', 'moe']
    """

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.moe = MoE(cfg)

    def forward(self, x, cos, sin):
        """x ``[B, T, dim]`` and the RoPE tables -> (``[B, T, dim]``, balancing loss).

        >>> model = MoELlama(MoEConfig())
        >>> MoEBlock(MoEConfig())(torch.randn(2, 8, 32), model.rope_cos[:8], model.rope_sin[:8])[0].shape
        torch.Size([2, 8, 32])
        """
        x = x + self.attn(self.attn_norm(x), cos, sin)
        y, aux = self.moe(self.ffn_norm(x))
        return x + y, aux


class MoELlama(Llama):
    """Token ids ``[B, T]`` -> (logits ``[B, T, vocab]``, the layers' summed balancing loss).

    >>> type(MoELlama(MoEConfig()).layers[0].moe).__name__
    'MoE'
    """

    block_class = MoEBlock

    def forward(self, ids):
        """ids ``[B, T]`` (T <= max_seq) -> (logits, balancing loss).

        >>> logits, aux = MoELlama(MoEConfig())(torch.randint(0, 64, (2, 8)))
        >>> logits.shape, aux.dim()
        (torch.Size([2, 8, 64]), 0)
        """
        T = ids.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.tok_embeddings(ids)
        aux = None
        for layer in self.layers:
            x, layer_aux = layer(x, cos, sin)
            aux = layer_aux if aux is None else aux + layer_aux
        return self.output(self.norm(x)), aux


def moe_loss(outputs, ids):
    """Next-token cross-entropy of the logits plus the balancing loss.

    >>> ids = torch.randint(0, 64, (2, 16))
    >>> float(moe_loss((torch.zeros(2, 16, 64), torch.tensor(0.5)), ids) - llama_loss(torch.zeros(2, 16, 64), ids))
    0.5
    """
    logits, aux = outputs
    return llama_loss(logits, ids) + aux


def moe_llama(batch=8, seq=16, dim=32, n_heads=8, n_kv_heads=4, n_layers=2, ffn_dim=64, vocab_size=64,
              n_experts=4, top_k=2, group_size=16, capacity_factor=1.25, router_bias=None, aux_loss_coef=0.01,
              device="cpu"):
    """Build a tiny mixture-of-experts LLaMA; returns ``(model, (ids,), loss_fn)``. `router_bias` (one
    logit offset per expert) skews the routing; a small `capacity_factor` drops tokens.

    >>> model, inputs, loss_fn = moe_llama(n_experts=8)
    >>> loss_fn(model(*inputs), *inputs).dim(), model.layers[1].moe.w1.shape
    (0, torch.Size([8, 32, 64]))
    """
    torch.manual_seed(0)
    cfg = MoEConfig(vocab_size=vocab_size, max_seq=seq, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads,
                    n_layers=n_layers, ffn_dim=ffn_dim, n_experts=n_experts, top_k=top_k, group_size=group_size,
                    capacity_factor=capacity_factor, router_bias=router_bias, aux_loss_coef=aux_loss_coef)
    with torch.device(device):
        model = MoELlama(cfg)
    ids = torch.randint(0, vocab_size, (batch, seq), device=device)
    return model, (ids,), moe_loss


def moe_llama_dropped():
    """The MoE LLaMA at capacity factor 0.5: half of the token-expert choices find no slot and are dropped.

    >>> moe_llama_dropped()[0].layers[0].moe.capacity(16)
    4
    """
    return moe_llama(capacity_factor=0.5)


def moe_llama_uneven():
    """The MoE LLaMA with a router skewed towards experts 0 and 1 (logit offsets 2, 1, 0, 0) and room for
    every choice (capacity factor 2: C = S), so the experts' loads differ and nothing is dropped.

    >>> moe_llama_uneven()[0].layers[0].moe.capacity(16)
    16
    """
    return moe_llama(router_bias=(2.0, 1.0, 0.0, 0.0), capacity_factor=2.0)
