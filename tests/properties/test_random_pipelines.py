"""Tier 2: random pipelines (depth, stage count, cut, micro-batches, a data-parallel axis or not) run in
the simulator and train exactly like the single device; failures shrink to the smallest such case."""
import torch
from fuzzing import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from autoshard.verify.verify import verify_simulated


class Residual(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


@st.composite
def pipelines(draw):
    stages = draw(st.integers(2, 4))
    blocks = draw(st.integers(stages, stages + 3))
    counts = [1] * stages
    for _ in range(blocks - stages):  # spread the remaining blocks over the stages: a random balance
        counts[draw(st.integers(0, stages - 1))] += 1
    dp = draw(st.sampled_from([1, 2])) if stages <= 2 else 1  # at most 8 simulated devices
    microbatches = draw(st.sampled_from([m for m in (1, 2, 4) if 8 % (m * dp) == 0]))
    hidden = draw(st.sampled_from([4, 8]))
    return stages, counts, dp, microbatches, hidden


@fuzz_settings(15)
@given(pipelines(), st.sampled_from(["balance", "auto"]))
def test_random_pipeline_matches_single_device(case, cut):
    stages, counts, dp, microbatches, hidden = case
    torch.manual_seed(0)
    model = nn.Sequential(*(Residual(4, hidden) for _ in range(sum(counts))))
    x = torch.randn(8, 4)
    mesh, names = ((stages, dp), ("pp", "dp")) if dp > 1 else ((stages,), ("pp",))
    options = {"microbatches": microbatches, **({"balance": counts} if cut == "balance" else {})}
    report, program = verify_simulated(model, (x,), lambda out, x: out.pow(2).mean(), mesh=mesh, axis_names=names,
                                       hints={"input:0": {"dp": "S(0)"}} if dp > 1 else None, pipeline=options)
    assert report.ok, f"{case} {cut}\n{report}"
    assert program.config.num_stages == stages
