"""The collective table (autoshard/ir/collective_table.py) is what the runtime does: each autograd collective
runs the table's ring collective forward and its dual backward, moving the block the table says; and the
redistribution planner and the cost model pick and price collectives from it."""
import itertools

import pytest
import torch

from autoshard.ir.collective_table import TABLE, collective_for, direction_bytes
from autoshard.ir.mesh import Mesh
from autoshard.ir.placement import P, R, S, Spec
from autoshard.ir.redistribute import plan_redistribute
from autoshard.runtime.collectives import COLLECTIVES
from autoshard.runtime.simulator import run_on_mesh

ARGS = {"all_reduce": (), "grad_all_reduce": (), "all_gather": (0,), "chunk": (0,), "reduce_scatter": (0,),
        "all_gather_sum_grad": (0,), "all_to_all": (0, 1)}


@pytest.mark.parametrize("name", sorted(ARGS))
def test_the_runtime_runs_what_the_table_says(name):
    row = TABLE[name]

    def step(comm):
        x = torch.ones(4, 6, dtype=torch.float64, requires_grad=True)
        out = COLLECTIVES[name](x, "x", *ARGS[name])
        out.sum().backward()
        return comm.log, x.numel() * 8, out.numel() * 8

    log, src, dst = run_on_mesh(Mesh((2,), ("x",)), step)[0]
    want_fwd, want_bwd = direction_bytes(name, src, dst)
    seen = {(kind, phase): log.bytes[(axis, kind, phase)] for axis, kind, phase in log.counts}
    expected = {(ring, phase): nbytes for ring, phase, nbytes in ((row.forward, "fwd", want_fwd),
                                                                   (row.backward, "bwd", want_bwd)) if ring}
    assert seen == expected


def test_the_planner_picks_collectives_by_the_tables_placement_change():
    for src, dst in itertools.product([R, P, S(0), S(1)], [R, S(0), S(1)]):
        if src == dst:
            continue
        steps = plan_redistribute(Spec([src]), Spec([dst]))
        assert [s.op for s in steps] == [collective_for(src, dst)]
        kind = {R: "R", P: "P"}.get(src, "S"), {R: "R"}.get(dst, "S")
        assert TABLE[steps[0].op].change == kind

