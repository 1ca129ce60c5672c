import json

import pytest

from bench.errors import BenchError
from bench.records import RecordLog


def test_append_flushes_each_line(tmp_path):
    log = RecordLog(tmp_path / "records.jsonl", resume=False)
    log.append({"key": "a#0", "x": 1})
    # Readable by another process before close: flushed per record.
    assert [json.loads(l)["key"] for l in (tmp_path / "records.jsonl").read_text().splitlines()] == ["a#0"]
    log.append({"key": "b#0", "x": 2})
    log.close()
    assert (tmp_path / "records.jsonl").read_text().count("\n") == 2


def test_existing_records_need_resume(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps({"key": "a#0"}) + "\n")
    with pytest.raises(BenchError, match="resume=true"):
        RecordLog(path, resume=False)


def test_resume_keeps_complete_lines_and_cuts_a_torn_one(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps({"key": "a#0"}) + "\n" + json.dumps({"key": "b#0"}) + "\n" + '{"key": "c#0", "tex')
    log = RecordLog(path, resume=True)
    assert "a#0" in log and "b#0" in log and "c#0" not in log
    log.append({"key": "c#0"})
    log.close()
    lines = path.read_text().splitlines()
    assert [json.loads(l)["key"] for l in lines] == ["a#0", "b#0", "c#0"]


def test_resume_cuts_an_unterminated_but_parseable_line(tmp_path):
    # A line is only complete with its newline: a kill between the JSON and the "\n" loses it.
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps({"key": "a#0"}) + "\n" + json.dumps({"key": "b#0"}))
    log = RecordLog(path, resume=True)
    assert "b#0" not in log
    log.close()
    assert path.read_text() == json.dumps({"key": "a#0"}) + "\n"


def test_a_record_cannot_be_written_twice(tmp_path):
    log = RecordLog(tmp_path / "records.jsonl", resume=False)
    log.append({"key": "a#0"})
    with pytest.raises(RuntimeError, match="twice"):
        log.append({"key": "a#0"})
