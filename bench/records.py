"""records.jsonl: one line per prompt and turn, appended and fsynced as each finishes.

What it guarantees (tests/test_records.py injects each fault):
- A run killed at any moment restarts with resume=true and ends with every record exactly once.
- One writer per file: a second run into the same directory, or a resume started while the
  first still runs (a SLURM sweep resumed under old array tasks), fails in one line naming the
  holder. The lock is an flock on records.jsonl.lock, so the OS drops it when the holder dies.
- No valid record is lost to a damaged line. Resume keeps every valid line, wherever the damage
  is (a line torn by a kill, a corrupt line in the middle, bytes that are not UTF-8, a second
  record of one key), moves the other lines byte for byte to records.rejected.jsonl and says so.
  Readers (bench.report, bench.show) skip such lines with a warning.
- A line is valid when it parses and holds a record that meets SCHEMA (types, ranges, required
  fields, and the counts agreeing with each other); any other line is damaged, so a prompt whose
  record is invalid is generated again on resume, and readers never summarize it.
- A write that fails (a full disk) is cut back to the last complete record; the run stops in
  one line saying how to resume.
- No write through a symbolic link: every file a run opens in its directory (the lock, the
  records, the rejected lines, temporary files) is opened with O_NOFOLLOW (open_own), so a
  planted records.jsonl.lock -> ~/.bashrc is refused in one line, never truncated.
- Times are written to the microsecond (to_microseconds).
- A run directory may hold records.jsonl.gz instead (the checked-in reference runs, compressed
  with gzip -9 -n): every reader takes it (records_path, run_dirs, open_jsonl); it is read-only,
  so a run or leaderboard that would write into it is refused (bench.rundir.check_owned).
"""
from __future__ import annotations

import errno
import fcntl
import gzip
import json
import math
import os
import socket
import stat
import sys
import time
import zlib
from pathlib import Path

from .errors import BenchError

RECORDS = "records.jsonl"
GZIPPED = RECORDS + ".gz"  # a read-only run (results/reference/): gzip -9 -n of records.jsonl


def is_time(key: str) -> bool:
    """A field of seconds (latency_s, ttft_s, a trace's target_time, ...), not a rate (tokens_per_s)."""
    return (key.endswith("_s") or key.endswith("_time")) and not key.endswith("per_s")


def to_microseconds(value, key: str = ""):
    """`value` (a record, or any part of one) with every time rounded to the microsecond. A perf_counter
    difference's last digits are noise far below what a step's time varies by, and they made up about
    half of the checked-in records' compressed bytes (results/reference/ must travel in a small checkout)."""
    if isinstance(value, float) and is_time(key):
        return round(value, 6)
    if isinstance(value, list):
        return [to_microseconds(v, key) for v in value]
    if isinstance(value, dict):
        return {k: to_microseconds(v, k) for k, v in value.items()}
    return value


def open_jsonl(path: Path):
    """A .jsonl file, or a gzipped .jsonl.gz, opened to read bytes. Anything but a regular file is
    an OSError: a FIFO would block the reader for ever, a device never end."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO's open does not wait for a writer
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    f = os.fdopen(fd, "rb")
    if Path(path).suffix != ".gz":
        return f
    gz = gzip.GzipFile(fileobj=f, mode="rb")
    gz.myfileobj = f  # closed with it, as gzip.open(path) closes the file it opened itself
    return gz


def link_refusal(path: Path, key: str = "hydra.run.dir") -> str:
    return (f"{path} is a symbolic link; a run writes only files it made itself, never through a link: "
            f"remove it, or choose a new {key}")


def open_own(path: Path, flags: int, mode: int = 0o644) -> int:
    """os.open that refuses (one line naming the file) rather than follows a symbolic link at `path`."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise BenchError(link_refusal(path)) from None
        raise


def _read_own(path: Path) -> bytes:
    """The bytes of `path` (none if it does not exist), never through a link."""
    try:
        fd = open_own(path, os.O_RDONLY)
    except FileNotFoundError:
        return b""
    with os.fdopen(fd, "rb") as f:
        return f.read()


def records_path(run_dir: Path) -> Path:
    """A run directory's records: records.jsonl, else records.jsonl.gz; records.jsonl if neither is
    there (so that a reader's error names the file a run writes)."""
    run_dir = Path(run_dir)
    plain = run_dir / RECORDS
    return run_dir / GZIPPED if not os.path.lexists(plain) and (run_dir / GZIPPED).is_file() else plain


