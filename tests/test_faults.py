"""Fault injection through the command line: damaged files, a
second writer, unwritable places, Ctrl-C. Each ends in one line (exit 2, or 130 for Ctrl-C)
with nothing already written lost."""
import json
import os
import shutil
import signal
from pathlib import Path

import pandas as pd
import pytest

from helpers import CACHE_DIR, DATA_DIR, REPO, run_cli, run_python, start_cli, wait_for_records

pytestmark = pytest.mark.slow  # every test here starts a process

TINY = ["model=tiny-random", "device=cpu", "gen.max_new_tokens=8"]
HEADS = REPO / "adapters" / "smollm2-135m-heads4.safetensors"
ADAPTER = REPO / "adapters" / "smollm2-135m-self4.safetensors"


def one_line_error(out, message: str, code: int = 2) -> None:
    assert out.returncode == code, (out.returncode, out.stderr[-2000:])
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    # Loading a real model may print its progress bar first; the error is one line, and the last.
    errors = [x for x in lines if x.startswith("error: ")]
    assert len(errors) == 1 and errors[0] == lines[-1] and message in errors[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr + out.stdout


def weights(kind: str, tmp_path: Path, source: Path) -> Path:
    path = tmp_path / f"{kind}.safetensors"
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "truncated":
        path.write_bytes(source.read_bytes()[:5000])
    else:  # another format under the right name
        path.write_text('{"format": "not safetensors"}')
    return path


@pytest.mark.parametrize("kind", ["empty", "truncated", "json"])
def test_damaged_heads_file(tmp_path, kind):
    path = weights(kind, tmp_path, HEADS)
    out = run_cli(*TINY, "dataset.limit=1", "decoder=medusa", f"decoder.heads={path}",
                  f"hydra.run.dir={tmp_path / 'r'}")
    one_line_error(out, f"decoder.heads: {path} is not a readable safetensors file")


@pytest.mark.parametrize("kind", ["empty", "truncated", "json"])
def test_damaged_adapter_file(tmp_path, kind):
    path = weights(kind, tmp_path, ADAPTER)
    out = run_cli("dataset.limit=1", "gen.max_new_tokens=8", "decoder=spec_chain", f"draft.adapter={path}",
                  f"hydra.run.dir={tmp_path / 'r'}")
    one_line_error(out, f"draft.adapter: {path} is not a readable safetensors file")


def test_empty_model_directory(tmp_path):
    (tmp_path / "model").mkdir()
    out = run_cli("model=codellama-7b", f"model.path={tmp_path / 'model'}", f"hydra.run.dir={tmp_path / 'r'}")
    one_line_error(out, f"model.path={tmp_path / 'model'} is not a model directory (no config.json)")


def test_truncated_model_weights(tmp_path):
    from bench.models import GGUFPackageModel

    source = GGUFPackageModel(cache_dir=CACHE_DIR).local_dir()
    model = tmp_path / "model"
    model.mkdir()
    for f in source.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, model / f.name)
    (model / "model.safetensors").write_bytes((source / "model.safetensors").read_bytes()[:100_000])
    out = run_cli("model=codellama-7b", f"model.path={model}", "gen.max_new_tokens=8",
                  f"hydra.run.dir={tmp_path / 'r'}")
    one_line_error(out, f"could not load model.path={model}")
    assert "damaged or incomplete" in out.stderr


@pytest.mark.parametrize("body", [b"not json at all", b'{"format": "other"}', b"\xff\xfe"])
def test_damaged_acceptance_file(tmp_path, body):
    path = tmp_path / "acceptance.json"
    path.write_bytes(body)
    out = run_cli(*TINY, "decoder=sequoia", f"decoder.acceptance_file={path}", f"hydra.run.dir={tmp_path / 'r'}")
    one_line_error(out, f"decoder.acceptance_file: {path} is not an acceptance vector")


@pytest.mark.parametrize("content,message", [
    (b'{"id": 1, "prompt": "caf\xe9"}\n', "line 1 is not UTF-8 text (byte 0xe9 at column 25)"),
    (b'{"id": 1, "prompt": "a"}\n["a list"]\n', ":2 is a JSON list, not an object"),
    (b'{"id": 1, "prompt": "\\ud800"}\n', ":1 holds a lone surrogate escape"),
    (b'{"id": 1, "prompt": "a"}\n{"id": 2,\n', ":2 is not valid JSON"),
])
def test_damaged_jsonl_prompts(tmp_path, content, message):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(content)
    out = run_cli(*TINY, "dataset=jsonl", f"dataset.path={path}", f"hydra.run.dir={tmp_path / 'r'}")
    one_line_error(out, message.replace("line 1", f"{path}:1") if message.startswith("line") else message)


