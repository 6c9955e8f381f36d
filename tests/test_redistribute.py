"""plan_redistribute: the planned steps, run as real collectives in the thread simulator, turn every
rank's block of `src` into its block of `dst`, and their backward delivers the gradient in the dual
placement (S <-> S, P <-> R, R <-> R).

Tensors hold small integers in float64, so every sum is exact and blocks compare with `torch.equal`.
"""
import itertools
import math
import threading

import pytest
import torch
from fuzzing import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from autoshard.ir.errors import PlanError
from autoshard.ir.mesh import Mesh
from autoshard.ir.placement import (
    P,
    Partial,
    R,
    S,
    Spec,
    local_shape,
    shard_tensor,
    unshard_tensors,
)
from autoshard.ir.redistribute import Step, plan_redistribute
from autoshard.runtime import collectives
from autoshard.runtime.thread_communicator import ThreadCommunicator, ThreadHub

# --- helpers -------------------------------------------------------------------------------------

def apply_step(x, step: Step, names):
    axis = names[step.axis]
    if step.op == "all_reduce":
        return collectives.all_reduce(x, axis)
    if step.op == "all_to_all":
        return collectives.all_to_all(x, axis, step.dim, step.to_dim)
    return getattr(collectives, step.op)(x, axis, step.dim)


