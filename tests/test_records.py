import errno
import json
import os
import signal
import subprocess
import sys

import pytest

from bench.errors import BenchError
from bench.records import RecordLog, open_jsonl, read_records


def rec(key: str, **extra) -> dict:
    """The smallest valid record (bench/records.py's schema): a prompt skipped."""
    prompt_id, turn = key.split("#")
    return {"key": key, "prompt_id": prompt_id, "turn": int(turn), "decoder": "d", "model": "m", "dataset": "x",
            "status": "skipped", "reason": "test", **extra}


def line(key, **extra) -> str:
    return json.dumps(rec(key, **extra)) + "\n"


def test_append_flushes_each_line(tmp_path):
    log = RecordLog(tmp_path / "records.jsonl", resume=False)
    log.append(rec("a#0", x=1))
    # Readable by another process before close: flushed per record.
    assert [json.loads(text)["key"] for text in (tmp_path / "records.jsonl").read_text().splitlines()] == ["a#0"]
    log.append(rec("b#0", x=2))
    log.close()
    assert (tmp_path / "records.jsonl").read_text().count("\n") == 2


def test_times_are_written_to_the_microsecond_and_nothing_else_is_rounded(tmp_path):
    log = RecordLog(tmp_path / "records.jsonl", resume=False)
    log.append(rec("a#0", latency_s=0.123456789, tokens_per_s=12.3456789, score=0.987654321,
                   trace={"target_time": [0.0100000049, 0.02], "committed": [1, 2]},
                   reference={"latency_s": 1.0000004, "tokens_per_s": 3.14159265}))
    log.close()
    back = read_records(tmp_path / "records.jsonl")[0]
    assert back["latency_s"] == 0.123457 and back["trace"]["target_time"] == [0.01, 0.02]
    assert back["reference"]["latency_s"] == 1.0
    assert back["tokens_per_s"] == 12.3456789 and back["reference"]["tokens_per_s"] == 3.14159265  # rates stay
    assert back["score"] == 0.987654321 and back["trace"]["committed"] == [1, 2]