# The most directories a search for runs (bench.report DIR) looks through: a results tree of many
# sweeps holds thousands; `bench.report /` would otherwise walk the whole machine.
MAX_SEARCHED_DIRS = 20_000


def run_dirs(root: Path, pattern: str = "**") -> list[Path]:
    """The directories matching `pattern` under `root` that hold records (plain or gzipped), sorted.
    "**" (any depth) stays on root's file system (no /proc, no mounts), follows no links to directories,
    and looks through at most MAX_SEARCHED_DIRS directories, else one line asking for a narrower root."""
    if pattern != "**":
        return sorted({f.parent for name in (RECORDS, GZIPPED) for f in Path(root).glob(f"{pattern}/{name}")})
    root = Path(root)
    device, todo, found, searched = os.stat(root).st_dev, [root], set(), 0
    while todo:
        directory = todo.pop()
        searched += 1
        if searched > MAX_SEARCHED_DIRS:
            raise BenchError(f"{root} holds more than {MAX_SEARCHED_DIRS} directories to search for runs; give the "
                             "run, sweep or leaderboard directories themselves")
        try:
            with os.scandir(directory) as entries:
                for entry in entries:
                    if entry.name in (RECORDS, GZIPPED):  # whatever it is: its reader names what is wrong
                        found.add(directory)
                    elif entry.is_dir(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_dev == device:
                        todo.append(Path(entry.path))
        except OSError:  # unreadable: no runs of ours there
            continue
    return sorted(found)


# The record schema, checked on every read (resume, bench.report, bench.show, the leaderboard) and
# on every write. field -> (what it must be, its check). EVERY: all records; OK: records of status
# "ok" (a generation); OPTIONAL: fields older records or some decoders lack, checked when not null.
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


_TEXT = ("a string", lambda v: isinstance(v, str))
_COUNT = ("an integer >= 0", lambda v: _is_int(v) and v >= 0)
_AMOUNT = ("a finite number >= 0", lambda v: _is_number(v) and v >= 0)
_SECONDS = ("a finite number > 0", lambda v: _is_number(v) and v > 0)
_FLAG = ("true or false", lambda v: isinstance(v, bool))
_OBJECT = ("an object", lambda v: isinstance(v, dict))
EVERY = {"key": _TEXT, "prompt_id": _TEXT, "turn": _COUNT, "decoder": _TEXT, "model": _TEXT, "dataset": _TEXT,
         "status": ('"ok" or "skipped"', lambda v: v in ("ok", "skipped"))}
OK = {"new_tokens": _COUNT, "steps": ("an integer >= 1", lambda v: _is_int(v) and v >= 1),
      "tokens": ("a list of token ids (integers >= 0)", lambda v: isinstance(v, list) and all(map(_COUNT[1], v))),
      "text": _TEXT, "trace": _OBJECT, "tokens_per_step": _AMOUNT, "latency_s": _SECONDS, "ttft_s": _AMOUNT,
      "tokens_per_s": _AMOUNT, "target_time_s": _AMOUNT, "draft_time_s": _AMOUNT, "overhead_time_s": _AMOUNT,
      "forward_tokens": _COUNT, "draft_tokens": _COUNT, "accepted_draft_tokens": _COUNT,
      "draft_forward_tokens": _COUNT, "target_flops": _AMOUNT, "draft_flops": _AMOUNT}
OPTIONAL = {"category": _TEXT, "reason": _TEXT, "prompt_tokens": _COUNT, "prompt_text": _TEXT,
            "decoder_lossless": _FLAG,
            "lossless": _FLAG, "quality_score": ("a finite number", _is_number), "quality": _OBJECT,
            "reference": _OBJECT, "decode_steps": _COUNT, "decode_tokens": _COUNT, "decode_flops": _AMOUNT,
            "decode_draft_flops": _AMOUNT, "hit_steps": _COUNT, "paths": _COUNT, "head_flops": _AMOUNT,
            "rescore_flops": _AMOUNT, "batch": _OBJECT, "tuned": _OBJECT, "calibration": _OBJECT,
            "first_divergence": _COUNT, "first_real_divergence": _COUNT, "divergence_tie": _FLAG,
            "divergence_ulps": _AMOUNT, "divergence_logit_gap": _AMOUNT, "ties_in_wider_dtype": _COUNT,
            "ties_by_second_computation": _COUNT,
            "speed_py_tokens": ("an integer", _is_int),  # bench/spec_bench_table.py: from 2026-12-02
            # bench/metrics.py, step_acceptance: what the engines' acceptance figures count
            "draft_steps": _COUNT, "verified_tokens": _COUNT,
            "accepted_at_least": ("a list of integers >= 0", lambda v: isinstance(v, list) and all(map(_COUNT[1], v))),
            "prompt_sha256": _TEXT,  # the prompt's content hash (bench.datasets.prompt_sha256): runs since 2026-12-07
            "ties_by_forward": _COUNT,  # runs before 2026-11-27: ties a prefix forward in the run's dtype proved
            "repeat_latency_s": ("a non-empty list of finite numbers > 0",
                                 lambda v: isinstance(v, list) and v and all(map(_SECONDS[1], v)))}


def invalid(record) -> str | None:
    """Why `record` does not meet the schema (the first problem, naming the field), or None."""
    if not isinstance(record, dict):
        return "not a record (a JSON object)"
    fields = {**EVERY, **OK} if record.get("status") == "ok" else EVERY
    for name, (what, ok) in fields.items():
        if name not in record:
            return f"no {name}"
        if not ok(record[name]):
            return f"{name} is {json.dumps(record[name])[:40]}, not {what}"
    for name, (what, ok) in OPTIONAL.items():
        if record.get(name) is not None and not ok(record[name]):
            return f"{name} is {json.dumps(record[name])[:40]}, not {what}"
    if record["key"] != f"{record['prompt_id']}#{record['turn']}":
        return f"key {record['key']!r} is not prompt_id#turn"
    if record["status"] != "ok":
        return None
    if len(record["tokens"]) != record["new_tokens"]:
        return f"{len(record['tokens'])} tokens but new_tokens {record['new_tokens']}"
    trace = record["trace"]
    if any(not isinstance(column, list) or len(column) != record["steps"] for column in trace.values()):
        return f"a trace column's length is not steps ({record['steps']})"
    for name in ("committed", "forward_tokens"):  # what bench.show draws
        if not all(map(_COUNT[1], trace.get(name) or [None])):
            return f"trace.{name} is not a list of integers >= 0"
    if sum(trace["committed"]) != record["new_tokens"]:
        return f"the trace commits {sum(trace['committed'])} tokens, not new_tokens {record['new_tokens']}"
    if trace.get("position", []) != _positions(trace["committed"]):
        return "trace.position is not the tokens committed before each step"
    return None


def _positions(committed: list[int]) -> list[int]:
    """decoders.core.trace.output_positions, imported on first use: the decoders package imports
    torch, which the command lines' checks of their settings (bench/settings.py) run without."""
    from decoders.core.trace import output_positions

    return output_positions(committed)


def upgrade(record):
    """A record as this version writes it: older runs named the trace's tokens committed per step
    "accepted" (Step.accepted); every reader gets "committed". Runs before the trace kept each
    step's output position get it, derived from "committed" as trace_columns does."""
    trace = record.get("trace") if isinstance(record, dict) else None
    if isinstance(trace, dict) and "accepted" in trace and "committed" not in trace:
        record["trace"] = trace = {("committed" if k == "accepted" else k): v for k, v in trace.items()}
    if isinstance(trace, dict) and "position" not in trace and isinstance(trace.get("committed"), list) \
            and all(map(_COUNT[1], trace["committed"])):
        trace["position"] = _positions(trace["committed"])
    return record


def holds_lone_surrogate(line: bytes, value) -> bool:
    """Whether JSON `line`, read as `value`, holds a lone surrogate: a \\ud800-\\udfff escape
    alone decodes, but is not text (no file, terminal, table or tokenizer can encode it)."""
    if b"\\ud" not in line and b"\\uD" not in line:  # every lone surrogate is written escaped
        return False
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _check(n: int, line: bytes, seen: set[str]) -> tuple[dict | None, str | None]:
    """(record, None) for a valid line whose key is not in `seen` (then added), else (None, why)."""
    if not line.endswith(b"\n"):  # a line is complete only with its newline (one write puts both)
        return None, "torn by a kill mid-write"
    try:
        record = upgrade(json.loads(line.decode("utf-8")))
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        return None, f"not JSON ({str(e).split(':')[0]})"
    except RecursionError:  # JSON nested deeper than the parser goes (1000 '[' crashed every reader)
        return None, "not a record (JSON nested too deeply)"
    if holds_lone_surrogate(line, record):  # bench.report's tables failed on one
        return None, "not text (a lone surrogate escape)"
    if not (isinstance(record, dict) and isinstance(record.get("key"), str)):
        return None, "not a record (a JSON object with a key)"
    if why := invalid(record):
        return None, f"invalid record ({why})"
    if record["key"] in seen:
        return None, f"a second record of {record['key']}"
    seen.add(record["key"])
    return record, None


def foreign(record: dict, keys: set[str] | None = None, settings: dict | None = None,
            prompts: dict[str, str] | None = None, listed: bool = False) -> str | None:
    """Why a valid record is not one of this run's, or None: a key not in `keys`, a field that differs
    from `settings` ({"decoder": name, ...}), or a prompt whose content hash is not the one in `prompts`
    (prompt id -> bench.datasets.prompt_sha256; `listed`: a prompt it lacks is foreign too). Resume
    sets such a record aside; bench.report leaves it out."""
    if keys is not None and record["key"] not in keys:
        return f"a record of {record['key']}, which this run does not have"
    for field, value in (settings or {}).items():
        if record.get(field) != value:
            return f"a record of {field} {record.get(field)!r}, where this run's is {value!r}"
    if prompts is None:
        return None
    expected = prompts.get(record["prompt_id"])
    if expected is None:
        return f"a record of prompt {record['prompt_id']!r}, which this run does not list" if listed else None
    if record.get("prompt_sha256") != expected:
        return (f"a record of prompt {record['prompt_id']!r} made from other text than this run's "
                f"({str(record.get('prompt_sha256'))[:12]}, not {expected[:12]})")
    return None


def parse_lines(data: bytes, keys: set[str] | None = None, settings: dict | None = None,
                prompts: dict[str, str] | None = None) -> tuple[list[tuple[dict, bytes]], list[tuple[int, bytes, str]]]:
    """(record, its line) for each valid record, the first of each key, in file order; and
    (line number, line, why) for every other non-blank line, a record that is not this run's
    (foreign: its key, settings or prompt) among them."""
    good: list[tuple[dict, bytes]] = []
    bad: list[tuple[int, bytes, str]] = []
    seen: set[str] = set()
    for n, line in enumerate(data.splitlines(keepends=True), 1):
        if line.strip():
            record, why = _check(n, line, seen)
            why = why or foreign(record, keys, settings, prompts)
            if why:
                bad.append((n, line, why))
            else:
                good.append((record, line))
    return good, bad


def _describe(path: Path, bad: list[tuple[int, bytes, str]], count: int | None = None) -> str:
    shown = "; ".join(f"line {n}: {why}" for n, _, why in bad[:3])
    count = len(bad) if count is None else count
    return f"{path}: {count} damaged line(s) ({shown}{'; ...' if count > 3 else ''})"


def iter_records(path: Path, **rule):
    """The valid records of a records.jsonl (or .jsonl.gz), one at a time (a reader's memory does
    not grow with the file); damaged lines, and records that are not the run's by `rule` (foreign's
    keys, settings, prompts, listed), are skipped with one warning on stderr at the end, never an
    error. A path that is not a readable file (or not complete gzip) is a BenchError."""
    path = Path(path)
    bad: list[tuple[int, bytes, str]] = []
    count = 0
    seen: set[str] = set()
    try:
        with open_jsonl(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                record, why = _check(n, line, seen)
                why = why or (foreign(record, **rule) if rule else None)
                if why:
                    count += 1
                    if len(bad) < 3:
                        bad.append((n, b"", why))
                else:
                    yield record
    except (OSError, EOFError, zlib.error) as e:  # also gzip.BadGzipFile, a truncated or corrupt stream
        raise BenchError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}; give a run directory whose "
                         "records.jsonl is a readable file") from None
    if count:
        print(f"warning: {_describe(path, bad, count)} skipped", file=sys.stderr)


