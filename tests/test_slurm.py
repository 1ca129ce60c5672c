"""Sweeps on a real SLURM cluster, end to end.

scripts/slurm/start_cluster.sh stands up a single-node SLURM on localhost (slurmctld, slurmd,
slurmdbd on MariaDB, munge; apt-get installs them where missing), the sweeps run through
hydra/launcher=slurm_cpu as a user runs them, and scripts/slurm/stop_cluster.sh stops every
daemon the start script recorded, by PID. Root and Debian's packages are needed: where SLURM
cannot run here the tests fail with the reason (leave them out with -m "not slurm").
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pandas as pd
import pytest

from helpers import CACHE_DIR, DATA_DIR, REPO

pytestmark = [pytest.mark.slurm, pytest.mark.slow]  # every test here starts processes

SCRIPTS = REPO / "scripts" / "slurm"
FINAL = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED"}
KILL_WAIT_S = 30  # the start script's KillWait (SLURM's default): a task ignoring SIGTERM lives this long


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _free_ports() -> int:
    """The first of four consecutive free ports (slurmctld, slurmd, slurmdbd, mariadb)."""
    def free(port):
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) != 0
    for base in range(26817, 28817, 4):
        if all(free(p) for p in range(base, base + 4)):
            return base
    pytest.fail("no four consecutive free ports in 26817..28816 for the test cluster", pytrace=False)


def _pid_is(pid: int, name: str) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == name and \
            "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


@dataclass
class Cluster:
    state: Path
    env: dict

    def slurm(self, *cmd: str) -> str:
        out = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, f"{' '.join(cmd)}: {out.stderr}"
        return out.stdout

    def bench(self, name: str, sweep: Path, *overrides: str, timeout_min: int = 10) -> list[str]:
        """The command line of a sweep on this cluster: 1 CPU per run, so two run at once."""
        return [sys.executable, "-m", "bench", "-m", "hydra/launcher=slurm_cpu", "hydra.launcher.cpus_per_task=1",
                "hydra.launcher.mem_gb=1", f"hydra.launcher.timeout_min={timeout_min}", f"hydra.launcher.name={name}",
                "model=tiny-random", "decoder=lookahead", *overrides, f"hydra.sweep.dir={sweep}"]

    def run(self, cmd: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout, cwd=REPO)

    def start(self, cmd: list[str], log: Path) -> subprocess.Popen:
        with open(log, "w") as f:
            return subprocess.Popen(cmd, env=self.env, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)

    def queued(self, job: str) -> list[str]:
        """States of the job's tasks that squeue still lists (pending, running, completing)."""
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=self.env, capture_output=True, text=True,
                             timeout=60)
        if out.returncode != 0 and "Invalid job id" in out.stderr:
            return []  # long gone
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    def accounted(self, name: str, tasks: int, timeout: float = 60) -> dict[str, str]:
        """{array task id: final state} from sacct, once every task has one (accounting lags a little)."""
        deadline = time.monotonic() + timeout
        while True:
            rows = self.slurm("sacct", "-n", "-X", "-P", "-S", "now-1days", "--name", name, "-o", "JobID,State")
            states = {job: state.split()[0] for job, state in (r.split("|") for r in rows.splitlines())}
            if len(states) == tasks and set(states.values()) <= FINAL:
                return states
            assert time.monotonic() < deadline, f"sacct --name {name} after {timeout:.0f}s: {rows}"
            time.sleep(1)


@pytest.fixture(scope="module")
def cluster():
    state = Path(tempfile.mkdtemp(prefix="bench-slurm-test-"))
    env = dict(os.environ, BENCH_SLURM_PORT=str(_free_ports()))
    pids: dict[str, int] = {}
    try:
        started = subprocess.run([str(SCRIPTS / "start_cluster.sh"), str(state)], env=env, capture_output=True,
                                 text=True, timeout=900)
        pids = {p.name: int(p.read_text()) for p in (state / "pids").glob("*")}
        if started.returncode != 0:
            pytest.fail("SLURM could not be started on this machine, so the SLURM launcher is not tested (needs root "
                        "and Debian's slurm-wlm, slurmdbd, munge, mariadb-server; deselect with -m 'not slurm'):\n"
                        + _tail(started.stderr), pytrace=False)
        yield Cluster(state, dict(env, SLURM_CONF=str(state / "etc" / "slurm.conf"), BENCH_DATA_DIR=str(DATA_DIR),
                                  BENCH_CACHE_DIR=CACHE_DIR, HYDRA_FULL_ERROR="0", WANDB_SILENT="true"))
    finally:
        stopped = subprocess.run([str(SCRIPTS / "stop_cluster.sh"), str(state)], capture_output=True, text=True,
                                 timeout=300)
        alive = [f"{name} (pid {pid})" for name, pid in pids.items() if _pid_is(pid, name)]
        if not alive:
            shutil.rmtree(state, ignore_errors=True)
        assert stopped.returncode == 0 and not alive, f"daemons left running: {alive}\n{stopped.stderr}"


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True) if path.exists() else []


