"""Context parallelism (issue 18): attention with its sequence split over a mesh axis.

Tier 1: the ring's numerics against torch's attention (outputs and gradients; causal zigzag, masks, fully masked
rows, grouped-query heads; 2, 3, 4 ranks, so more chunks than ranks), the hint key, refusals, the cost formulas.
Tier 2 (simulator, float64): zoo Llama, zoo GPT-2 and transformers' Llama train like one device with each strategy
(allgather, ring, alltoall) on (2,), (4,) and (2, 2) cp x tp; the bytes each rank counts equal the plan's prediction.
By default three cells run (every model, strategy and mesh once), one composition (dp x cp x tp with ZeRO-3 and
recomputation) and the ring on ALiBi; AUTOSHARD_FULL_MATRIX=1 runs all 27 cells, bf16, pipelines and the other
strategies on ALiBi. Learned positions: GPT-2; gloo: tests/multirank/test_context_parallel_gloo.py.
"""
import itertools
import os

import pytest
import torch
import torch.nn.functional as F

import autoshard
from autoshard.cost.attention_cost import RingBlocks, ring_cost
from autoshard.cost.profiles import Link
from autoshard.frontend.hints import Hints
from autoshard.ir.errors import HintError, UserInputError
from autoshard.ir.mesh import Mesh
from autoshard.runtime.context_parallel import causal_rows_mask, ring_attention
from autoshard.runtime.simulator import run_on_mesh
from autoshard.verify.verify import verify_factory
from autoshard.zoo import gpt2, llama
from autoshard.zoo.hints import plan_hints
from autoshard.zoo.transformers_hints import HINTS as TRANSFORMERS_HINTS

FULL = os.environ.get("AUTOSHARD_FULL_MATRIX") == "1"
pytestmark = pytest.mark.filterwarnings("ignore:autoshard. the hint")  # gathered sequence hints are reported


# --- tier 1: the ring against torch's attention ------------------------------------------------------------------

def _ring_case(n, causal, gqa, masked, length=24):
    torch.manual_seed(n)
    heads, kv_heads = 4, (2 if gqa else 4)
    q = torch.randn(2, heads, length, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, length, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = None
    if masked:
        mask = torch.rand(2, 1, length, length) > 0.3
        mask[0, 0, 3] = False  # a row that sees nothing: its output is 0, as torch's math kernel gives
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    weight = torch.randn_like(out)
    (out * weight).sum().backward()
    c = length // n

    def rank(comm):
        rows = slice(c * comm.axis_rank("cp"), c * comm.axis_rank("cp") + c)
        ql, kl, vl = (t.detach()[..., rows, :].clone().requires_grad_() for t in (q, k, v))
        o = ring_attention(ql, kl, vl, mask[..., rows, :] if masked else None, is_causal=causal, enable_gqa=gqa,
                           axis="cp")
        (o * weight[..., rows, :]).sum().backward()
        return o.detach(), ql.grad, kl.grad, vl.grad

    parts = run_on_mesh(Mesh((n,), ("cp",)), rank)
    got = [torch.cat([parts[r][i] for r in range(n)], -2) for i in range(4)]
    return got, [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("n,causal,gqa,masked", [c for c in itertools.product((2, 3, 4), (True, False), (False, True),
                                                                              (False, True)) if not (c[1] and c[3])])
def test_ring_attention_equals_torch_attention(n, causal, gqa, masked):
    got, want = _ring_case(n, causal, gqa, masked)
    for name, g, w in zip(("output", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")


def test_causal_rows_mask_is_the_rows_of_the_whole_causal_mask():
    whole = torch.ones(8, 8, dtype=torch.bool).tril()
    assert torch.equal(causal_rows_mask(torch.zeros(4, 2), torch.zeros(8, 2), 4), whole[4:])


def test_ring_refuses_attention_dropout_and_learned_masks():
    def rank(comm, **kwargs):
        x = torch.zeros(1, 1, 4, 2)
        return ring_attention(x, x, x, axis="cp", **kwargs)
    with pytest.raises(RuntimeError, match="ring attention has no attention dropout"):
        run_on_mesh(Mesh((2,), ("cp",)), lambda comm: rank(comm, dropout_p=0.1))
    with pytest.raises(RuntimeError, match="constant attention mask"):
        run_on_mesh(Mesh((2,), ("cp",)), lambda comm: rank(comm, attn_mask=torch.zeros(4, 4, requires_grad=True)))


def test_ring_cost_counts_what_the_ring_sends():
    """Two ranks, causal: one shift of k and v forward, one backward with two gradient shifts, plus the zigzag
    reordering of q, k, v and the output each way; the same figures the verify cases compare with the ranks' logs."""
    cost = ring_cost(2, True, RingBlocks(q=100, kv=200, out=100), compute_s=0.0, link=Link(0.0, 1.0))
    assert (cost.fwd_bytes, cost.bwd_bytes) == (200 + 400, 200 + 2 * 200 + 400)


# --- hints ---------------------------------------------------------------------------------------------------------

def test_attention_hint_names_a_strategy():
    with pytest.raises(HintError, match="context-parallel strategy .'allgather' | 'ring' | 'alltoall'"):
        Hints.parse({"layers.*.attn:attention": {"cp": "ulysses"}})
    assert Hints.parse({"*:attention": {"cp": "ring"}}).to_json() == {"*:attention": {"cp": "ring"}}


def test_attention_hint_matching_no_attention_is_an_error():
    model, inputs, loss_fn = llama(batch=2, seq=8, n_layers=1)
    with pytest.raises(HintError, match="matches no attention"):
        autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("cp",),
                              hints={"input:0": {"cp": "S(1)"}, "layers.*.mlp:attention": {"cp": "ring"}})


def test_ring_is_refused_on_an_attention_with_dropout():
    model, inputs, loss_fn = llama(batch=2, seq=8, n_layers=1, dropout=0.1)
    with pytest.raises(HintError, match="'ring' on mesh axis 'cp' cannot be used at layers.0.attn .* the ring has no "
                                        "attention dropout .this attention drops 0.1.; use 'allgather' or 'alltoall'"):
        autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("cp",),
                              hints={"input:0": {"cp": "S(1)"}, "*:attention": {"cp": "ring"}})


def test_a_ring_plan_saves_and_reapplies(tmp_path):
    model, inputs, loss_fn = gpt2(batch=2, seq=8, n_layers=1)
    hints = {"input:0": {"cp": "S(1)"}, "*:attention": {"cp": "ring"}}
    prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("cp",), hints=hints)
    rows = [r for r in prog.plan.to_json()["nodes"] if r["op"] == "scaled_dot_product_attention.default"]
    assert [r["choice"][0].get("method") for r in rows] == ["ring"]
    path = tmp_path / "plan.json"
    prog.plan.save(path)
    again = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("cp",), plan=str(path))
    assert again.plan.fingerprint == prog.plan.fingerprint


