"""Safety, records, bad input, resources: every defect found is a regression test here.

Invalid records are set aside and regenerated; empty and huge prompts are skipped with a reason;
bad input to bench, bench.report, bench.show, bench.leaderboard and compare_leaderboards.py is
one line and exit code 2; bench.report streams."""
import json
import shutil
import subprocess
import sys

import pandas as pd
import pytest

from bench import report
from bench.errors import BenchError
from bench.records import invalid, iter_records, open_jsonl, read_records, records_path, run_dirs
from helpers import REPO, run_cli, run_python, writable_copy

# One small run whose prompts are the cases: ids that collide as file names (a/b, a_b), an id over
# 255 bytes, an empty prompt (raw rendering) and one too long to tokenize.
LONG_ID = "x" * 300
PROMPTS = [("a/b", "def add(a, b):"), ("a_b", "Hello"), (LONG_ID, "long id"), ("empty", ""),
           ("huge", "word " * 200_000)]
TINY = ["model=tiny-random", "gen.max_new_tokens=4", "prompt_format=raw", "progress=false"]


def _dataset(tmp) -> list[str]:
    path = tmp / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in PROMPTS))
    return ["dataset=jsonl", f"dataset.path={path}"]


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad_input")
    out = run_cli(*TINY, *_dataset(tmp), f"hydra.run.dir={tmp / 'run'}")
    assert out.returncode == 0, out.stderr[-2000:]
    return tmp / "run"


@pytest.fixture
def run_copy(run_dir, tmp_path):
    shutil.copytree(run_dir, tmp_path / "run")
    return tmp_path / "run"


def _records(run) -> dict:
    return {r["key"]: r for r in (json.loads(x) for x in (run / "records.jsonl").read_text().splitlines())}


def _rewrite(run, change: dict) -> None:
    """Replace the records named in `change` (key -> new record) in place."""
    records = _records(run)
    records.update(change)
    (run / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records.values()))


# ---- 8, 12: empty and huge prompts are skipped with their reason; the run goes on ----

@pytest.mark.slow
def test_empty_and_huge_prompts_are_skipped_with_a_reason(run_dir):
    records = _records(run_dir)
    assert [records[f"{i}#0"]["status"] for i, _ in PROMPTS] == ["ok", "ok", "ok", "skipped", "skipped"]
    assert records["empty#0"]["reason"].startswith("empty prompt")
    huge = records["huge#0"]
    assert "1000000 characters" in huge["reason"] and "context of 2048" in huge["reason"]
    assert huge["prompt_tokens"] is None and len(huge["prompt_text"]) < 2100  # not tokenized, not copied whole