def _keys(lines: list[bytes]) -> list[str]:
    return [json.loads(line)["key"] for line in lines]


def test_the_node_offers_every_cpu_of_the_machine(cluster):
    """The node's CPUs are the machine's, whatever OMP_NUM_THREADS the starting shell holds (nproc
    honours it: on two cores the suite's workers hold 1, and a 1-CPU node ran this file's jobs one
    after another)."""
    node = cluster.slurm("scontrol", "show", "node")
    assert re.search(r"\bCPUTot=(\d+)", node).group(1) == str(len(os.sched_getaffinity(0))), node


def test_sweep_runs_as_a_job_array_and_reports(cluster, tmp_path):
    sweep, name = tmp_path / "sweep", f"bench-sweep-{uuid.uuid4().hex[:6]}"
    swept = ["decoder.window=1,2", "dataset.limit=2", "gen.max_new_tokens=8"]
    out = cluster.run(cluster.bench(name, sweep, *swept))
    assert out.returncode == 0, _tail(out.stderr + out.stdout, 60)

    tasks = cluster.accounted(name, tasks=2)  # the array's two tasks ran under SLURM, and finished
    job = next(iter(tasks)).split("_")[0]
    assert tasks == {f"{job}_0": "COMPLETED", f"{job}_1": "COMPLETED"}

    runs = sorted(p.parent for p in sweep.rglob("records.jsonl"))
    # Named by the overrides alone: no launcher setting, no interpolation, no threads.
    fixed = ["model=tiny-random", "decoder=lookahead", "dataset.limit=2", "gen.max_new_tokens=8"]
    assert [r.name for r in runs] == [",".join(sorted(fixed + [f"decoder.window={w}"])) for w in (1, 2)]
    for run in runs:
        assert _keys(_lines(run / "records.jsonl")) == ["HumanEval/0#0", "HumanEval/1#0"]
        assert (run / "summary.csv").is_file()
        # threads came from the task's SLURM_CPUS_PER_TASK (cpus_per_task=1), not torch's default
        assert "\nthreads: 1\n" in (run / "config.yaml").read_text()

    report = cluster.run([sys.executable, "-m", "bench.report", str(sweep), "--out", str(tmp_path / "report")])
    assert report.returncode == 0, report.stderr
    table = pd.read_csv(tmp_path / "report" / "report.csv")
    assert list(table["decoder.window"]) == [1, 2] and list(table["records"]) == [2, 2]


