"""normalize: each rewrite's before/after op list, and the rewritten graph computes the same values."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoshard.frontend.trace import trace
from autoshard.ir import meta
from autoshard.ir.mesh import Mesh
from autoshard.passes.manager import CompileState
from autoshard.passes.normalize import normalize


def normalized(model, inputs, loss_fn=None):
    """(original, normalized) traces of the same model in float64 (a rewrite reorders float sums, so
    float32 differs by round-off); both hold the model's own tensors."""
    model = model.double()
    inputs = tuple(x.double() if x.is_floating_point() else x for x in inputs)
    before = trace(model, inputs, loss_fn)
    after = trace(model, inputs, loss_fn)
    normalize(CompileState(after.gm, Mesh((2,), ("dp",)), after, None))
    return before, after


def ops(traced) -> list[str]:
    """Targets of the graph's calls, e.g. 'aten.linear.default' ('getitem' for operator.getitem)."""
    return [str(n.target) if isinstance(n.target, torch._ops.OpOverload) else n.target.__name__
            for n in traced.gm.graph.nodes if n.op == "call_function"]


def run(traced, inputs, grad=False):
    """Run the traced step on real tensors: (flat outputs, buffers after, parameter grads)."""
    params = {k: v.detach().clone().requires_grad_(grad and v.is_floating_point()) for k, v in traced.params.items()}
    buffers = {k: v.clone() for k, v in traced.buffers.items()}
    inputs = [x.double() if x.is_floating_point() else x for x in inputs]  # the traces are float64
    args = []
    for node in traced.gm.graph.nodes:
        if node.op != "placeholder":
            continue
        kind, path = node.meta[meta.KIND], node.meta[meta.PATH]
        args.append(params[path] if kind == "param" else buffers[path] if kind == "buffer"
                    else inputs[int(path.split(":")[1])])
    outs = traced.gm(*args)
    grads = {}
    if grad:
        grads = dict(zip(params, torch.autograd.grad(outs[0], list(params.values()), allow_unused=True)))
    return [o.detach() for o in outs], buffers, grads


def assert_same_values(before, after, inputs, grad=False):
    out_b, buf_b, grad_b = run(before, inputs, grad)
    out_a, buf_a, grad_a = run(after, inputs, grad)
    assert len(out_a) == len(out_b)
    for a, b in zip(out_a, out_b):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    for key in buf_b:
        torch.testing.assert_close(buf_a[key], buf_b[key], rtol=1e-10, atol=1e-12)
    for key in grad_b:
        torch.testing.assert_close(grad_a[key], grad_b[key], rtol=1e-10, atol=1e-12)


def assert_vals_everywhere(traced):
    for node in traced.gm.graph.nodes:
        if node.op in ("placeholder", "call_function"):
            assert "val" in node.meta, node.name


class Lin(nn.Module):
    def __init__(self, bias=True):
        super().__init__()
        self.fc = nn.Linear(6, 4, bias=bias)

    def forward(self, x):
        return self.fc(x)


def test_linear_bias_is_added_after_the_matmul():
    x = torch.randn(3, 6)
    before, after = normalized(Lin(), (x,), lambda out, x: out.sum())
    assert ops(before) == ["aten.linear.default", "aten.sum.default"]
    assert ops(after) == ["aten.linear.default", "aten.add.Tensor", "aten.sum.default"]
    linear = next(n for n in after.gm.graph.nodes if n.target is torch.ops.aten.linear.default)
    assert len(linear.args) == 2
    add = next(iter(linear.users))
    assert add.args[1].meta[meta.PATH] == "fc.bias" and add.meta[meta.PATH] == "fc"
    assert_vals_everywhere(after)
    assert_same_values(before, after, (x,), grad=True)


def test_linear_without_bias_is_unchanged():
    before, after = normalized(Lin(bias=False), (torch.randn(3, 6),), lambda out, x: out.sum())
    assert ops(after) == ops(before) == ["aten.linear.default", "aten.sum.default"]


@pytest.mark.parametrize("conv, shape", [(nn.Conv1d(3, 4, 3), (2, 3, 8)), (nn.Conv2d(3, 4, 3), (2, 3, 6, 6)),
                                         (nn.Conv3d(3, 4, 3), (2, 3, 4, 4, 4))])
def test_conv_bias_is_viewed_and_added_after(conv, shape):
    x = torch.randn(*shape)
    before, after = normalized(conv, (x,), lambda out, x: out.sum())
    name = f"aten.conv{len(shape) - 2}d.default"
    assert ops(before) == [name, "aten.sum.default"]
    assert ops(after) == [name, "aten.view.default", "aten.add.Tensor", "aten.sum.default"]
    view = next(n for n in after.gm.graph.nodes if n.target is torch.ops.aten.view.default)
    assert view.args[1] == [-1] + [1] * (len(shape) - 2)
    conv_node = next(n for n in after.gm.graph.nodes if str(n.target) == name)
    assert conv_node.args[2] is None
    assert_same_values(before, after, (x,), grad=True)