@pytest.mark.slow
@pytest.mark.parametrize("decoder", [["decoder=lookahead", "gen.batch_size=2"]])
def test_an_empty_prompt_in_a_batch_is_skipped(tmp_path, decoder):
    out = run_cli(*TINY, *_dataset(tmp_path), "dataset.limit=4", *decoder, f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 0, out.stderr[-2000:]
    assert [r["status"] for r in _records(tmp_path / "run").values()] == ["ok", "ok", "ok", "skipped"]


def test_a_prompt_too_long_by_its_length_is_not_tokenized():
    from bench.datasets import Prompt
    from bench.prompts import prepare, rendering_for

    class Tokenizer:  # a 10-character longest token; tokenizing at all fails the test
        chat_template = None

        def __len__(self):
            return 2

        def convert_ids_to_tokens(self, ids):
            return ["a", "b" * 10]

        def __call__(self, text, **kwargs):
            raise AssertionError("tokenized")

    tokenizer = Tokenizer()
    assert rendering_for(tokenizer, "auto") == "raw"  # a base model: raw, so the empty prompt must work
    text, ids, why = prepare(tokenizer, Prompt("p", ["x" * 50_000_000], ["x" * 50_000_000]), 0, [], "raw", 2048)
    assert ids is None and "at least 2500000 tokens" in why and len(text) < 2100


# ---- 7: well-formed but invalid records are rejected on read, and regenerated on resume ----

def _broken(record: dict, change: dict) -> dict:
    record = json.loads(json.dumps(record))
    for path, value in change.items():
        node, *rest = path.split(".")
        if rest:
            record[node][rest[0]] = value
        elif value is KeyError:
            del record[node]
        else:
            record[node] = value
    return record


INVALID = {
    "key only": ({"key": "a_b#0"}, "no prompt_id"),
    "negative steps": ({"steps": -3}, "steps is -3, not an integer >= 1"),
    "tokens as a string": ({"tokens": "1 2 3 4"}, "tokens is"),
    "inf tokens/s": ({"tokens_per_s": float("inf")}, "tokens_per_s is Infinity, not a finite number >= 0"),
    "NaN latency": ({"latency_s": float("nan")}, "latency_s is NaN"),
    "no latency": ({"latency_s": KeyError}, "no latency_s"),
    "a bool count": ({"new_tokens": True}, "new_tokens is true"),
    "unknown status": ({"status": "done"}, 'status is "done"'),
    "key not prompt#turn": ({"turn": 1}, "is not prompt_id#turn"),
    "tokens not new_tokens": ({"new_tokens": 3}, "4 tokens but new_tokens 3"),
    "short trace": ({"trace.committed": [1]}, "trace column's length"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", INVALID)
def test_an_invalid_record_names_its_field(run_dir, case):
    change, why = INVALID[case]
    record = _records(run_dir)["a_b#0"]
    assert invalid(record) is None
    broken = change if "key" in change else _broken(record, change)
    assert why in invalid(broken)


@pytest.mark.slow
def test_existing_reference_records_are_valid():
    paths = [records_path(run) for run in run_dirs(REPO / "results" / "reference")]
    assert paths and all(path.name == "records.jsonl.gz" for path in paths)  # tests/test_layout.py: kept small
    for path in paths:
        with open_jsonl(path) as f:
            lines = f.read().splitlines()
        assert len(read_records(path)) == len(lines), path


@pytest.mark.slow
def test_resume_sets_invalid_records_aside_and_generates_them_again(run_dir, run_copy):
    records = _records(run_copy)
    bad = {"a_b#0": {"key": "a_b#0"}, "a/b#0": _broken(records["a/b#0"], {"steps": -5})}
    _rewrite(run_copy, bad)
    out = run_cli(*TINY, *_dataset(run_dir.parent), f"hydra.run.dir={run_copy}", "resume=true")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "2 damaged line(s)" in out.stderr and "invalid record (no prompt_id)" in out.stderr
    again = _records(run_copy)
    assert (again["a_b#0"]["tokens"] == records["a_b#0"]["tokens"]
            and again["a/b#0"]["steps"] == records["a/b#0"]["steps"])
    rejected = [json.loads(x) for x in (run_copy / "records.rejected.jsonl").read_text().splitlines()]
    assert {r["key"]: r for r in rejected} == bad  # moved aside whole
    summary = pd.read_csv(run_copy / "summary.csv")
    assert len(summary) == 1 and (summary.loc[0, "records"], summary.loc[0, "skipped"]) == (3, 2)


@pytest.mark.slow
def test_a_deeply_nested_line_is_a_damaged_line_for_every_reader(run_dir, run_copy, tmp_path):
    """A line of 100000 '[' in records.jsonl crashed resume, bench.report and
    bench.show with RecursionError; it is a damaged line (set aside, redone), and in a dataset file one
    line naming the file and line, exit 2."""
    with open(run_copy / "records.jsonl", "ab") as f:
        f.write(b"[" * 100_000 + b"\n")
    assert len(read_records(run_copy / "records.jsonl")) == len(_records(run_dir))  # the reader skips it
    out = run_python("-m", "bench.report", run_copy, timeout=300)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    out = run_cli(*TINY, *_dataset(run_dir.parent), f"hydra.run.dir={run_copy}", "resume=true")
    assert out.returncode == 0 and "1 damaged line(s)" in out.stderr and "nested too deeply" in out.stderr, \
        out.stderr[-2000:]
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"id": "a", "prompt": "hi"}\n' + "[" * 100_000 + "\n")
    out = run_cli(*TINY, "dataset=jsonl", f"dataset.path={deep}", f"hydra.run.dir={tmp_path / 'fresh'}")
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert out.returncode == 2 and len(lines) == 1 and f"{deep}:2 is JSON nested too deeply" in lines[0], out.stderr


@pytest.mark.slow
def test_a_record_holding_a_lone_surrogate_is_a_damaged_line(run_dir, run_copy):
    """A \\ud800-style escape alone in a record decodes to a string no file or
    table can encode: bench.report failed with UnicodeEncodeError writing its tables. It is a
    damaged line; a surrogate pair (an emoji, as json.dumps writes it) is text and stays."""
    records = _records(run_dir)
    first, second = list(records)[:2]
    _rewrite(run_copy, {first: {**records[first], "category": "cat\udfff"},
                        second: {**records[second], "text": records[second]["text"] + "\U0001F600"}})
    assert b"\\ud83d\\ude00" in (run_copy / "records.jsonl").read_bytes()
    assert [r["key"] for r in read_records(run_copy / "records.jsonl")] == list(records)[1:]
    out = run_python("-m", "bench.report", run_copy, timeout=300)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "1 damaged line(s) (line 1: not text (a lone surrogate escape))" in out.stderr, out.stderr


@pytest.mark.slow
def test_resume_sets_aside_a_record_of_another_prompt(run_dir, run_copy):
    """A valid record of a prompt the run does not have, appended to records.jsonl,
    was kept on resume and counted (3 prompts at the end of the run where summary.csv said 2); it is
    set aside as a damaged line is, and every count agrees."""
    records = _records(run_copy)
    stranger = dict(records["a_b#0"], key="stranger#0", prompt_id="stranger")
    assert invalid(stranger) is None
    with open(run_copy / "records.jsonl", "a") as f:
        f.write(json.dumps(stranger) + "\n")
    out = run_cli(*TINY, *_dataset(run_dir.parent), f"hydra.run.dir={run_copy}", "resume=true")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "a record of stranger#0, which this run does not have" in out.stderr
    assert set(_records(run_copy)) == set(records)  # the run's own records, and only those
    rejected = [json.loads(x) for x in (run_copy / "records.rejected.jsonl").read_text().splitlines()]
    assert [r["key"] for r in rejected] == ["stranger#0"]
    rows, _ = report.report([str(run_copy)])
    assert int(rows.loc[0, "records"]) == int(pd.read_csv(run_copy / "summary.csv").loc[0, "records"])


@pytest.mark.slow
@pytest.mark.parametrize("field", ["decoder", "model", "dataset"])
def test_resume_sets_aside_a_record_of_other_settings(run_dir, run_copy, field):
    """A record of this run's prompt but another decoder, model or dataset (a line
    copied from another run) was kept on resume and summarised as this run's; it is set aside and
    the prompt is run again."""
    records = _records(run_copy)
    lines = (run_copy / "records.jsonl").read_text().splitlines(keepends=True)
    foreign = dict(records["a_b#0"], **{field: "someone-else"})
    assert invalid(foreign) is None
    (run_copy / "records.jsonl").write_text(
        "".join(x for x in lines if json.loads(x)["key"] != "a_b#0") + json.dumps(foreign) + "\n")
    out = run_cli(*TINY, *_dataset(run_dir.parent), f"hydra.run.dir={run_copy}", "resume=true")
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"a record of {field} 'someone-else', where this run's is" in out.stderr, out.stderr[-2000:]
    assert _records(run_copy)["a_b#0"][field] == records["a_b#0"][field]  # run again, as this run
    rejected = [json.loads(x) for x in (run_copy / "records.rejected.jsonl").read_text().splitlines()]
    assert [r[field] for r in rejected] == ["someone-else"]


@pytest.mark.slow
def test_readers_leave_an_invalid_record_out_of_the_summary(run_copy, tmp_path, capsys):
    clean = tmp_path / "clean"
    shutil.copytree(run_copy, clean)
    records = _records(clean)
    del records["a_b#0"]
    (clean / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records.values()))
    _rewrite(run_copy, {"a_b#0": _broken(_records(run_copy)["a_b#0"], {"tokens_per_s": float("inf")})})
    with_inf, _ = report.report([str(run_copy)])
    without, _ = report.report([str(clean)])
    assert with_inf.loc[0, "tokens_per_s_median"] == without.loc[0, "tokens_per_s_median"]
    assert "invalid record (tokens_per_s is Infinity" in capsys.readouterr().err


# ---- 11, 12: bench.report: one line and exit 2 for bad input; it streams ----

def _report_exit(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as e:
        report.main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].startswith("error: "), err
    return err[-1]


@pytest.mark.parametrize("case,message", [
    ("missing", "does not exist"), ("empty dir", "no run directories"), ("unrelated files", "no run directories"),
    ("only damaged lines", "no valid records"), ("empty records", "no valid records"),
    ("records.jsonl a directory", "Is a directory"),
])
def test_report_bad_input_is_one_line_and_exit_2(tmp_path, capsys, case, message):
    path = tmp_path / "runs"
    if case != "missing":
        (path / "run").mkdir(parents=True)
    if case == "unrelated files":
        (path / "run" / "notes.txt").write_text("hello\n")
    elif case == "only damaged lines":
        (path / "run" / "records.jsonl").write_text('{"key": "a#0"}\nnot json\n')
    elif case == "empty records":
        (path / "run" / "records.jsonl").write_text("")
    elif case == "records.jsonl a directory":
        (path / "run" / "records.jsonl").mkdir()
    assert message in _report_exit(capsys, str(path))


def test_report_searches_a_bounded_tree(tmp_path, monkeypatch, capsys):
    """bench.report / walked the whole machine, /proc included, for minutes. The search stays on the
    root's file system, follows no link to a directory, and stops with one line past
    MAX_SEARCHED_DIRS directories."""
    import bench.records

    run = tmp_path / "elsewhere" / "run"
    run.mkdir(parents=True)
    (run / "records.jsonl").write_text("")
    root = tmp_path / "root"
    (root / "deep" / "er").mkdir(parents=True)
    (root / "link").symlink_to(tmp_path / "elsewhere")
    assert run_dirs(root) == [] and run_dirs(tmp_path) == [run]
    monkeypatch.setattr(bench.records, "MAX_SEARCHED_DIRS", 2)
    assert "holds more than 2 directories to search for runs" in _report_exit(capsys, str(root))
    monkeypatch.setattr(bench.records, "MAX_SEARCHED_DIRS", 2000)
    for place in ("/", "/proc"):  # stopped at the bound, or done: never a walk of every process's files
        with pytest.raises(SystemExit) as e:
            report.main([place])
        assert e.value.code == 2 and "error: " in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("out", ["a file", "/proc/bench-report"])
def test_report_unwritable_out_is_one_line_and_exit_2(run_dir, tmp_path, capsys, out):
    if out == "a file":
        out = tmp_path / "report"
        out.write_text("in the way")
        assert "a file, not a directory; choose a new or empty directory" in _report_exit(
            capsys, str(run_dir), "--out", str(out))
    else:
        assert "give a writable directory" in _report_exit(capsys, str(run_dir), "--out", str(out))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["a run directory", "the user's directory", "a planted link"])