def _wait(what: str, condition, timeout: float, process: subprocess.Popen | None = None, log: Path | None = None,
          poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while not condition():
        if process is not None and process.poll() is not None:
            pytest.fail(f"the submitting command ended (rc {process.returncode}) before {what}:\n"
                        + _tail(log.read_text() if log else "", 40), pytrace=False)
        assert time.monotonic() < deadline, f"no {what} after {timeout:.0f}s"
        time.sleep(poll)


@pytest.fixture(scope="module")
def time_limited(cluster, tmp_path_factory):
    """A run far longer than its 1-minute limit. Submitted by the first test that asks, so that it
    waits out its minute beside that test; test_timed_out_task_stops_at_the_limit checks it."""
    tmp = tmp_path_factory.mktemp("time_limit")
    sweep, name, log = tmp / "sweep", f"bench-limit-{uuid.uuid4().hex[:6]}", tmp / "submit.log"
    # signal_delay_s=15: the warning SIGUSR2 comes after the run has started, not while Python
    # still imports (SLURM sends it at its first check past limit - delay: with the default 120 s
    # and a 1-minute limit that is at once).
    submitter = cluster.start(cluster.bench(name, sweep, "decoder.window=2", "gen.max_new_tokens=1024",
                                            "hydra.launcher.signal_delay_s=15", timeout_min=1), log)
    yield sweep, name, log, submitter
    if submitter.poll() is None:
        submitter.kill()


def test_stopped_task_ends_in_seconds_and_resume_completes_it(cluster, tmp_path, time_limited):
    """What SLURM sends: SIGUSR2 signal_delay_s before the time limit (the run goes on), SIGTERM on
    scancel or at the limit (the run stops at once, not KillWait later), and a resumed run ends
    with every record exactly once."""
    n = 16  # far more than run before the scancel (about one prompt a second), few to resume
    sweep, name = tmp_path / "sweep", f"bench-stop-{uuid.uuid4().hex[:6]}"
    swept = ["decoder.window=2", f"dataset.limit={n}", "gen.max_new_tokens=64"]
    log = tmp_path / "submit.log"
    submitter = cluster.start(cluster.bench(name, sweep, *swept), log)
    try:
        records = lambda: next(iter(sweep.glob("*/records.jsonl")), sweep / "none")  # noqa: E731
        _wait("first record", lambda: len(_lines(records())) >= 1, 300, submitter, log)
        job = cluster.slurm("squeue", "-h", "-n", name, "-o", "%F").split()[0]

        # SIGUSR2, as SLURM sends it signal_delay_s before the time limit: generation goes on.
        before = len(_lines(records()))
        cluster.slurm("scancel", "--signal=USR2", job)
        _wait("record after SIGUSR2", lambda: len(_lines(records())) > before, 60, submitter, log)
        assert cluster.queued(job) == ["RUNNING"]

        # scancel: SIGTERM, and SIGKILL KillWait later. The task must be gone in seconds.
        task_log = sweep / ".submitit" / job / f"{job}_0_log.err"
        start = time.monotonic()
        cluster.slurm("scancel", job)
        handled = None  # when the task's handler said so: the part of `took` that is SLURM's signal delivery

        def gone() -> bool:
            nonlocal handled
            if handled is None and "stopped by SIGTERM" in task_log.read_text(errors="replace"):
                handled = time.monotonic() - start
            return not cluster.queued(job)

        _wait("end of the cancelled task", gone, 2 * KILL_WAIT_S)
        took = time.monotonic() - start
        print(f"scancel: the handler ran after {handled}s, the task was gone after {took:.1f}s")  # -rP shows it
        submitter.wait(timeout=60)  # it stops waiting once the task has written its result
    finally:
        if submitter.poll() is None:
            submitter.kill()
    output = log.read_text()
    assert took < KILL_WAIT_S / 3, f"the cancelled task took {took:.1f}s to end (its handler ran after {handled}s)"
    assert submitter.returncode != 0 and "stopped by SIGTERM" in output, _tail(output)
    assert f"resume=true hydra.sweep.dir={sweep}" in output
    assert cluster.accounted(name, tasks=1) == {job: "CANCELLED"}  # one run: a plain job, not an array

    run = records().parent
    done = _lines(run / "records.jsonl")
    assert 0 < len(done) < n and len(set(_keys(done))) == len(done)
    lock = run / "records.jsonl.lock"
    assert not lock.exists() or lock.read_text() == "", "the records were not closed (lock still names its holder)"

    # Resume into the same sweep directory: the rest is generated, nothing twice.
    again = cluster.run(cluster.bench(f"{name}-resume", sweep, *swept, "resume=true"))
    assert again.returncode == 0, _tail(again.stderr + again.stdout, 60)
    final = _lines(run / "records.jsonl")
    assert final[:len(done)] == done  # the finished records kept byte for byte
    assert _keys(final) == [f"HumanEval/{i}#0" for i in range(n)]
    assert not (run / "records.rejected.jsonl").exists()


def test_timed_out_task_stops_at_the_limit(cluster, time_limited):
    """At the time limit SLURM sends SIGTERM (then SIGKILL KillWait later): the task ends at once,
    the job is TIMEOUT, and its records are complete and unlocked, ready for resume=true."""
    sweep, name, log, submitter = time_limited
    submitter.wait(timeout=300)
    (job, state), = cluster.accounted(name, tasks=1).items()
    assert state == "TIMEOUT"
    task_log = "".join(p.read_text(errors="replace") for p in sweep.glob(f".submitit/{job}/*_log.err"))
    limit = re.search(r"CANCELLED AT (\S+) DUE TO TIME LIMIT", task_log)
    assert limit and "stopped by SIGTERM" in task_log, _tail(task_log)
    end = cluster.slurm("sacct", "-n", "-X", "-P", "-j", job, "-o", "End").split()[0]
    took = (datetime.fromisoformat(end) - datetime.fromisoformat(limit.group(1))).total_seconds()
    assert took < KILL_WAIT_S / 3, f"the task ended {took:.0f}s after the time limit's SIGTERM"
    assert submitter.returncode != 0 and "stopped by SIGTERM" in log.read_text()

    run = next(sweep.glob("*/records.jsonl")).parent
    done = _lines(run / "records.jsonl")
    assert 0 < len(done) < 164 and len(set(_keys(done))) == len(done)  # complete JSON lines, each key once
    lock = run / "records.jsonl.lock"
    assert not lock.exists() or lock.read_text() == ""


def test_sharded_leaderboard_cancelled_unit_resumes_and_merges_as_one_process(cluster, tmp_path):
    """A small Spec-Bench leaderboard (tiny-random, a question a task group, 3 entries) as 5 units of a
    job array; recycling's unit (the whole dataset: it carries state between prompts) cancelled mid-run:
    the command ends saying so, the same command submits that unit alone, which resumes from its
    records, and merges; the merged tokens, steps and acceptance are the one-process run's."""
    from test_leaderboard_cluster import BOARD, SAME, SHARDS, same_figures

    sharded, single, name = tmp_path / "sharded", tmp_path / "single", f"bench-board-{uuid.uuid4().hex[:6]}"
    # 256 tokens a turn: recycling's unit generates for several seconds after its first record
    same = [o for o in SAME if not o.startswith("gen.max_new_tokens=")] + ["gen.max_new_tokens=256"]
    command = [sys.executable, "-m", "bench.leaderboard", *BOARD, *SHARDS, *same, "hydra/launcher=slurm_cpu",
               "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=1", "hydra.launcher.timeout_min=10",
               f"hydra.launcher.name={name}", f"leaderboard.out_dir={sharded}"]
    log = tmp_path / "submit.log"
    submitter = cluster.start(command, log)
    unit = sharded / "units" / "spec_bench.recycling.q0-5"
    victim = unit / "spec_bench" / "recycling" / "records.jsonl"
    try:
        # the array's id first, so that the cancel follows the first record within a poll
        _wait("the job array", lambda: cluster.slurm("squeue", "-h", "-n", name, "-o", "%F").split(), 600,
              submitter, log)
        job = cluster.slurm("squeue", "-h", "-n", name, "-o", "%F").split()[0]
        _wait("recycling's first record", lambda: len(_lines(victim)) >= 1, 600, submitter, log, poll=0.05)
        cluster.slurm("scancel", f"{job}_4")  # recycling's: the plan's fifth unit
        submitter.wait(timeout=300)
    finally:
        if submitter.poll() is None:
            submitter.kill()
    output = log.read_text()
    assert submitter.returncode == 1, _tail(output, 40)
    assert "unit 4: stopped by SIGTERM" in output
    assert "1 of 5 units did not finish (spec_bench.recycling.q0-5)" in output
    done = _lines(victim)
    assert 0 < len(done) < 7 and len(_lines(unit / "spec_bench" / "autoregressive" / "records.jsonl")) == len(done)
    assert sorted(cluster.accounted(name, tasks=5).values()) == ["CANCELLED"] + ["COMPLETED"] * 4
    assert not (sharded / "leaderboard.csv").exists()

    again = cluster.run(command, timeout=600)
    assert again.returncode == 0, _tail(again.stderr + again.stdout, 60)
    assert len(cluster.accounted(name, tasks=6)) == 6  # the second submission: recycling's unit alone
    final = _lines(victim)
    assert final[:len(done)] == done and len(set(_keys(final))) == len(final) == 7
    attempts = json.loads((unit / "provenance.json").read_text())["attempts"]
    assert len(attempts) == 2 and all(a["slurm_job"] for a in attempts)
    board = cluster.run([sys.executable, "-m", "bench.leaderboard", *BOARD, *same, f"leaderboard.out_dir={single}"],
                        timeout=900)
    assert board.returncode == 0, _tail(board.stderr, 40)
    same_figures(sharded, single)