def run_on_mesh(mesh: Mesh, steps, blocks: dict, upstream: dict) -> dict:
    """Every rank applies `steps` to its block and backpropagates its upstream gradient.

    Returns {coord: (output block, input gradient)}.
    """
    hub = ThreadHub(mesh, timeout_s=20)
    results, errors = {}, {}

    def worker(rank):
        coord = mesh.coord(rank)
        try:
            with collectives.use_communicator(ThreadCommunicator(hub, rank)):
                x = blocks[coord].clone().requires_grad_(True)
                y = x
                for step in steps:
                    y = apply_step(y, step, mesh.names)
                y.backward(upstream[coord])
            results[coord] = (y.detach(), x.grad)
        except BaseException as exc:  # noqa: BLE001  (reported below)
            errors[rank] = exc
            hub.abort()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(mesh.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        rank, exc = min(errors.items())
        raise AssertionError(f"rank {rank} failed: {type(exc).__name__}: {exc}") from exc
    return results


def without_partials(spec: Spec) -> Spec:
    """The gradient placement of a forward placement: P becomes R, shards stay (the duality rule)."""
    return Spec(R if isinstance(p, Partial) else p for p in spec)


def partial_blocks(tensor, spec: Spec, mesh: Mesh, gen) -> dict:
    """{coord: block} of `spec`, with random integer summands on the partial axes that sum exactly."""
    dense = without_partials(spec)
    partial = spec.partial_axes()
    blocks = {}
    for coord in mesh.coords():
        base = shard_tensor(tensor, dense, coord, mesh.shape)
        if any(coord[a] for a in partial):
            blocks[coord] = torch.randint(-4, 5, base.shape, generator=gen).to(tensor.dtype)
        else:
            blocks[coord] = base.clone()
    for coord in mesh.coords():  # the rank with 0 on every partial axis absorbs the others' summands
        if any(coord[a] for a in partial):
            home = tuple(0 if a in partial else c for a, c in enumerate(coord))
            blocks[home] = blocks[home] - blocks[coord]
    return blocks


def check_redistribution(mesh: Mesh, shape, src: Spec, dst: Spec, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tensor = torch.randint(-9, 10, shape, generator=gen).double()
    grad = torch.randint(-9, 10, shape, generator=gen).double()
    steps = plan_redistribute(src, dst)
    blocks = partial_blocks(tensor, src, mesh, gen)
    assert torch.equal(unshard_tensors(blocks, src, mesh.shape), tensor)
    upstream = {c: shard_tensor(grad, without_partials(dst), c, mesh.shape) for c in mesh.coords()}
    results = run_on_mesh(mesh, steps, blocks, upstream)
    where = f"{src!r} -> {dst!r} on {mesh!r}, shape {tuple(shape)}, steps {steps}"
    for coord, (out, in_grad) in results.items():
        assert out.shape == local_shape(shape, dst, mesh.shape), where
        if not dst.partial_axes():
            assert torch.equal(out, shard_tensor(tensor, dst, coord, mesh.shape)), f"{where}: rank {coord}"
        assert torch.equal(in_grad, shard_tensor(grad, without_partials(src), coord, mesh.shape)), \
            f"{where}: gradient at rank {coord}"
    assert torch.equal(unshard_tensors({c: o for c, (o, _) in results.items()}, dst, mesh.shape), tensor), where
    return steps


# --- planned steps -------------------------------------------------------------------------------

@pytest.mark.parametrize("src, dst, expected", [
    ("[S(0), S(0)]", "[R, R]", "[all_gather(axis=1, dim=0), all_gather(axis=0, dim=0)]"),
    ("[P, R]", "[S(1), R]", "[reduce_scatter(axis=0, dim=1)]"),
    ("[P, R]", "[R, R]", "[all_reduce(axis=0)]"),
    ("[R, R]", "[R, S(1)]", "[chunk(axis=1, dim=1)]"),
    ("[S(0), R]", "[S(1), R]", "[all_to_all(axis=0, gather_dim=0, scatter_dim=1)]"),
    ("[S(0), S(1)]", "[S(0), S(1)]", "[]"),
    ("[R, S(0)]", "[S(0), R]", "[all_gather(axis=1, dim=0), chunk(axis=0, dim=0)]"),
    # the inner axis of a nested shard must be gathered before the outer one can change
    ("[S(0), S(0)]", "[R, S(0)]", "[all_gather(axis=1, dim=0), all_gather(axis=0, dim=0), chunk(axis=1, dim=0)]"),
    ("[P, P]", "[R, S(0)]", "[reduce_scatter(axis=1, dim=0), all_reduce(axis=0)]"),
])
def test_planned_steps(src, dst, expected):
    assert repr(plan_redistribute(Spec.parse(src), Spec.parse(dst))) == expected


@pytest.mark.parametrize("src, dst", [("[R]", "[P]"), ("[S(0)]", "[P]"), ("[P, R]", "[P, P]"), ("[S(1), R]", "[R, P]")])
def test_a_full_tensor_never_becomes_partial(src, dst):
    with pytest.raises(PlanError, match="partial sum"):
        plan_redistribute(Spec.parse(src), Spec.parse(dst))


def test_partial_to_partial_needs_nothing():
    assert plan_redistribute(Spec([P, S(0)]), Spec([P, S(0)])) == []


@pytest.mark.parametrize("src, dst, mesh_shape, shape", [
    ("[S(0), S(0)]", "[R, S(0)]", (2, 3), (12, 2)),
    ("[S(0), S(1)]", "[S(1), S(0)]", (2, 2), (4, 4)),
    ("[P, S(0)]", "[S(0), S(1)]", (2, 3), (6, 3)),
    ("[S(0), P, R]", "[S(0), S(0), S(1)]", (2, 2, 3), (4, 3)),
    ("[P, P, P]", "[R, R, R]", (2, 3, 2), (3,)),
    ("[S(0)]", "[S(0)]", (1,), (2,)),
])
def test_examples_in_the_simulator(src, dst, mesh_shape, shape):
    mesh = Mesh(mesh_shape, ("a", "b", "c")[: len(mesh_shape)])
    check_redistribution(mesh, shape, Spec.parse(src), Spec.parse(dst))


# --- random specs on random meshes ---------------------------------------------------------------

@st.composite
def redistributions(draw):
    mesh_shape = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    ndim = draw(st.integers(1, 3))
    src_choices = [R, P] + [S(d) for d in range(ndim)]
    src = Spec(draw(st.sampled_from(src_choices)) for _ in mesh_shape)
    dst = Spec(draw(st.sampled_from(src_choices if isinstance(s, Partial) else [R] + src_choices[2:]))
               for s in src)
    shape = []
    for d in range(ndim):
        need_src = math.prod(mesh_shape[a] for a in src.axes_sharding(d))
        need_dst = math.prod(mesh_shape[a] for a in dst.axes_sharding(d))
        shape.append(math.lcm(need_src, need_dst) * draw(st.integers(1, 2)))
    return Mesh(mesh_shape, ("x", "y", "z")[: len(mesh_shape)]), tuple(shape), src, dst, draw(st.integers(0, 99))


@fuzz_settings(300)
@given(redistributions())
def test_random_redistributions_in_the_simulator(case):
    mesh, shape, src, dst, seed = case
    steps = check_redistribution(mesh, shape, src, dst, seed)
    cur = src
    for step in steps:  # every step moves one axis, and the steps end exactly at dst
        cur = step.apply(cur)
    assert cur == dst
    assert len(steps) <= 2 * mesh.ndim + 1


@fuzz_settings(100)
@given(st.lists(st.sampled_from([R, P, S(0), S(1), S(2)]), min_size=1, max_size=3), st.data())
def test_partial_destinations_need_partial_sources(src, data):
    dst = [data.draw(st.sampled_from([R, P, S(0), S(1)])) for _ in src]
    bad = any(isinstance(d, Partial) and not isinstance(s, Partial) for s, d in zip(src, dst))
    if bad:
        with pytest.raises(PlanError):
            plan_redistribute(Spec(src), Spec(dst))
    else:
        steps = plan_redistribute(Spec(src), Spec(dst))
        assert all(isinstance(s, Step) for s in steps)


def test_every_spec_pair_on_a_2x2_mesh():
    """Exhaustive over [R, P, S(0), S(1)]^2 -> [R, P, S(0), S(1)]^2 on a 2x2 mesh."""
    mesh = Mesh((2, 2), ("dp", "tp"))
    choices = [R, P, S(0), S(1)]
    count = 0
    for src in itertools.product(choices, repeat=2):
        for dst in itertools.product(choices, repeat=2):
            if any(isinstance(d, Partial) and not isinstance(s, Partial) for s, d in zip(src, dst)):
                continue
            check_redistribution(mesh, (4, 8), Spec(src), Spec(dst), seed=count)
            count += 1
    assert count == 13 * 13  # per axis: P -> any of 4, the others -> R, S(0), S(1)


# --- the simulator's collectives must not alias other ranks' tensors -------------------------------

class _LateReader(ThreadCommunicator):
    """A rank that is descheduled between the exchange and its use of the gathered parts."""

    def __init__(self, hub, rank, go):
        super().__init__(hub, rank)
        self.go = go

    def all_gather_list(self, tensor, axis, what):
        parts = super().all_gather_list(tensor, axis, what)
        assert self.go.wait(10)
        return parts


def test_all_gather_result_is_a_snapshot():
    mesh = Mesh((2,), ("dp",))
    hub = ThreadHub(mesh, timeout_s=10)
    go = threading.Event()
    out = {}

    def rank0():
        comm = _LateReader(hub, 0, go)
        out[0] = comm.all_gather(torch.zeros(2), "dp", 0)

    def rank1():
        comm = ThreadCommunicator(hub, 1)
        mine = torch.ones(2)
        out[1] = comm.all_gather(mine, "dp", 0)
        mine.add_(100.0)  # e.g. the optimizer step on a parameter shard
        go.set()

    threads = [threading.Thread(target=rank0), threading.Thread(target=rank1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out[0].tolist() == [0.0, 0.0, 1.0, 1.0]