def test_unwritable_output_directory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the run directory should go")
    out = run_cli(*TINY, f"hydra.run.dir={blocker / 'run'}")
    one_line_error(out, f"hydra.run.dir={blocker / 'run'}: cannot write under {blocker}")
    sweep = run_cli("-m", *TINY, "decoder=autoregressive,hf_pld", f"hydra.sweep.dir={blocker / 'sweep'}")
    one_line_error(sweep, f"hydra.sweep.dir={blocker / 'sweep'}: cannot write under {blocker}")
    env = dict(os.environ, BENCH_DATA_DIR=str(DATA_DIR), BENCH_CACHE_DIR=CACHE_DIR)
    board = run_python("-m", "bench.leaderboard", "model=tiny-random", "device=cpu",
                       f"leaderboard.out_dir={blocker / 'board'}", env=env, timeout=300)
    one_line_error(board, f"leaderboard.out_dir={blocker / 'board'}: cannot write under {blocker}")


def test_read_only_filesystem(tmp_path):
    """A read-only place as root sees it (permissions do not stop root): /proc."""
    out = run_cli(*TINY, "hydra.run.dir=/proc/bench-run")
    one_line_error(out, "hydra.run.dir=/proc/bench-run: cannot write under /proc")


@pytest.mark.parametrize("overrides,message", [
    (["logger.mode=loud"], "logger.mode must be one of offline, online, disabled, got 'loud'"),
    (["logger.mode=online"], "logger.mode=online needs a wandb login"),
])
def test_bad_logger_settings(tmp_path, overrides, message):
    home = tmp_path / "home"  # no ~/.netrc: not logged in
    home.mkdir()
    env = dict(os.environ, BENCH_DATA_DIR=str(DATA_DIR), BENCH_CACHE_DIR=CACHE_DIR, HOME=str(home), WANDB_SILENT="true")
    env.pop("WANDB_API_KEY", None)
    out = run_python("-m", "bench", *TINY, "logger=wandb", *overrides, f"hydra.run.dir={tmp_path / 'r'}", env=env,
                     timeout=300)
    one_line_error(out, message)


def test_a_second_writer_into_one_run_directory_fails_naming_the_holder(tmp_path):
    """A resume started while the first run still writes (a SLURM sweep resumed under its old array
    tasks) duplicated records and exited 0: now the second writer fails in one line."""
    run = tmp_path / "run"
    args = ["model=tiny-random", "gen.max_new_tokens=64", "dataset.limit=100", f"hydra.run.dir={run}"]
    first = start_cli(*args)
    records = run / "records.jsonl"
    wait_for_records(records, 1)
    try:
        second = run_cli(*args, "resume=true")
        assert first.poll() is None, "the first run must still be writing for this test to mean anything"
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    one_line_error(second, f"is being written by pid {first.pid} on ")
    keys = [json.loads(x)["key"] for x in records.read_text().splitlines()]
    assert len(keys) == len(set(keys)) >= 1


def test_ctrl_c_says_how_to_resume_and_exits_130(tmp_path):
    run = tmp_path / "run"
    args = ["model=tiny-random", "gen.max_new_tokens=32", "dataset.limit=40", f"hydra.run.dir={run}"]
    proc = start_cli(*args, output=True)
    path = run / "records.jsonl"
    wait_for_records(path, 2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "interrupted: the finished records are in" in err
    hint = err.strip().splitlines()[-1].strip()
    assert hint.startswith("python -m bench ") and "resume=true" in hint and f"hydra.run.dir={run}" in hint
    kept = path.read_text().count("\n")
    assert 2 <= kept < 40
    resumed = run_cli(*hint.split()[3:])  # the printed command, as a user pastes it
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    keys = [json.loads(x)["key"] for x in path.read_text().splitlines()]
    assert len(keys) == 40 == len(set(keys))


def test_report_and_show_survive_failed_runs_duplicates_and_torn_lines(tmp_path):
    good = tmp_path / "sweep" / "good"
    assert run_cli(*TINY, "dataset.limit=2", f"hydra.run.dir={good}").returncode == 0
    failed = tmp_path / "sweep" / "failed"  # killed before its first record
    failed.mkdir()
    (failed / "records.jsonl").write_text("")
    lines = (good / "records.jsonl").read_text().splitlines(keepends=True)
    (good / "records.jsonl").write_text("".join(lines) + lines[0] + lines[1][:40])  # a duplicate, a torn line
    report = run_python("-m", "bench.report", tmp_path / "sweep", "--out", tmp_path / "rep")
    assert report.returncode == 0, report.stderr[-2000:]
    assert "no finished records in" in report.stderr and "2 damaged line(s)" in report.stderr
    table = pd.read_csv(tmp_path / "rep" / "report.csv")
    assert len(table) == 1 and table.loc[0, "records"] == 2  # the duplicate is not counted twice
    prompt = json.loads(lines[0])["prompt_id"]
    show = run_python("-m", "bench.show", good, "--prompt", prompt, env=dict(os.environ, BENCH_CACHE_DIR=CACHE_DIR))
    assert show.returncode == 0, show.stderr[-2000:]