def test_report_out_writes_only_into_its_own_directory(run_dir, tmp_path, capsys, case):
    """--out wrote report.csv and report.md into any existing directory (a run's,
    conf/, $HOME) and through a link planted as report.csv. A new directory, and a report's own
    again, are written; nothing else is touched."""
    out, outside = tmp_path / "out", tmp_path / "outside.txt"
    outside.write_text("keep me")
    if case == "a run directory":
        out = run_dir
    elif case == "the user's directory":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    else:
        out.mkdir()
        (out / "report.csv").symlink_to(outside)
    before = {p: p.read_bytes() for p in out.iterdir() if p.is_file() and not p.is_symlink()}
    message = _report_exit(capsys, str(run_dir), "--out", str(out))
    expected = "a symbolic link" if case == "a planted link" else "holds more than a report"
    assert expected in message and "--out" in message
    assert outside.read_text() == "keep me"
    assert {p: p.read_bytes() for p in before} == before and not (out / "report.md").exists()
    fresh = tmp_path / "fresh"
    for _ in range(2):  # new, then a report's own
        report.main([str(run_dir), "--out", str(fresh)])
        assert sorted(p.name for p in fresh.iterdir()) == ["report.csv", "report.md"]


@pytest.mark.slow
def test_report_streams_records_into_columns_without_their_bulk(run_dir, monkeypatch):
    """Records are read one at a time into the columns a summary needs (bench/report.py, NUMBERS
    and OBJECTS): tokens, text and traces are never held, so that a report of a million records
    needs the memory of its columns only."""
    taken = []
    summarize = report.metrics.summarize
    monkeypatch.setattr(report.metrics, "summarize",
                        lambda records, **kw: taken.append(records) or summarize(records, **kw))
    read = []
    monkeypatch.setattr(report, "iter_records",
                        lambda path, **rule: (read.append(r) or r for r in iter_records(path, **rule)))
    table, _ = report.report([str(run_dir)])
    assert table.loc[0, "records"] == 3 and table.loc[0, "skipped"] == 2 and len(read) == 5
    assert len(taken[0]) == 5 and not {"tokens", "text", "trace", "prompt_text"} & set(taken[0].columns)
    assert set(taken[0].columns) <= set(report.NUMBERS + report.OBJECTS)
    assert taken[0]["new_tokens"].dtype == "float64"  # 8 bytes a record, not a Python object