def read_records(path: Path) -> list[dict]:
    """The valid records of a records.jsonl (or .jsonl.gz), for readers; damaged lines are skipped
    with a warning on stderr, never an error."""
    return list(iter_records(path))


def _lock(path: Path) -> int:
    fd = open_own(path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 4096).decode("utf-8", "replace").strip() or "another process"
        os.close(fd)
        raise BenchError(f"{path.parent} is being written by {holder}; one writer per run directory: wait for it "
                         "to end (then resume=true), or write to another directory") from None
    os.ftruncate(fd, 0)
    os.write(fd, (f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')} "
                  f"({' '.join([Path(sys.argv[0]).name, *sys.argv[1:]])[:300]})").encode())
    return fd


class RecordLog:
    def __init__(self, path: Path, resume: bool, keys: set[str] | None = None, settings: dict | None = None,
                 prompts: dict[str, str] | None = None):
        """`keys`: the only keys this run's records may have (a record of another prompt is set aside
        on resume, as a damaged line is); None: any (a leaderboard's directory may hold more).
        `settings`: fields every record must have as given ({"decoder": name, ...}): a record of
        other settings is set aside too; `prompts`: prompt id -> content hash, a record made from
        other text is set aside too."""
        self.path = Path(path)
        self.keys, self.settings, self.prompts = keys, settings, prompts
        self.records: dict[str, dict] = {}
        self._fd = self._lock_fd = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._lock_fd = _lock(self.path.with_name(self.path.name + ".lock"))
            data = _read_own(self.path)
            if data:
                if not resume:
                    raise BenchError(f"{self.path} already holds records; pass resume=true to continue that run, "
                                     "or choose a new hydra.run.dir")
                self._load(data)
            self._fd = open_own(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        except OSError as e:  # a read-only or missing directory, a full disk
            self.close()
            if e.errno in (errno.ENOSPC, errno.EDQUOT):  # the directory is right; the disk is not
                raise BenchError(f"cannot write records to {self.path}: {e.strerror}; nothing recorded is lost: "
                                 "make room, then run the same command with resume=true") from None
            raise BenchError(f"cannot write records to {self.path}: {e.strerror or e}; give a writable directory "
                             "(hydra.run.dir=..., or leaderboard.out_dir=...)") from None
        except BaseException:
            self.close()
            raise

    def _load(self, data: bytes) -> None:
        good, bad = parse_lines(data, self.keys, self.settings, self.prompts)
        self.records = {record["key"]: record for record, _ in good}
        if not bad:
            return
        # Set the damaged lines aside first, then replace the file: at no moment is a line lost.
        rejected = self.path.with_name(self.path.stem + ".rejected.jsonl")
        with os.fdopen(open_own(rejected, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab") as f:
            f.writelines(line if line.endswith(b"\n") else line + b"\n" for _, line, _ in bad)
            f.flush()
            os.fsync(f.fileno())
        tmp = self.path.with_name(self.path.name + ".tmp")
        with os.fdopen(open_own(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as f:
            f.writelines(line for _, line in good)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        print(f"warning: {_describe(self.path, bad)}: kept its {len(good)} valid records, moved the damaged lines "
              f"to {rejected}", file=sys.stderr)

    def __contains__(self, key: str) -> bool:
        return key in self.records

    def get(self, key: str) -> dict | None:
        return self.records.get(key)

    def append(self, record: dict) -> None:
        if record["key"] in self.records:
            raise RuntimeError(f"record {record['key']} written twice")
        if why := invalid(record):  # a harness bug: resume would reject it and generate the prompt again
            raise RuntimeError(f"record {record['key']} does not meet the schema: {why}")
        record = to_microseconds(record)
        line = (json.dumps(record) + "\n").encode()
        size = os.fstat(self._fd).st_size
        try:
            done = 0
            while done < len(line):
                done += os.write(self._fd, line[done:])
            os.fsync(self._fd)
        except OSError as e:
            try:  # no torn line: cut back to the last complete record
                os.ftruncate(self._fd, size)
            except OSError:
                pass  # then resume sets the torn line aside
            raise BenchError(f"cannot write {self.path} ({e.strerror or e}); its {len(self.records)} finished "
                             "records are intact: make room and rerun with resume=true") from None
        self.records[record["key"]] = record

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._lock_fd is not None:
            os.ftruncate(self._lock_fd, 0)
            os.close(self._lock_fd)  # closing drops the flock
            self._lock_fd = None
