"""A run inside a SLURM task stops promptly when SLURM stops it, and stays resumable.

What SLURM sends a job step's tasks (KillWait is 30 s unless the cluster sets it):
- scancel: SIGCONT and SIGTERM, then SIGKILL KillWait later;
- the time limit: SIGUSR2 `hydra.launcher.signal_delay_s` before it (submitit submits with
  --signal=USR2@<delay>), then at the limit SIGTERM and, KillWait later, SIGKILL.
submitit, which runs each task of a sweep, logs SIGTERM and ignores it, so a cancelled run went
on generating until the SIGKILL; on SIGUSR2 it stops the run minutes before its limit to requeue
it, which a bench run started without resume=true cannot use.

This Hydra callback (hydra.callbacks of conf/hydra/launcher/slurm.yaml) changes both for the
length of the run: SIGTERM raises `Stopped` wherever generation is, so the task ends in seconds
with its finished records fsynced and its directory lock released; SIGUSR2 is logged and the run
goes on until the SIGTERM at the limit, so it generates for the whole timeout_min. Hydra keeps
the exception in the job's return, which submitit writes as the task's result: the submitting
command stops waiting at once, even where `sacct` knows nothing, and prints how to resume.
The handler's raise can be lost: Python only prints an exception raised inside an at-fork
callback, a __del__ or a weakref callback, and the handler runs wherever the interpreter is
(seen: 1 stop in 41, SIGTERM landing in logging's after-fork lock release as the sandbox
forked to score a program; the run then generated on to its end). So the stop is also kept
here, and the runner raises it again before each next prompt (`raise_if_stopped`).
After a stop the task then ends without the interpreter's teardown: freeing torch and
transformers at exit took 3.7 s of the ~5 s from scancel to the task's end (measured on the
test cluster, more on a loaded machine), time in which SLURM still counts the job as running.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
from typing import Any

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf


def _say(message: str) -> None:
    # os.write, not print: the handler may interrupt a write to stderr (the progress bar), and a
    # buffered write from inside it would fail as a reentrant call.
    os.write(2, f"\n[bench] {message}\n".encode())


class Stopped(Exception):
    """SLURM stopped the run; the records written so far are kept, resume=true finishes it."""


_stop: list[str] = []  # the stop's message, once SIGTERM came during this job


def raise_if_stopped() -> None:
    """Raises Stopped where SIGTERM came and its own raise was lost (see above); else nothing."""
    if _stop:
        raise Stopped(_stop[0])


def _exit_at_once(failed: list[bool]) -> None:
    """Registered last, so the first exit handler to run: flush what is buffered, then end the
    process without freeing the interpreter (the records and submitit's result are on disk)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(1 if failed else 0)


@contextlib.contextmanager
def signals_held(signums=(signal.SIGTERM, signal.SIGINT)):
    """A stop (scancel, the time limit, Ctrl-C) that comes inside the block is raised after it, to the
    handler there was. Held in Python, not by the thread's signal mask: a process-directed signal goes
    to any thread not blocking it (torch's OpenMP workers), and Python runs its handler anyway. Only
    the main thread may set handlers; elsewhere none come to Python."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    previous = {signum: signal.signal(signum, lambda signum, frame: came.append(signum)) for signum in signums}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(came):
            signal.raise_signal(signum)


class StopOnSlurmSignal(Callback):
    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}
        self._stopped = False

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        job = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
        if not job or threading.current_thread() is not threading.main_thread():
            return  # not a SLURM task (or no signals here): the defaults stay
        hc = config.hydra
        run_dir = hc.runtime.output_dir
        where = (f"hydra.sweep.dir={os.path.abspath(hc.sweep.dir)}" if hc.mode == RunMode.MULTIRUN
                 else f"hydra.run.dir={run_dir}")
        kept = f"the finished records of {run_dir}"
        how = f"finish the run with the same command plus resume=true {where}"
        if OmegaConf.select(config, "leaderboard.cluster.unit") is not None:  # a sharded leaderboard's unit
            kept, how = "the unit's finished records", "rerun the leaderboard's command: each unit left resumes"
        resume = f"{kept} are kept. Once no task of SLURM job {job} runs (squeue -j {job} lists none), {how}"

        pid = os.getpid()

        def stop(signum: int, frame: Any) -> None:
            if os.getpid() != pid:  # a forked helper (quality scoring) inherited this handler: it just ends
                os._exit(128 + signum)
            for sig in self._previous:  # one stop: SLURM may signal again while this one unwinds
                signal.signal(sig, signal.SIG_IGN)
            self._stopped = True
            message = f"stopped by SIGTERM (scancel, or the job's time limit); {resume}"
            _stop.append(message)
            _say(message)
            raise Stopped(message)

        def near_limit(signum: int, frame: Any) -> None:
            _say("SIGUSR2: the job's time limit is near; generating on until SLURM's SIGTERM at the limit stops "
                 "the run (finished records are kept)")

        self._previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, stop),
                          signal.SIGUSR2: signal.signal(signal.SIGUSR2, near_limit)}

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        # The run is over (finished or stopped): submitit's own handlers again while it writes the result.
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        _stop.clear()
        if self._stopped:
            failed: list[bool] = []  # an exception left uncaught after this (submitit's) keeps exit code 1
            previous_hook = sys.excepthook
            sys.excepthook = lambda *exc: (failed.append(True), previous_hook(*exc))
            atexit.register(_exit_at_once, failed)