class AddMM(nn.Module):
    def __init__(self, beta=1):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 4))
        self.b = nn.Parameter(torch.randn(4))
        self.w3 = nn.Parameter(torch.randn(2, 4, 5))
        self.b3 = nn.Parameter(torch.randn(2, 3, 5))
        self.beta = beta

    def forward(self, x, y):
        return torch.addmm(self.b, x, self.w, beta=self.beta), torch.baddbmm(self.b3, y, self.w3)


def test_addmm_and_baddbmm_become_matmul_plus_add():
    inputs = (torch.randn(3, 6), torch.randn(2, 3, 4))
    def loss(out, x, y):
        return out[0].sum() + out[1].sum()
    before, after = normalized(AddMM(), inputs, loss)
    assert ops(before)[:2] == ["aten.addmm.default", "aten.baddbmm.default"]
    assert ops(after)[:4] == ["aten.mm.default", "aten.add.Tensor", "aten.bmm.default", "aten.add.Tensor"]
    assert_same_values(before, after, inputs, grad=True)


def test_addmm_beta_and_baddbmm_alpha_become_muls():
    """Bloom's ALiBi scores: baddbmm(alibi, q, k, beta=1, alpha=1/sqrt(d)); beta=0 drops the bias."""
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.b, self.w = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(6, 4))
            self.b3, self.w3 = nn.Parameter(torch.randn(2, 1, 5)), nn.Parameter(torch.randn(2, 4, 5))

        def forward(self, x, y):
            return (torch.addmm(self.b, x, self.w, beta=0.5), torch.baddbmm(self.b3, y, self.w3, alpha=0.25),
                    torch.addmm(self.b, x, self.w, beta=0, alpha=2.0))

    inputs = (torch.randn(3, 6), torch.randn(2, 3, 4))
    before, after = normalized(Scaled(), inputs, lambda out, x, y: out[0].sum() + out[1].sum() + out[2].sum())
    assert ops(after)[:7] == ["aten.mm.default", "aten.mul.Tensor", "aten.add.Tensor", "aten.bmm.default",
                              "aten.mul.Tensor", "aten.add.Tensor", "aten.mm.default"]
    assert "aten.addmm.default" not in ops(after) and "aten.baddbmm.default" not in ops(after)
    assert_same_values(before, after, inputs, grad=True)


class OwnLinear(nn.Module):
    """Falcon's FalconLinear: `x @ self.weight.T` (numpy_T), and the same through .t() and transpose."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.randn(5, 6)), nn.Parameter(
            torch.randn(3, 5))

    def forward(self, x):
        h = x @ self.w1.T
        h = torch.matmul(torch.tanh(h), self.w2.t().t().t())  # t(t(t(w))): only the last t pairs with matmul
        return h @ self.w3.transpose(0, 1).T.T  # folds the last of the three


def test_matmul_of_a_transposed_weight_becomes_linear():
    x = torch.randn(2, 3, 4)
    before, after = normalized(OwnLinear(), (x,), lambda out, x: out.pow(2).sum())
    assert "aten.numpy_T.default" in ops(before) and ops(before).count("aten.matmul.default") == 3
    assert "aten.numpy_T.default" not in ops(after) and "aten.matmul.default" not in ops(after)
    assert ops(after).count("aten.linear.default") == 3
    w1 = next(n for n in after.gm.graph.nodes if n.meta.get(meta.PATH) == "w1")
    assert [u.target for u in w1.users] == [torch.ops.aten.linear.default]  # the transpose is gone
    assert_same_values(before, after, (x,), grad=True)


def test_numpy_t_of_an_activation_is_a_permute():
    class T(nn.Module):
        def forward(self, x):
            return x.T * 2

    x = torch.randn(3, 4)
    before, after = normalized(T(), (x,), lambda out, x: out.sum())
    permute = next(n for n in after.gm.graph.nodes if n.target is torch.ops.aten.permute.default)
    assert permute.args[1] == [1, 0]
    assert_same_values(before, after, (x,))


class Routing(nn.Module):
    """Mixtral's router: top-k weights renormalized in place, and an inverse permutation by index_put_."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(4, 6)

    def forward(self, x):
        weights, experts = self.gate(x).softmax(-1).topk(2, dim=-1)
        weights /= weights.sum(dim=-1, keepdim=True)
        order = experts.reshape(-1).sort()[1]
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        return weights.reshape(-1)[inverse]


