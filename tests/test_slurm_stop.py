"""A SLURM stop whose exception Python drops still stops the run.

The SIGTERM handler raises wherever the interpreter is, and Python only prints an exception
raised inside an at-fork callback, a __del__ or a weakref callback: a run on the test cluster
generated on to its end once (1 stop in 41) when SIGTERM came as the sandbox forked. These
tests make the handler run inside a __del__, no SLURM needed.
"""
from __future__ import annotations

import json
import signal

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from bench import runner, slurm
from bench.registry import CONF_DIR

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the lost Stopped


class SignalledWhileDeleted:
    """SIGTERM arrives while Python runs this __del__: the handler's Stopped is printed, not raised."""

    def __del__(self):
        signal.raise_signal(signal.SIGTERM)  # raise_signal runs the Python handler before it returns


def lose_a_sigterm() -> None:
    SignalledWhileDeleted()


@pytest.fixture
def slurm_task(monkeypatch, tmp_path):
    """StopOnSlurmSignal's handlers, as in a SLURM task; put back after the test."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    hydra = OmegaConf.create({"hydra": {"runtime": {"output_dir": str(tmp_path / "run")}, "mode": "RUN",
                                        "sweep": {"dir": str(tmp_path)}}})
    callback = slurm.StopOnSlurmSignal()
    before = signal.getsignal(signal.SIGTERM)
    callback.on_job_start(hydra)
    assert signal.getsignal(signal.SIGTERM) is not before, "the handler was not installed (not the main thread?)"
    yield callback
    callback._stopped = False  # no exit-at-once handler for pytest's own process
    callback.on_job_end(hydra, job_return=None)
    assert signal.getsignal(signal.SIGTERM) is before and not slurm._stop


def test_a_lost_stop_is_raised_again(slurm_task):
    slurm.raise_if_stopped()  # no SIGTERM yet: nothing
    lose_a_sigterm()
    with pytest.raises(slurm.Stopped, match="stopped by SIGTERM"):
        slurm.raise_if_stopped()


def _run_with_a_lost_stop(tmp_path, monkeypatch) -> None:
    """Four prompts; SIGTERM comes, and its exception is lost, as the first one is generated."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Count to {i}."}) + "\n" for i in range(4)))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=["model=tiny-random", "dataset=jsonl", f"dataset.path={prompts}",
                                           "gen.max_new_tokens=4", "quality=false", "progress=false"])
    generate = runner.run_unit

    def generate_and_lose_a_stop(*args, **kwargs):
        record = generate(*args, **kwargs)
        if record["prompt_id"] == "p0":
            lose_a_sigterm()
        return record

    monkeypatch.setattr(runner, "run_unit", generate_and_lose_a_stop)
    runner.run(cfg, tmp_path / "run")


def _recorded(tmp_path) -> list[str]:
    return [json.loads(line)["prompt_id"] for line in (tmp_path / "run" / "records.jsonl").read_text().splitlines()]


def test_the_run_stops_before_the_next_prompt(slurm_task, tmp_path, monkeypatch):
    with pytest.raises(slurm.Stopped):
        _run_with_a_lost_stop(tmp_path, monkeypatch)
    assert _recorded(tmp_path) == ["p0"]


def test_negative_control_without_the_check_the_run_goes_on(slurm_task, tmp_path, monkeypatch):
    monkeypatch.setattr(slurm, "raise_if_stopped", lambda: None)
    _run_with_a_lost_stop(tmp_path, monkeypatch)
    assert _recorded(tmp_path) == ["p0", "p1", "p2", "p3"]