# ---- 9, 13: bench.show ----

@pytest.mark.slow
def test_show_pages_of_ids_that_collide_or_are_long_are_distinct_and_short(run_dir, tmp_path, capsys):
    from bench.show import main, page_name, show

    pages = {show(run_dir, i, use_colour=False) for i in ("a/b", "a_b", LONG_ID)}
    assert len(pages) == 3 and all(p.is_file() and len(p.name.encode()) <= 255 for p in pages)
    assert page_name("HumanEval-0", 0) == "HumanEval-0_0.html"  # plain ids keep their name
    with pytest.raises(SystemExit) as e:
        main([str(run_dir), "--prompt", "y" * 300])
    assert e.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1].startswith("error: no record")


@pytest.mark.slow
def test_show_skips_a_record_whose_tokens_are_a_string(run_copy, capsys):
    from bench.show import main

    _rewrite(run_copy, {"a_b#0": _broken(_records(run_copy)["a_b#0"], {"tokens": "1 2 3 4"})})
    with pytest.raises(SystemExit) as e:
        main([str(run_copy), "--prompt", "a_b"])
    assert e.value.code == 2 and "invalid record (tokens is" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("target", ["records.jsonl", "config.yaml", "a file of the user's"])
def test_show_out_never_replaces_a_file_that_is_not_its_page(run_copy, tmp_path, capsys, target):
    """--out may name a new file or an earlier page of bench.show: a run's records, its config or
    any other file is refused in one line and left as it was."""
    from bench.show import main

    out = tmp_path / "mine.txt" if target == "a file of the user's" else run_copy / target
    if not out.exists():
        out.write_text("mine")
    before = out.read_bytes()
    with pytest.raises(SystemExit) as e:
        main([str(run_copy), "--prompt", "a_b", "--out", str(out), "--no-color"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "is not a page of bench.show" in err[0], err
    assert out.read_bytes() == before
    table, _ = report.report([str(run_copy)])
    assert table.loc[0, "records"] == 3
    page = tmp_path / "page.html"
    for _ in range(2):  # a new file, then its own page again
        main([str(run_copy), "--prompt", "a_b", "--out", str(page), "--no-color"])
        assert "a_b" in page.read_text()


@pytest.mark.slow
@pytest.mark.parametrize("link", ["show", "show/a_b_0.html"])
def test_show_writes_nothing_through_a_planted_link(run_copy, tmp_path, capsys, link):
    """A `show` directory, or a page, that is a symbolic link planted in the run directory is
    refused in one line; nothing is written where it leads."""
    from bench.show import main

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.rmtree(run_copy / "show", ignore_errors=True)  # pages another test showed from the run
    if link == "show":
        (run_copy / "show").symlink_to(elsewhere)
    else:
        (run_copy / "show").mkdir()
        (run_copy / link).symlink_to(elsewhere / "page.html")
    with pytest.raises(SystemExit) as e:
        main([str(run_copy), "--prompt", "a_b", "--no-color"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "is a symbolic link" in err[0], err
    assert list(elsewhere.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("edit, message", [
    (lambda c: c.replace("\nmodel:\n", "\nmodel: 5\nold_model:\n", 1), "model is 5, not the settings"),
    (lambda c: c.replace("  _target_: bench.models.", "  old_target: bench.models.", 1), "model has no _target_"),
    (lambda c: c.replace("\nmodel:\n", "\nmodel:\n  bogus_key: 1\n", 1), "unexpected keyword argument 'bogus_key'"),
    (lambda c: c.replace("\nmodel:\n", "\nmodel:\n  revision: ${oc.env:BENCH_UNSET_FOR_A_TEST}\n", 1),
     "BENCH_UNSET_FOR_A_TEST"),
])
def test_show_on_a_damaged_config_is_one_line(run_copy, capsys, edit, message):
    """A config.yaml whose model is not a model's settings (a number, no
    _target_, an unknown key, an unset ${oc.env:...}) was a traceback."""
    from bench.show import main

    config = run_copy / "config.yaml"
    config.write_text(edit(config.read_text()))
    with pytest.raises(SystemExit) as e:
        main([str(run_copy), "--prompt", "a_b"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and message in err[0] and "config.yaml" in err[0], err


# ---- 9: bench and bench.leaderboard: one line, exit 2, before anything runs ----

@pytest.mark.parametrize("override,message", [
    ("seed=18446744073709551616", "seed must be an integer from 0 to 2**64 - 1"),
    ("device=mps", "device=mps: this torch build cannot use mps devices"),
])
def test_seed_and_device_are_checked_before_the_run(capsys, override, message):
    from bench.__main__ import precheck

    with pytest.raises(SystemExit) as e:
        precheck(["model=tiny-random", "gen.temperature=1.0", override])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and message in err, err


@pytest.mark.parametrize("override,env,message", [
    ("gen.temperature=1e-300", None, "gen.temperature must be 0 (greedy) or at least 1e-06, got 1e-300"),
    ("threads=100000", None, "threads must be a positive integer or null (torch's default), at most this machine's"),
    ("seed=0", "a file", "cache_dir={cache}: cannot write under {cache} (a file stands in the path); set "
                         "BENCH_CACHE_DIR"),
    ("seed=0", "/proc/nope", "cache_dir=/proc/nope: cannot write under /proc"),
])
def test_settings_that_fail_mid_run_are_refused_before_it(tmp_path, monkeypatch, capsys, override, env, message):
    """A temperature whose division overflows (NaN probabilities mid-run), more threads than the machine
    has cores (out of memory after the model loaded), and a cache directory that is a file or cannot be
    made (a traceback at the model's load): one line naming the key and what is allowed, before the run
    directory is claimed."""
    from bench.__main__ import precheck

    cache = tmp_path / "cache"
    if env is not None:
        if env == "a file":
            cache.write_text("not a directory")
            env = str(cache)
        monkeypatch.setenv("BENCH_CACHE_DIR", env)
    with pytest.raises(SystemExit) as e:
        precheck(["model=tiny-random", "gen.temperature=1.0", override, f"hydra.run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and message.format(cache=cache) in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override,message", [
    ("+preset=nope", "unknown preset 'nope'; choose one of: baselines, heads"),
    ("leaderboard.nokey=1", "Could not override 'leaderboard.nokey'"),
    ("nokey=1", "Could not override 'nokey'"),
    ("seed=-1", "seed must be an integer from 0"),
    ("gen.batch_size=2", "gen.batch_size must be 1 for the leaderboard, got 2"),
    ("leaderboard.datasets=[]", "leaderboard.datasets must be a non-empty list of datasets (of gsm8k, humaneval,"),
    ("leaderboard.datasets=humaneval", "leaderboard.datasets must be a non-empty list of datasets"),
])
def test_leaderboard_bad_overrides_are_one_line_and_exit_2(tmp_path, capsys, override, message):
    from bench.leaderboard import main

    with pytest.raises(SystemExit) as e:
        main(["model=tiny-random", override, f"leaderboard.out_dir={tmp_path}"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and message in err, err


@pytest.mark.parametrize("overrides, message", [
    (["decoder=lookahead", "decoder.window=auto", "decoder.auto_windows=[]"],
     "decoder: decoder.auto_windows must be a non-empty list of integers >= 1, got []"),
    (["decoder=lookahead", "decoder.ngram=auto", "decoder.auto_ngrams=[]"],
     "decoder: decoder.auto_ngrams must be a non-empty list of integers >= 2, got []"),
    (["decoder=lookahead", "decoder.auto_windows=[1,x]"], "decoder: decoder.auto_windows[] must be an integer >= 1"),
    (["decoder=sequoia", "decoder.tree=auto", "decoder.auto_budgets=[4,x]"],
     "decoder: decoder.auto_budgets[] must be an integer >= 1, got 'x'"),
    (["decoder=medusa", "decoder.auto_sizes=[]"], "decoder: decoder.auto_sizes must be a non-empty list"),
])
def test_an_auto_tuners_candidates_are_named_when_bad(capsys, overrides, message):
    """An empty list of candidates left auto nothing to choose from: "max() arg is an empty sequence",
    naming no key. Every auto's candidate list is checked by one helper (contract.check_list)."""
    from bench.__main__ import precheck

    with pytest.raises(SystemExit) as e:
        precheck(["model=tiny-random", *overrides])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and message in err, err


def test_a_slurm_sweep_without_slurm_is_refused_before_hydra_writes(tmp_path, monkeypatch, capsys):
    """hydra/launcher=slurm_cpu where sbatch and srun are missing was submitit's RuntimeError, after
    Hydra had written multirun.yaml into the sweep directory: one line, and nothing written."""
    from bench.__main__ import precheck

    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # no sbatch, no srun
    sweep = tmp_path / "sweep"
    with pytest.raises(SystemExit) as e:
        precheck(["-m", "hydra/launcher=slurm_cpu", "model=tiny-random", "seed=0,1", f"hydra.sweep.dir={sweep}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "no sbatch or srun on its PATH" in err[0], err
    assert not sweep.exists()


# What needs only the composed config is refused before torch is imported, which
# takes seconds (the CLI cases above spent most of their time on it to print one line).
BEFORE_TORCH = [
    ("bench", ["seed=-1"], "seed must be an integer from 0 to 2**64 - 1, got -1"),
    ("bench", ["-m", "seed=1,-1"], "seed must be an integer from 0 to 2**64 - 1, got -1"),  # the second job
    ("bench", ["seed=abc"], "seed must be an integer, got 'abc'"),
    ("bench", ["quality=no"], "quality must be true or false, got 'no'"),
    ("bench", ["gen.max_new_tokens=0"], "gen.max_new_tokens must be an integer >= 1, got 0"),
    ("bench", ["gen.temperature=inf"], "gen.temperature must be a finite number, got inf"),
    ("bench", ["check_lossless=true", "gen.temperature=0.7"], "check_lossless=true compares against autoregressive"),
    ("bench", ["gen.batch_size=0"], "gen.batch_size must be an integer >= 1, got 0"),
    ("bench", ["threads=0"], "threads must be a positive integer or null"),
    ("bench", ["dataset.limit=0"], "dataset.limit must be a positive integer or null (all), got 0"),
    ("bench", ["prompt_format=bogus"], "prompt_format='bogus' is not one of auto, chat, raw"),
    ("bench", ["decoder=nope"], "unknown decoder 'nope'; choose one of: autoregressive, bpd,"),
    ("bench.leaderboard", ["seed=-1"], "seed must be an integer from 0 to 2**64 - 1, got -1"),
    ("bench.leaderboard", ["gen.batch_size=2"], "gen.batch_size must be 1 for the leaderboard, got 2"),
    ("bench.leaderboard", ["leaderboard.limit=0"], "leaderboard.limit must be an integer >= 1, got 0"),
    ("bench.leaderboard", ["leaderboard.only=[nope]"], "leaderboard.only: unknown label(s) ['nope']"),
    ("bench.leaderboard", ["threads=0"], "threads must be a positive integer or null"),
    ("bench.leaderboard", ['+leaderboard.decoders.x=["decoder=lookahead","quality=no"]',  # an entry's own setting
                           "leaderboard.only=[autoregressive,x]"], "quality must be true or false, got 'no'"),
    ("bench.leaderboard", ["+preset=nope"], "unknown preset 'nope'"),
]


def run_importing(module: str, *args: str) -> tuple[subprocess.CompletedProcess, set[str], list[str]]:
    """`python -X importtime -m module args`: the result, the modules it imported, and what else it
    printed on stderr."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", module, *args], capture_output=True, text=True,
                         cwd=REPO, timeout=300)
    lines = out.stderr.splitlines()
    imported = {line.rsplit("|", 1)[1].strip() for line in lines if line.startswith("import time:")}
    return out, imported, [line for line in lines if line.strip() and not line.startswith("import time:")]


@pytest.mark.slow
@pytest.mark.parametrize("module,overrides,message", BEFORE_TORCH,
                         ids=[f"{m} {' '.join(o)}" for m, o, _ in BEFORE_TORCH])
def test_a_bad_setting_is_refused_before_torch_is_imported(tmp_path, module, overrides, message):
    where = f"leaderboard.out_dir={tmp_path}" if module == "bench.leaderboard" else f"hydra.sweep.dir={tmp_path}"
    out, imported, said = run_importing(module, "model=tiny-random", *overrides, where)
    assert out.returncode == 2 and len(said) == 1 and message in said[0], said
    heavy = imported & {"torch", "transformers", "decoders"}
    assert not heavy, sorted(heavy)


# ---- 9, 13: datasets ----

@pytest.mark.parametrize("content", [b"not gzip at all\n", "truncated"])
def test_a_corrupt_gz_dataset_is_one_line(tmp_path, content):
    import gzip

    from bench.datasets import JsonlPrompts

    path = tmp_path / "prompts.jsonl.gz"
    whole = gzip.compress(b'{"id": "a", "prompt": "x"}\n' * 100)
    path.write_bytes(whole[:30] if content == "truncated" else content)
    with pytest.raises(BenchError, match="prompts.jsonl.gz cannot be read"):
        JsonlPrompts(path=str(path)).load()


def test_a_duplicate_id_is_named(tmp_path):
    from bench.datasets import JsonlPrompts

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"id": "a", "prompt": "x"}\n{"id": "q7", "prompt": "y"}\n{"id": "q7", "prompt": "z"}\n')
    with pytest.raises(BenchError, match="prompts.jsonl:3: field 'id' repeats id 'q7' of .*prompts.jsonl:2"):
        JsonlPrompts(path=str(path)).load()
    # A line without an id is named by its position; a later id equal to that
    # position was a bare "duplicate", naming neither line.
    path.write_text('{"prompt": "x"}\n{"id": "0", "prompt": "y"}\n')
    with pytest.raises(BenchError, match="jsonl:2: field 'id' repeats id '0' of .*jsonl:1; .*jsonl:1 has no 'id' "
                                         "field, so it is named '0' by its position"):
        JsonlPrompts(path=str(path)).load()


def test_fast_path_auto_shows_progress_on_a_terminal(tmp_path, monkeypatch):
    from decoders.tuning import profile
    from helpers import tiny_lm

    bars = []
    monkeypatch.setattr(profile, "forward_samples", lambda lm, top, repeats, sizes: {k: [1e-3] for k in (0, *sizes)})
    monkeypatch.setattr(profile, "tqdm", lambda items, **kw: bars.append(kw) or items)
    profile.choose_fast_path(tiny_lm(), tmp_path)
    assert "measuring kernels" in bars[0]["desc"] and bars[0]["disable"] is None  # None: shown on a TTY only


# ---- 9, 10: scripts/compare_leaderboards.py ----

def _compare(*args) -> subprocess.CompletedProcess:
    return run_python(REPO / "scripts" / "compare_leaderboards.py", *map(str, args))


@pytest.mark.slow
def test_compare_leaderboards_fails_on_missing_prompts_and_bad_paths(tmp_path):
    jacobi = REPO / "results" / "reference" / "leaderboard" / "gsm8k" / "jacobi"
    shutil.copytree(jacobi, tmp_path / "before" / "gsm8k" / "jacobi")  # records.jsonl.gz, as checked in
    writable_copy(jacobi, tmp_path / "after" / "gsm8k" / "jacobi")
    after = tmp_path / "after" / "gsm8k" / "jacobi" / "records.jsonl"
    after.write_text("".join(after.read_text().splitlines(keepends=True)[:2]))  # 3 of 5 prompts lost
    out = _compare(tmp_path / "before", tmp_path / "after")
    assert out.returncode == 1 and "| 3 only before |" in out.stdout and "all identical: False" in out.stdout
    for args in ([], [tmp_path / "nope", tmp_path / "after"], [tmp_path, tmp_path / "after"]):
        out = _compare(*args)
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("override", ["quality=no", "check_lossless=off", "resume=maybe", "warmup=1", "progress=yes"])
def test_a_switch_that_is_not_a_boolean_is_refused_before_the_run_directory(tmp_path, override):
    """A non-empty string is true to Python, so quality=no scored (and ran code),
    check_lossless=off checked, resume=maybe was saved as given. One line naming the key, exit 2,
    and the run directory is never made."""
    run_dir = tmp_path / "run"
    out = run_cli(*TINY, "dataset=gsm8k", "dataset.limit=1", override, f"hydra.run.dir={run_dir}")
    key, value = override.split("=")
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    shown = value if value.isdigit() else repr(value)  # warmup=1 is an integer to Hydra
    assert len(lines) == 1 and f"{key} must be true or false, got {shown}" in lines[0], out.stderr[-2000:]
    assert not run_dir.exists()


@pytest.mark.slow
@pytest.mark.parametrize("override, message", [
    ("dtype=int8", "model: dtype='int8' is not supported; use auto, float32,"),
    ("dtype=[1]", "model: dtype=[1] is not supported"),
    ("prompt_format=bogus", "prompt_format='bogus' is not one of auto, chat, raw"),
])
def test_a_bad_dtype_or_prompt_format_is_refused_before_the_run_directory(tmp_path, override, message):
    """Both were refused only after the run directory was claimed (config.yaml and
    an empty records.jsonl left behind) and, for prompt_format, after the model was loaded."""
    run_dir = tmp_path / "run"
    out = run_cli(*TINY, "dataset=gsm8k", "dataset.limit=1", override, f"hydra.run.dir={run_dir}")
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr[-2000:]
    assert not run_dir.exists()


@pytest.mark.slow
@pytest.mark.parametrize("reader", ["bench.report", "bench.show", "a dataset file"])
def test_a_fifo_for_records_or_prompts_is_one_line_not_a_hang(run_copy, tmp_path, reader):
    """bench.report waited for ever on a records.jsonl that was a FIFO (no writer
    ever comes). Every reader of records and datasets opens without waiting and refuses what is not
    a regular file."""
    import os
    if reader == "a dataset file":
        fifo = tmp_path / "prompts.jsonl"
        os.mkfifo(fifo)
        argv = ["-m", "bench", *TINY, "dataset=jsonl", f"dataset.path={fifo}", f"hydra.run.dir={tmp_path / 'r'}"]
    else:
        fifo = run_copy / "records.jsonl"
        fifo.unlink()
        os.mkfifo(fifo)
        argv = ["-m", reader, str(run_copy), *(["--prompt", "0"] if reader == "bench.show" else [])]
    out = run_python(*argv, timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and "not a regular file" in lines[-1], out.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("overrides, how", [
    (["decoder=lookahead", "decoder.window=1000000"], "1 + (ngram 4 - 1) x (window 1000000 + guess_set_size 1000000)"),
    (["decoder=lookahead", "decoder.window=auto", "decoder.auto_windows=[1,3000]"],
     "(window 3000 + guess_set_size 3000)"),
    (["decoder=jacobi", "decoder.block_size=5000"], "1 + block_size 5000"),
    (["decoder=eagle", "decoder.tree_size=99999"], "1 + tree size 99999"),
    (["decoder=medusa", "decoder.tree_size=auto", "decoder.auto_sizes=[4,8192]"], "1 + tree size 8192"),
    (["decoder=specinfer", "decoder.num_drafts=100", "decoder.depth=100"], "1 + num_drafts 100 x depth 100"),
    (["decoder=prompt_lookup", "decoder.num_tokens=4096"], "1 + num_tokens 4096"),
])
def test_a_step_wider_than_the_bound_is_refused_before_the_run_directory(tmp_path, overrides, how):
    """decoder.window=1000000 passed the precheck and failed allocating 1 TB after
    loading the model. The widest step a decoder's settings allow is bounded (contract.MAX_STEP_TOKENS)
    and checked with the settings: one line naming them, exit 2, no run directory."""
    run_dir = tmp_path / "run"
    out = run_cli(*TINY, "dataset=gsm8k", "dataset.limit=1", *overrides, f"hydra.run.dir={run_dir}")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    assert lines[0].startswith("error: decoder: ") and how in lines[0] and "at most 4096" in lines[0], lines[0]
    assert not run_dir.exists()


def test_a_step_that_does_not_fit_the_memory_is_refused_before_the_run_directory(tmp_path, monkeypatch):
    """Decoder sizes are bounded by what the memory estimate allows, checked before
    the run directory is claimed. Lookahead's W=G=200, N=5 feeds 1601 tokens a step: on tiny-random
    (SmolLM2's 49152-token vocabulary) about 0.6 GB of logits, refused with 200 MB free; W=G=2 fits."""
    from hydra import compose, initialize_config_dir

    from bench import runner
    from bench.registry import CONF_DIR

    monkeypatch.setattr("bench.models.free_bytes", lambda device, spread=False: 200 * 2**20)
    sizes = {"wide": ["decoder.window=200", "decoder.guess_set_size=200", "decoder.ngram=5"],
             "narrow": ["decoder.window=2", "decoder.guess_set_size=2", "decoder.ngram=5"]}
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfgs = {name: compose("config", overrides=[*TINY, "decoder=lookahead", *size, "dataset=gsm8k",
                                                   "dataset.limit=1", "gen.max_new_tokens=2", "quality=false"])
                for name, size in sizes.items()}
    with pytest.raises(BenchError) as e:
        runner.run(cfgs["wide"], tmp_path / "wide")
    message = str(e.value)
    assert "\n" not in message and "a step of 1601 tokens a row" in message and "the decoder's sizes" in message
    assert not (tmp_path / "wide").exists()
    runner.run(cfgs["narrow"], tmp_path / "narrow")  # the negative control: the same run, narrower, fits
    assert (tmp_path / "narrow" / "records.jsonl").read_text().count("\n") == 1