def test_in_place_ops_on_fresh_values_become_out_of_place():
    x = torch.randn(5, 4)
    before, after = normalized(Routing(), (x,), lambda out, x: out.pow(2).sum())
    assert {"aten.div_.Tensor", "aten.index_put_.default"} <= set(ops(before))
    assert not any(op.endswith(("_.Tensor", "_.default")) for op in ops(after))
    assert {"aten.div.Tensor", "aten.index_put.default"} <= set(ops(after))
    assert_same_values(before, after, (x,), grad=True)


class ViewMutation(nn.Module):
    """An in-place update through a view changes the base: it must stay in place."""

    def forward(self, x):
        h = x * 1.0
        row = h[0]
        row.mul_(2.0)
        h2 = h.clone()
        h2.div_(3.0)
        return h + h2


def test_in_place_ops_on_views_and_inputs_stay():
    x = torch.randn(3, 4)
    before, after = normalized(ViewMutation(), (x,), lambda out, x: out.sum())
    assert "aten.mul_.Tensor" in ops(after)  # on a view of h: h itself changes
    assert "aten.div.Tensor" in ops(after) and "aten.div_.Tensor" not in ops(after)  # h2 is its own tensor
    assert_same_values(before, after, (x,))


class Means(nn.Module):
    def forward(self, x):
        return x.mean(), x.mean(dim=1), x.mean(dim=(0, 2), keepdim=True), x.mean(-1, dtype=torch.float64)


def test_mean_becomes_sum_over_global_count():
    x = torch.randn(2, 3, 4)
    before, after = normalized(Means(), (x,), lambda out, x: out[0])
    assert "aten.mean.default" in ops(before) and "aten.mean.dim" in ops(before)
    assert not any(op.startswith("aten.mean") for op in ops(after))
    divisors = [n.args[1] for n in after.gm.graph.nodes if n.target is torch.ops.aten.div.Tensor]
    assert divisors == [24.0, 3.0, 8.0, 4.0]
    sums = [n for n in after.gm.graph.nodes if n.target is torch.ops.aten.sum.dim_IntList]
    assert [n.args[1:] for n in sums] == [([0, 1, 2], False), ([1], False), ([0, 2], True), ([-1], False)]
    assert sums[-1].kwargs == {"dtype": torch.float64}
    assert_vals_everywhere(after)
    assert_same_values(before, after, (x,))


class CE(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.fc = nn.Linear(4, 5, bias=False)
        self.kwargs = kwargs

    def forward(self, x, target):
        return F.cross_entropy(self.fc(x), target, **self.kwargs)


def ce_loss(out, x, target):
    return out


def test_cross_entropy_becomes_log_softmax_nll_sum_over_count():
    x, target = torch.randn(6, 4), torch.tensor([0, 1, -100, 3, 4, -100])
    before, after = normalized(CE(), (x, target), ce_loss)
    assert ops(before) == ["aten.linear.default", "aten.cross_entropy_loss.default"]
    assert ops(after) == ["aten.linear.default", "aten.log_softmax.int", "aten.nll_loss_nd.default",
                          "aten.ne.Scalar", "aten.sum.default", "aten.div.Tensor"]
    nll = next(n for n in after.gm.graph.nodes if n.target is torch.ops.aten.nll_loss_nd.default)
    assert nll.args[3] == 2 and nll.args[4] == -100  # reduction "sum"; the ignore index is kept
    assert_vals_everywhere(after)
    # The count excludes ignored targets (4 of 6 here): values and gradients match the mean reduction.
    assert_same_values(before, after, (x, target), grad=True)


def test_cross_entropy_with_custom_ignore_index():
    x, target = torch.randn(6, 4), torch.tensor([0, 1, 2, 3, 4, 2])
    before, after = normalized(CE(ignore_index=2), (x, target), ce_loss)
    assert ops(after)[-4:] == ["aten.nll_loss_nd.default", "aten.ne.Scalar", "aten.sum.default", "aten.div.Tensor"]
    assert_same_values(before, after, (x, target), grad=True)


@pytest.mark.parametrize("kwargs", [{"label_smoothing": 0.1}, {"reduction": "sum"}])
def test_cross_entropy_variants_keep_their_reduction(kwargs):
    x, target = torch.randn(6, 4), torch.tensor([0, 1, 2, 3, 4, 0])
    before, after = normalized(CE(**kwargs), (x, target), ce_loss)
    assert "aten.div.Tensor" not in ops(after)
    assert_same_values(before, after, (x, target), grad=True)


def test_nll_loss_with_class_weights_is_left_alone():
    class NLL(nn.Module):
        def forward(self, x, target):
            return F.nll_loss(F.log_softmax(x, 1), target, weight=torch.tensor([1.0, 2.0, 3.0]))

    inputs = (torch.randn(4, 3), torch.tensor([0, 1, 2, 1]))
    before, after = normalized(NLL(), inputs, lambda out, x, t: out)
    # (torch.tensor's detach_ on its fresh copy becomes detach: nothing else sees the tensor)
    assert ops(after) == [op.replace("detach_", "detach") for op in ops(before)]


class BN(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(3)

    def forward(self, x):
        return self.bn(x)


def test_training_batch_norm_is_explicit_sums_and_updates_running_stats():
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64) * 2 + 1
    model = BN().double()  # float64: the weight gradient is a difference of large sums
    with torch.no_grad():
        model.bn.weight.uniform_(0.5, 1.5)
        model.bn.bias.uniform_(-1, 1)
    before, after = normalized(model, (x,), lambda out, x: (out * out).sum())
    assert "aten.batch_norm.default" in ops(before)
    assert "aten.batch_norm.default" not in ops(after)
    assert ops(after).count("aten.copy_.default") == 2  # running_mean and running_var, in place
    sums = [n for n in after.gm.graph.nodes if n.target is torch.ops.aten.sum.dim_IntList]
    assert all(n.args[1] == [0, 2, 3] and n.args[2] is True for n in sums)
    assert_vals_everywhere(after)
    assert_same_values(before, after, (x,), grad=True)  # outputs, gradients and the running statistics


def test_eval_batch_norm_is_left_alone():
    model = BN().eval()
    before, after = normalized(model, (torch.randn(2, 3, 4, 4),), lambda out, x: out.sum())
    assert not any("copy_" in op for op in ops(after))
    assert [op for op in ops(after) if "batch_norm" in op] == [op for op in ops(before) if "batch_norm" in op]


def test_unflatten_becomes_view_with_the_output_shape():
    class U(nn.Module):
        def forward(self, x):
            return x.unflatten(1, (2, -1)) * 2

    x = torch.randn(3, 8)
    before, after = normalized(U(), (x,), lambda out, x: out.sum())
    assert "aten.unflatten.int" in ops(before)
    assert ops(after)[0] == "aten.view.default"
    view = next(n for n in after.gm.graph.nodes if n.target is torch.ops.aten.view.default)
    assert view.args[1] == [3, 2, 4]
    assert_same_values(before, after, (x,))


class NoGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 2)

    def forward(self, x):
        h = self.a(x)
        with torch.no_grad():
            scale = h.abs().amax(dim=-1, keepdim=True) + 1
        return self.b(torch.relu(h) / scale)