def test_one_axis_splits_an_attention_sequence():
    """cp x tp with ring on cp: tp may split heads or batch, never the sequence a second time."""
    model, inputs, loss_fn = llama(batch=2, seq=8, n_layers=1)
    prog = autoshard.parallelize(model, (2, 2), inputs, loss_fn=loss_fn, axis_names=("cp", "tp"),
                                 hints={"input:0": {"cp": "S(1)"}, "*:attention": {"cp": "ring"}})
    for node in prog.state.gm.graph.nodes:
        if node.target is torch.ops.aten.scaled_dot_product_attention.default:
            seq = node.args[0].meta["val"].dim() - 2
            assert [repr(p) for p in node.meta["autoshard.in_specs"][0]].count(f"S({seq})") == 1


# --- tier 2: models train like one device (simulator, float64) ----------------------------------------------------

MESHES = {"2": ((2,), ("cp",)), "4": ((4,), ("cp",)), "2x2": ((2, 2), ("cp", "tp"))}
MODELS = {"llama": "autoshard.zoo:llama", "gpt2": "autoshard.zoo:gpt2",
          "transformers-llama": "autoshard.zoo.transformers_families:llama"}
# Default: every model, every strategy and every mesh once (the diagonal of a Latin square); the full matrix
# runs all 27 (about a minute).
DEFAULT = {("llama", "ring", "4"), ("gpt2", "alltoall", "2x2"), ("transformers-llama", "allgather", "2")}
CASES = [c for c in itertools.product(MODELS, ("allgather", "ring", "alltoall"), MESHES) if FULL or c in DEFAULT]


def cp_hints(model: str, method: str, names) -> dict:
    """The sequence of every input on cp, the strategy asked for, and Megatron's tensor parallelism on tp."""
    transformers = model.startswith("transformers")
    # The tokens stay split entering the q, k, v projections, so that the strategy (not a gather before them)
    # is what the attention does with them.
    projections = "model.layers.*.self_attn.[qkv]_proj" if transformers else "layers.*.attn.[qkv]"
    hints = {"input:0": {"cp": "S(1)"}, f"{projections}:input": {"cp": "S(1)"}, "*:attention": {"cp": method}}
    if transformers:
        hints["input:1"] = {"cp": "S(1)"}  # the labels
    if "tp" in names:
        tp = TRANSFORMERS_HINTS["llama"] if transformers else plan_hints(model, names, (), "tp")
        hints.update({k: v for k, v in tp.items() if "tp" in v})
    return hints


