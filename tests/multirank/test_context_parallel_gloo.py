"""Tier 3: a ring attention on real gloo ranks (point-to-point sends and receives between the ranks of the cp
axis, the zigzag reordering included) trains like the single device, float64; its bytes are the predicted ones."""
import pytest

from autoshard.verify.verify import verify_factory


@pytest.mark.filterwarnings("ignore:autoshard. the hint")
def test_ring_attention_on_gloo_ranks(pool_runner):
    hints = {"input:0": {"cp": "S(1)"}, "*:attention": {"cp": "ring"}}
    report, program = verify_factory("autoshard.zoo:llama", (4,), ("cp",), hints=hints, steps=2, runner=pool_runner)
    assert report.ok, report
    cp = report.collectives["cp"]
    assert cp["send_recv"]["fwd"] == 2 * 3  # two layers, k - 1 = 3 shifts each
    assert cp["permute"]["fwd"] == 2 * 4  # q, k, v in zigzag order and the output back, per layer
    assert sum(k["bytes"] for k in cp.values()) == sum(program.plan.predicted["comm_bytes_per_step"]["cp"].values())