def test_grad_regions_are_inlined_and_detached():
    x = torch.randn(3, 4)
    before, after = normalized(NoGrad(), (x,))
    assert "wrap_with_set_grad_enabled" in ops(before)
    assert "wrap_with_set_grad_enabled" not in ops(after) and "getitem" not in ops(after)
    assert not [name for name, _ in after.gm.named_children()]  # the region's submodule is gone
    detach = next(n for n in after.gm.graph.nodes if n.target is torch.ops.aten.detach.default)
    assert detach.args[0].target is torch.ops.aten.add.Tensor  # the region's result (amax + 1)
    assert {"aten.abs.default", "aten.amax.default"} <= set(ops(after))
    assert_vals_everywhere(after)
    for node in after.gm.graph.nodes:
        if node.op == "call_function":
            assert node.meta[meta.KIND] == "op"
    # No gradient flows through the no_grad region: gradients of `a` match the original's.
    assert_same_values(before, after, (x,), grad=True)


class NoOpCastUnderNoGrad(nn.Module):
    """A no_grad block that casts a value to the dtype it has (Dots3's sparse-attention indexer:
    `hidden_states.to(self.weights_proj.weight.dtype)`): eager returns the value itself, still requiring grad, and
    export reads the value's later uses from the block's cast."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 2)
        self.c = nn.Linear(6, 1)

    def forward(self, x):
        h = self.a(x)
        with torch.no_grad():
            keep = self.c(h.to(self.c.weight.dtype)) > 0
        return self.b(h) * keep


def test_a_value_a_grad_region_returns_unchanged_keeps_its_gradient():
    x = torch.randn(3, 4)
    model = NoOpCastUnderNoGrad().double()
    before, after = normalized(model, (x,))
    assert "wrap_with_set_grad_enabled" in ops(before) and "wrap_with_set_grad_enabled" not in ops(after)
    assert_same_values(before, after, (x,), grad=True)
    _, _, grads = run(after, (x,), grad=True)
    model.zero_grad()
    model(x.double()).mean().backward()  # the trace's default loss: the output's mean
    torch.testing.assert_close(grads["a.weight"], model.a.weight.grad, rtol=1e-10, atol=1e-12)


def test_rewrites_chain_through_new_nodes():
    """The default loss's mean reads the bias add that the linear rewrite made (it has a val by then)."""
    x = torch.randn(3, 6)
    before, after = normalized(Lin(), (x,))
    assert ops(after) == ["aten.linear.default", "aten.add.Tensor", "aten.sum.dim_IntList", "aten.div.Tensor"]
    assert_same_values(before, after, (x,), grad=True)
