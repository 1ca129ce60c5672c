"""records.jsonl: one line per prompt and turn, appended and flushed as each finishes.

A run killed at any moment restarts with resume=true and ends with every record exactly
once: finished lines are kept and skipped, a half-written last line is cut off.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import BenchError


class RecordLog:
    def __init__(self, path: Path, resume: bool):
        self.path = Path(path)
        self.records: dict[str, dict] = {}
        if self.path.exists() and self.path.stat().st_size > 0:
            if not resume:
                raise BenchError(f"{self.path} already holds records; pass resume=true to continue that run, "
                                 "or choose a new hydra.run.dir")
            self._load()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")

    def _load(self) -> None:
        data = self.path.read_bytes()
        good = 0  # byte length of the complete, parseable prefix
        for line in data.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break  # killed mid-write
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                break
            self.records[record["key"]] = record
            good += len(line)
        if good < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(good)

    def __contains__(self, key: str) -> bool:
        return key in self.records

    def get(self, key: str) -> dict | None:
        return self.records.get(key)

    def append(self, record: dict) -> None:
        if record["key"] in self.records:
            raise RuntimeError(f"record {record['key']} written twice")
        self._file.write((json.dumps(record) + "\n").encode())
        self._file.flush()
        os.fsync(self._file.fileno())
        self.records[record["key"]] = record

    def close(self) -> None:
        self._file.close()