@pytest.mark.parametrize("model,method,mesh", CASES, ids=["-".join(c) for c in CASES])
def test_context_parallel_trains_like_one_device(model, method, mesh):
    shape, names = MESHES[mesh]
    report, program = verify_factory(MODELS[model], shape, names, hints=cp_hints(model, method, names), steps=2,
                                     simulate=True)
    assert report.ok, f"{model} {method} on {shape}:\n{report}"
    cp = report.collectives["cp"]
    if method == "ring":
        assert cp["send_recv"]["fwd"] > 0 and cp["send_recv"]["bwd"] > 0
    elif method == "allgather":
        assert "send_recv" not in cp and cp["all_gather"]["fwd"] > 0
    else:
        assert "send_recv" not in cp and cp["all_to_all"]["fwd"] >= 4  # q, k, v in and the output back per layer
    if "tp" in names:
        assert report.collectives["tp"]["all_reduce"]["fwd"] > 0  # Megatron's tensor parallelism on tp too
    for axis, kinds in report.collectives.items():
        counted = sum(k["bytes"] for k in kinds.values())
        assert counted == sum(program.plan.predicted["comm_bytes_per_step"][axis].values()), axis


class AlibiAttention(torch.nn.Module):
    """A causal self-attention whose positions are ALiBi biases (Press et al.) passed to SDPA as its mask."""

    def __init__(self, dim=16, heads=4, seq=16, vocab=32):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, vocab)
        self.heads = heads
        self.register_buffer("slopes", 2.0 ** (-8.0 * torch.arange(1, heads + 1) / heads), persistent=False)

    def forward(self, ids):
        b, t = ids.shape
        q, k, v = self.qkv(self.embed(ids)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        pos = torch.arange(t, device=ids.device)
        distance = (pos[None, :] - pos[:, None]).to(q.dtype)  # j - i: global positions of rows and keys
        bias = self.slopes.to(q.dtype)[:, None, None] * distance
        bias = bias.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


def alibi_model():
    torch.manual_seed(0)
    model = AlibiAttention()
    ids = torch.randint(0, 32, (2, 16))
    return model, (ids,), lambda logits, ids: F.cross_entropy(logits.flatten(0, 1), ids.flatten())


@pytest.mark.parametrize("method", ["ring"] + (["allgather", "alltoall"] if FULL else []))
def test_alibi_positions_are_global_on_every_rank(method):
    report, _ = verify_factory("test_context_parallel:alibi_model", (4,), ("cp",), steps=2, simulate=True,
                               hints={"input:0": {"cp": "S(1)"}, "*:attention": {"cp": method}})
    assert report.ok, report


class HeadlessAttention(torch.nn.Module):
    """q, k, v of [B, L, E] (no head dim): the sequence is dim 1."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.lin(x).chunk(3, -1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def headless_model():
    torch.manual_seed(0)
    return HeadlessAttention(), (torch.randn(2, 8, 8),)


def test_ring_on_an_attention_without_heads():
    report, _ = verify_factory("test_context_parallel:headless_model", (2,), ("cp",), steps=1, simulate=True,
                               hints={"input:0": {"cp": "S(1)"}, "*:attention": {"cp": "ring"}})
    assert report.ok, report


def test_ring_refuses_an_unrunnable_strategy_cleanly():
    with pytest.raises(UserInputError):
        ring_attention(torch.zeros(1), torch.zeros(1), torch.zeros(1), dropout_p=0.5, axis="cp")


# --- composition with dp, pp, ZeRO, recomputation, mixed precision on 3-axis meshes (simulator) -------------------

COMPOSED = {
    "dp-cp-tp-ring-zero3-recompute": (("dp", "cp", "tp"), "ring", {"zero": {"dp": 3}, "checkpoint": ["layers.0", "layers.1"]}),
}
if FULL:
    COMPOSED.update({
        "dp-cp-tp-alltoall-bf16": (("dp", "cp", "tp"), "alltoall", {"mixed_precision": "bf16"}),
        "pp-cp-tp-allgather": (("pp", "cp", "tp"), "allgather", {}),
        "dp-cp-tp-allgather-zero1-recompute": (("dp", "cp", "tp"), "allgather",
                                               {"zero": {"dp": 1}, "checkpoint": ["layers.0", "layers.1"]}),
        "dp-cp-tp-ring-bf16": (("dp", "cp", "tp"), "ring", {"mixed_precision": "bf16"}),
        "pp-cp-tp-ring": (("pp", "cp", "tp"), "ring", {}),
        "pp-cp-tp-alltoall-recompute": (("pp", "cp", "tp"), "alltoall", {"checkpoint": ["layers.0", "layers.1"]}),
    })


@pytest.mark.parametrize("case", sorted(COMPOSED))
def test_context_parallel_composes(case):
    names, method, options = COMPOSED[case]
    hints = cp_hints("llama", method, names)
    if "dp" in names:
        hints["input:0"] = {**hints["input:0"], "dp": "S(0)"}
    report, _ = verify_factory(MODELS["llama"], (2, 2, 2), names, hints=hints, steps=2, simulate=True, **options)
    assert report.ok, f"{case}:\n{report}"
    assert sum(k["fwd"] for k in report.collectives["cp"].values()) > 0


@pytest.mark.parametrize("method", ["allgather", "alltoall"])
def test_attention_dropout_draws_the_single_device_masks(method):
    """rng='exact': each rank's attention dropout mask is its block of the single device's (rows for allgather,
    heads for alltoall); the ring refuses attention dropout (test_ring_is_refused_on_an_attention_with_dropout)."""
    report, _ = verify_factory("test_context_parallel:llama_dropout", (2,), ("cp",), steps=2, simulate=True,
                               hints={"input:0": {"cp": "S(1)"}, "*:attention": {"cp": method}})
    assert report.ok, report
    assert report.random_ops


def llama_dropout():
    """The zoo Llama with dropout 0.1 (attention weights and residual branches)."""
    return llama(batch=2, seq=8, n_layers=1, dropout=0.1)


def eager_llama():
    """transformers' Llama with its unfused ("eager") attention: matmul, scale, + causal mask, softmax, matmul."""
    from autoshard.zoo.transformers_families import DECODER, causal_lm
    return causal_lm("LlamaForCausalLM", "LlamaConfig", attn_implementation="eager", **DECODER)


EAGER = ["ring"] + (["allgather", "alltoall"] if FULL else [])


@pytest.mark.parametrize("method", EAGER)
def test_an_unfused_attention_is_fused_and_takes_every_strategy(method):
    hints = {"input:0": {"cp": "S(1)"}, "input:1": {"cp": "S(1)"},
             "model.layers.*.self_attn.[qkv]_proj:input": {"cp": "S(1)"}, "*:attention": {"cp": method}}
    report, program = verify_factory("test_context_parallel:eager_llama", (2,), ("cp",), hints=hints, steps=2,
                                     simulate=True)
    assert report.ok, report
    ops = [n.target for n in program.state.gm.graph.nodes]
    assert ops.count(torch.ops.aten.scaled_dot_product_attention.default) == 2  # one per layer
    assert torch.ops.aten.softmax.int not in ops


class HandWritten(torch.nn.Module):
    """Attention written out: scores scaled, masked with masked_fill(-inf), softmax, optional dropout, a bias."""

    def __init__(self, dropout=0.0, learned_bias=False):
        super().__init__()
        self.dropout = torch.nn.Dropout(dropout)
        self.bias = torch.nn.Parameter(torch.zeros(8, 8)) if learned_bias else None

    def forward(self, q, k, v):
        scores = q @ k.transpose(-2, -1) * 0.5
        if self.bias is not None:
            scores = scores + self.bias
        causal = torch.ones(8, 8, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(causal, float("-inf")) if self.bias is None else scores
        return self.dropout(torch.softmax(scores, dim=-1)) @ v


@pytest.mark.parametrize("kwargs,fused", [({}, True), ({"dropout": 0.1}, False), ({"learned_bias": True}, False)])
def test_fusion_keeps_the_values_and_leaves_what_it_cannot_fuse(kwargs, fused):
    torch.manual_seed(0)
    model = HandWritten(**kwargs)
    qkv = tuple(torch.randn(2, 4, 8, 4, dtype=torch.float64) for _ in range(3))
    prog = autoshard.parallelize(model.double(), (2,), qkv, axis_names=("cp",))
    ops = [n.target for n in prog.state.gm.graph.nodes]
    assert (torch.ops.aten.scaled_dot_product_attention.default in ops) is fused
    if fused:
        model.eval()
        _, out = prog.simulate(*qkv)
        torch.testing.assert_close(out, model(*qkv), rtol=1e-12, atol=1e-12)


class LearnedBias(torch.nn.Module):
    """SDPA with a trained additive bias as its mask: no ring for it (the ring takes constant masks)."""

    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(8, 8))

    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)


def test_no_ring_for_a_learned_mask():
    qkv = tuple(torch.randn(2, 4, 8, 4) for _ in range(3))
    with pytest.raises(HintError, match="computed from a trained parameter"):
        autoshard.parallelize(LearnedBias(), (2,), qkv, axis_names=("cp",),
                              hints={"input:0": {"cp": "S(2)"}, "*:attention": {"cp": "ring"}})
    prog = autoshard.parallelize(LearnedBias(), (2,), qkv, axis_names=("cp",))  # automatic: never a ring
    assert not any(c.method == "ring" for n in prog.state.gm.graph.nodes for c in n.meta.get("autoshard.choice", ()))
