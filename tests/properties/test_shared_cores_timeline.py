"""Ranks sharing their host's cores (CPU ranks outnumbering the cores): a pipeline's busy ranks take the cores its
idle ones leave (report/timeline.py `_shared_cores`). Against the timeline of ranks in lockstep at the measured
rates, on random stage times and schedules: the shared step is never longer (no action runs slower than when all
ranks compute), and the least step it reports (what the schedule search prunes with) never exceeds it."""
from hypothesis import given, settings
from hypothesis import strategies as st

from autoshard.program.pipeline import PipelineConfig
from autoshard.report.timeline import simulate

SCHEDULES = [("1F1B", 1), ("GPipe", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2)]


@st.composite
def pipelines(draw):
    p = draw(st.integers(2, 4))
    schedule, virtual = draw(st.sampled_from(SCHEDULES))
    m = p * draw(st.integers(1, 3))
    cores = draw(st.integers(1, p))
    times = draw(st.lists(st.tuples(st.floats(0.01, 2.0), st.floats(0.01, 4.0)), min_size=p * virtual,
                          max_size=p * virtual))
    transfer = draw(st.sampled_from([0.0, 0.05]))
    return PipelineConfig("pp", p, m, schedule, virtual, action_s=0.01), cores, times, transfer


@settings(max_examples=60, deadline=None)
@given(pipelines())
def test_sharing_the_cores_never_lengthens_the_step_and_its_least_step_bounds_it(case):
    config, cores, times, transfer = case
    durations = {s: {"F": f, "B": b} for s, (f, b) in enumerate(times)}
    lockstep = simulate(config, durations, transfer)
    shared_config = PipelineConfig(config.axis, config.pp_size, config.microbatches, config.schedule, config.virtual,
                                   action_s=config.action_s, host_cores=cores, rates_ranks=config.pp_size,
                                   host_ranks=config.pp_size)
    shared = simulate(shared_config, durations, transfer)
    assert lockstep.least_s is None
    assert len(shared.events) == len(lockstep.events)
    if not shared_config.shares_cores:  # as many cores as ranks: the lockstep timeline itself
        assert shared.events == lockstep.events
        return
    assert shared.span() <= lockstep.span() * (1 + 1e-9)
    assert shared.least_s <= shared.span() * (1 + 1e-9)