def test_existing_records_need_resume(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text(line("a#0"))
    with pytest.raises(BenchError, match="resume=true"):
        RecordLog(path, resume=False)


def test_resume_keeps_complete_lines_and_cuts_a_torn_one(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text(line("a#0") + line("b#0") + '{"key": "c#0", "tex')
    log = RecordLog(path, resume=True)
    assert "a#0" in log and "b#0" in log and "c#0" not in log
    log.append(rec("c#0"))
    log.close()
    lines = path.read_text().splitlines()
    assert [json.loads(text)["key"] for text in lines] == ["a#0", "b#0", "c#0"]


def test_resume_cuts_an_unterminated_but_parseable_line(tmp_path):
    # A line is only complete with its newline: a kill between the JSON and the "\n" loses it.
    path = tmp_path / "records.jsonl"
    path.write_text(line("a#0") + json.dumps(rec("b#0")))
    log = RecordLog(path, resume=True)
    assert "b#0" not in log
    log.close()
    assert path.read_text() == line("a#0")


def test_a_record_cannot_be_written_twice(tmp_path):
    log = RecordLog(tmp_path / "records.jsonl", resume=False)
    log.append(rec("a#0"))
    with pytest.raises(RuntimeError, match="twice"):
        log.append(rec("a#0"))


# ---- faults: every valid record survives, nothing is duplicated ----


@pytest.mark.parametrize("damage,why", [
    (b'{"key": "b#0", "tex\n', "not JSON"),
    (b'{"key": "b#0", "text": "caf\xe9"}\n', "not JSON"),  # latin-1 byte: not UTF-8
    (b'["not", "an", "object"]\n', "not a record"),
    (b'{"no_key": 1}\n', "not a record"),
    (line("a#0", again=True).encode(), "a second record of a#0"),
])
def test_resume_keeps_every_valid_record_around_a_damaged_middle_line(tmp_path, capsys, damage, why):
    path = tmp_path / "records.jsonl"
    path.write_bytes(line("a#0").encode() + damage + line("c#0").encode() + line("d#0").encode())
    log = RecordLog(path, resume=True)
    assert [k for k in ("a#0", "c#0", "d#0") if k in log] == ["a#0", "c#0", "d#0"]
    assert log.get("a#0") == rec("a#0")  # the first record of a key wins
    log.append(rec("e#0"))
    log.close()
    assert [json.loads(x)["key"] for x in path.read_text().splitlines()] == ["a#0", "c#0", "d#0", "e#0"]
    assert (tmp_path / "records.rejected.jsonl").read_bytes() == damage  # moved aside byte for byte
    warning = capsys.readouterr().err
    assert "line 2" in warning and why in warning and "kept its 3 valid records" in warning


def test_a_torn_last_line_is_moved_aside_not_deleted(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text(line("a#0") + '{"key": "b#0", "st')
    RecordLog(path, resume=True).close()
    assert path.read_text() == line("a#0")
    assert (tmp_path / "records.rejected.jsonl").read_text() == '{"key": "b#0", "st\n'


def test_a_second_writer_fails_naming_the_holder(tmp_path):
    path = tmp_path / "records.jsonl"
    first = RecordLog(path, resume=False)
    first.append(rec("a#0"))
    with pytest.raises(BenchError, match=rf"is being written by pid {os.getpid()} on .* one writer per run directory"):
        RecordLog(path, resume=True)
    first.close()
    again = RecordLog(path, resume=True)  # released on close
    assert "a#0" in again
    again.close()


@pytest.mark.slow
def test_the_lock_dies_with_its_holder(tmp_path):
    """A holder killed with SIGKILL (no cleanup) leaves no stale lock: the OS drops an flock."""
    path = tmp_path / "records.jsonl"
    holder = subprocess.Popen([sys.executable, "-c", f"""
import time
from bench.records import RecordLog
log = RecordLog({str(path)!r}, resume=False)
print("locked", flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(BenchError, match=f"pid {holder.pid} "):
        RecordLog(path, resume=True)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    RecordLog(path, resume=True).close()


def test_a_full_disk_at_resume_says_make_room_not_choose_another_directory(tmp_path, monkeypatch):
    """A full disk while resuming said "give a writable directory", which sends the
    user away from the run they should resume."""
    path = tmp_path / "records.jsonl"
    log = RecordLog(path, resume=False)
    log.append(rec("a#0"))
    log.close()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("bench.records.open_own", full)
    with pytest.raises(BenchError, match="No space left on device; nothing recorded is lost: make room, then run the "
                                         "same command with resume=true") as e:
        RecordLog(path, resume=True)
    assert "writable directory" not in str(e.value)
    monkeypatch.undo()
    assert path.read_text() == line("a#0")


def test_a_full_disk_leaves_no_torn_line(tmp_path, monkeypatch):
    path = tmp_path / "records.jsonl"
    log = RecordLog(path, resume=False)
    log.append(rec("a#0", text="x" * 100))
    real_write = os.write

    def full(fd, data):  # the disk fills halfway through the line
        real_write(fd, data[:len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("bench.records.os.write", full)
    with pytest.raises(BenchError, match="No space left on device.*1 finished records are intact.*resume=true"):
        log.append(rec("b#0", text="y" * 100))
    monkeypatch.undo()
    log.close()
    assert path.read_text() == line("a#0", text="x" * 100)
    resumed = RecordLog(path, resume=True)
    resumed.append(rec("b#0"))
    resumed.close()
    assert [json.loads(x)["key"] for x in path.read_text().splitlines()] == ["a#0", "b#0"]


def test_an_unwritable_directory_is_one_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(BenchError, match="cannot write records to .*give a writable directory"):
        RecordLog(blocker / "run" / "records.jsonl", resume=False)


def test_readers_skip_damaged_lines_with_a_warning(tmp_path, capsys):
    path = tmp_path / "records.jsonl"
    path.write_bytes(line("a#0").encode() + b"\xff\xfe\n" + line("a#0").encode() + line("b#0").encode() + b'{"key"')
    assert [r["key"] for r in read_records(path)] == ["a#0", "b#0"]
    assert "3 damaged line(s)" in capsys.readouterr().err
    assert path.read_bytes().endswith(b'{"key"')  # readers never rewrite


def test_records_from_before_the_rename_read_as_committed(tmp_path):
    """Step.accepted became Step.committed: a checked-in run written before it (its trace says
    "accepted") reads, resumes and validates as if written now, with the same counts."""
    from pathlib import Path

    old = (Path(__file__).resolve().parent.parent
           / "results/reference/leaderboard_bf16/mt_bench/spec_chain/records.jsonl.gz")
    with open_jsonl(old) as f:
        data = f.read()
    raw = [json.loads(x) for x in data.splitlines() if x.strip()]
    assert raw and all("accepted" in r["trace"] for r in raw if r["status"] == "ok")
    read = [r for r in read_records(old) if r["status"] == "ok"]
    assert len(read) == sum(r["status"] == "ok" for r in raw)
    for new, before in zip(read, (r for r in raw if r["status"] == "ok")):
        assert "accepted" not in new["trace"] and new["trace"]["committed"] == before["trace"]["accepted"]
        assert list(new["trace"]) == ["committed" if k == "accepted" else k for k in before["trace"]] + ["position"]
        assert new["trace"]["position"] == [sum(before["trace"]["accepted"][:i]) for i in range(new["steps"])]
    copy = tmp_path / "records.jsonl"
    copy.write_bytes(data)
    log = RecordLog(copy, resume=True)  # every old line valid: none moved aside
    assert all(key in log for key in (r["key"] for r in raw)) and not (tmp_path / "records.rejected.jsonl").exists()
    log.close()


def ok_record(key: str, committed: list[int], **trace) -> dict:
    """A valid record of status ok whose trace commits `committed` (and holds `trace`'s columns)."""
    n = sum(committed)
    amounts = dict.fromkeys(("tokens_per_step", "latency_s", "ttft_s", "tokens_per_s", "target_time_s", "draft_time_s",
                             "overhead_time_s", "target_flops", "draft_flops"), 1.0)
    counts = dict.fromkeys(("forward_tokens", "draft_tokens", "accepted_draft_tokens", "draft_forward_tokens"), 0)
    return rec(key, status="ok", tokens=list(range(n)), new_tokens=n, steps=len(committed), text="",
               trace={"committed": committed, "forward_tokens": [1] * len(committed), **trace}, **amounts, **counts)


def test_each_step_keeps_its_position_in_the_output(tmp_path):
    """trace.position: the new tokens committed before each step. A run writes it; a record without
    it (written before it was kept) reads with it derived; a record whose positions disagree with its
    committed tokens is damaged, and skipped like any invalid line."""
    from decoders.core.trace import Generation, Step

    gen = Generation(tokens=list(range(7)), steps=[Step(committed=c, forward_tokens=1, context_tokens=0)
                                                   for c in (1, 3, 1, 2)], ttft=0.0, stop_reason="length")
    assert gen.trace_columns()["position"] == [0, 1, 4, 5]
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (
        ok_record("a#0", [1, 3, 1, 2], position=[0, 1, 4, 5]),
        ok_record("b#0", [1, 2, 2]),  # before positions were kept
        ok_record("c#0", [1, 2, 2], position=[0, 1, 2]))))
    read = read_records(path)
    assert [r["key"] for r in read] == ["a#0", "b#0"]
    assert read[1]["trace"]["position"] == [0, 1, 3]
