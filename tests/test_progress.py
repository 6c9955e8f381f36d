"""Progress bars: only for steps over the delay, only when interactive, and shown by the pass manager."""
import io
import sys
import time

import pytest

from autoshard.passes.manager import run_passes
from autoshard.report.progress import StepProgress, interactive


def test_quick_steps_draw_nothing_even_when_interactive():
    out = io.StringIO()
    with StepProgress(3, "planning", delay_s=5.0, enabled=True, file=out) as progress:
        for name in ("normalize", "solve", "codegen"):
            with progress.step(name):
                pass
    assert out.getvalue() == "" and progress.done == 3


def test_a_slow_step_shows_the_bar_with_its_name():
    out = io.StringIO()
    with StepProgress(3, "planning", delay_s=0.05, enabled=True, file=out) as progress:
        with progress.step("normalize"):
            pass
        with progress.step("solve"):
            time.sleep(0.3)
        assert progress.bar is not None and progress.bar.n == 2
        with progress.step("codegen"):
            pass
    text = out.getvalue()
    assert "planning" in text and "solve" in text and "1/3" in text
    assert progress.bar is None  # closed


def test_not_interactive_is_silent_for_slow_steps():
    out = io.StringIO()
    with StepProgress(1, "planning", delay_s=0.01, enabled=False, file=out) as progress, progress.step("solve"):
        time.sleep(0.05)
    assert out.getvalue() == "" and progress.bar is None


@pytest.mark.parametrize("tty,env,expected", [(True, None, True), (False, None, False), (True, "0", False),
                                              (False, "1", True)])
def test_interactive_follows_the_terminal_and_the_override(monkeypatch, tty, env, expected):
    class Stream(io.StringIO):
        def isatty(self):
            return tty
    monkeypatch.setattr(sys, "stderr", Stream())
    if env is None:
        monkeypatch.delenv("AUTOSHARD_PROGRESS", raising=False)
    else:
        monkeypatch.setenv("AUTOSHARD_PROGRESS", env)
    assert interactive() is expected


def test_run_passes_shows_progress_for_a_pass_over_a_second(monkeypatch, capsys):
    monkeypatch.setenv("AUTOSHARD_PROGRESS", "1")

    def slow(state):
        time.sleep(1.3)
    slow.name = "slow_pass"
    history = run_passes(object(), [slow, lambda state: None], describe=lambda state: "")
    assert [e.name for e in history] == ["slow_pass", "<lambda>"]
    err = capsys.readouterr().err
    assert "autoshard planning" in err and "slow_pass" in err


def test_run_passes_is_silent_when_not_interactive(monkeypatch, capsys):
    monkeypatch.setenv("AUTOSHARD_PROGRESS", "0")

    def slow(state):
        time.sleep(1.1)
    run_passes(object(), [slow], describe=lambda state: "")
    assert capsys.readouterr().err == ""
