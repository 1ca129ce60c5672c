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
- A write that fails (a full disk) is cut back to the last complete record; the run stops in
  one line saying how to resume.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from .errors import BenchError


def parse_lines(data: bytes) -> tuple[list[tuple[dict, bytes]], list[tuple[int, bytes, str]]]:
    """(record, its line) for each valid record, the first of each key, in file order; and
    (line number, line, why) for every other non-blank line."""
    good: list[tuple[dict, bytes]] = []
    bad: list[tuple[int, bytes, str]] = []
    seen: set[str] = set()
    for n, line in enumerate(data.splitlines(keepends=True), 1):
        if not line.strip():
            continue
        if not line.endswith(b"\n"):  # a line is complete only with its newline (one write puts both)
            bad.append((n, line, "torn by a kill mid-write"))
            continue
        try:
            record = json.loads(line.decode("utf-8"))
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            bad.append((n, line, f"not JSON ({str(e).split(':')[0]})"))
            continue
        if not (isinstance(record, dict) and isinstance(record.get("key"), str)):
            bad.append((n, line, "not a record (a JSON object with a key)"))
        elif record["key"] in seen:
            bad.append((n, line, f"a second record of {record['key']}"))
        else:
            seen.add(record["key"])
            good.append((record, line))
    return good, bad


def _describe(path: Path, bad: list[tuple[int, bytes, str]]) -> str:
    shown = "; ".join(f"line {n}: {why}" for n, _, why in bad[:3])
    return f"{path}: {len(bad)} damaged line(s) ({shown}{'; ...' if len(bad) > 3 else ''})"


def read_records(path: Path) -> list[dict]:
    """The valid records of a records.jsonl, for readers; damaged lines are skipped with a
    warning on stderr, never an error."""
    good, bad = parse_lines(Path(path).read_bytes())
    if bad:
        print(f"warning: {_describe(Path(path), bad)} skipped", file=sys.stderr)
    return [record for record, _ in good]


def _lock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
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
    def __init__(self, path: Path, resume: bool):
        self.path = Path(path)
        self.records: dict[str, dict] = {}
        self._fd = self._lock_fd = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._lock_fd = _lock(self.path.with_name(self.path.name + ".lock"))
            if self.path.exists() and self.path.stat().st_size > 0:
                if not resume:
                    raise BenchError(f"{self.path} already holds records; pass resume=true to continue that run, "
                                     "or choose a new hydra.run.dir")
                self._load()
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:  # a read-only or missing directory, a full disk
            self.close()
            raise BenchError(f"cannot write records to {self.path}: {e.strerror or e}; give a writable directory "
                             "(hydra.run.dir=..., or leaderboard.out_dir=...)") from None
        except BaseException:
            self.close()
            raise

    def _load(self) -> None:
        good, bad = parse_lines(self.path.read_bytes())
        self.records = {record["key"]: record for record, _ in good}
        if not bad:
            return
        # Set the damaged lines aside first, then replace the file: at no moment is a line lost.
        rejected = self.path.with_name(self.path.stem + ".rejected.jsonl")
        with open(rejected, "ab") as f:
            f.writelines(line if line.endswith(b"\n") else line + b"\n" for _, line, _ in bad)
            f.flush()
            os.fsync(f.fileno())
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
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
