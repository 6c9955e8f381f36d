"""Every candidate of the generic rules (views, reductions, einsum-likes, norms, attention) runs on 2 and 4
ranks and equals the single device (`rule_graphs.check_candidates`): the rules' placements, not only their
printed sets, are right."""
import pytest
import torch
import torch.nn.functional as F
from rule_graphs import aten, check_candidates

X = torch.randn(4, 6, 8, dtype=torch.float64)
W = torch.randn(10, 8, dtype=torch.float64)

CASES = {
    "view splitting a dim": (lambda a: a.view(2, 2, 6, 8), aten.view.default),
    "view merging dims": (lambda a: a.view(4, 48), aten.view.default),
    "reshape": (lambda a: a.reshape(24, 8), aten.reshape.default),
    "flatten": (lambda a: a.flatten(1), aten.flatten.using_ints),
    "permute": (lambda a: a.permute(2, 0, 1), aten.permute.default),
    "transpose": (lambda a: a.transpose(0, 2), aten.transpose.int),
    "expand": (lambda a: a[:, None].expand(4, 4, 6, 8), aten.expand.default),
    "slice": (lambda a: a[:, 1:5], aten.slice.Tensor),
    "narrow": (lambda a: a.narrow(1, 1, 3), aten.narrow.default),
    "split": (lambda a: a.split(2, dim=2), aten.split.Tensor),
    "chunk": (lambda a: a.chunk(2, 2), aten.chunk.default),
    "select": (lambda a: a.select(1, 2), aten.select.int),
    "unbind": (lambda a: a.unbind(1), aten.unbind.int),
    "index_select": (lambda a: a.index_select(1, torch.tensor([0, 3])), aten.index_select.default),
    "cat": (lambda a: torch.cat([a, a * 2], 1), aten.cat.default),
    "stack": (lambda a: torch.stack([a, a * 2], 1), aten.stack.default),
    "sum over a dim": (lambda a: a.sum(1), aten.sum.dim_IntList),
    "sum of everything": (lambda a: a.sum(), aten.sum.default),
    "amax keepdim": (lambda a: a.amax(1, keepdim=True), aten.amax.default),
    "max with indices": (lambda a: a.max(1), aten.max.dim),
    "var": (lambda a: a.var(1, keepdim=True), aten.var.dim),
    "vector norm": (lambda a: torch.linalg.vector_norm(a, 2, 1), aten.linalg_vector_norm.default),
    "softmax": (lambda a: a.softmax(1), aten.softmax.int),
    "cumsum": (lambda a: a.cumsum(1), aten.cumsum.default),
    "sort": (lambda a: a.sort(1), aten.sort.default),
    "linear": (lambda a: F.linear(a, W), aten.linear.default),
    "matmul": (lambda a: a @ W.t(), aten.matmul.default),
    "bmm": (lambda a: torch.bmm(a, a.transpose(1, 2)), aten.bmm.default),
    "einsum": (lambda a: torch.einsum("abc,dc->abd", a, a[0]), aten.einsum.default),
    "embedding": (lambda a: F.embedding(torch.tensor([[1, 2], [3, 0]]), W), aten.embedding.default),
    "layer_norm": (lambda a: F.layer_norm(a, (8,)), aten.layer_norm.default),
    "sdpa": (lambda a: F.scaled_dot_product_attention(a[None], a[None], a[None]),
             aten.scaled_dot_product_attention.default),
    "tril": (lambda a: torch.tril(a), aten.tril.default),
    "masked_fill": (lambda a: a.masked_fill(a > 0, 0.5), aten.masked_fill.Scalar),
    "mul broadcasting": (lambda a: a * a[0], aten.mul.Tensor),
    "add broadcasting": (lambda a: a + a[0], aten.add.Tensor),
}


@pytest.mark.parametrize("axis_size", [2, 4])
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_candidate_equals_the_single_device(name, axis_size):
    fn, target = CASES[name]
    assert len(check_candidates(fn, X, target=target, axis_size=axis_size)) > 1
