"""Content hashes of model files, each file's kept under cache_dir by its path, size, inode and
modification time, so that a checkpoint is read through once, not at every run."""
from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

from .errors import BenchError
from .rundir import write_atomic


def directory_sha256(directory: Path, cache_dir: str | None) -> str:
    """The content hash of a model directory's files (weights, config, tokenizer), each file's hash
    kept under cache_dir by its path, size, inode and modification time, so that a checkpoint is read
    through once, not at every run. What a run directory records as its model's weights."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(directory).iterdir() if p.is_file()):
        digest.update(f"{path.name}\0{file_sha256(path, cache_dir)}\0".encode())
    return digest.hexdigest()


def file_sha256(path: Path, cache_dir: str | None) -> str:
    stat = path.stat()
    key = {"path": str(path.resolve()), "size": stat.st_size, "inode": stat.st_ino, "mtime_ns": stat.st_mtime_ns}
    kept = None
    if cache_dir:
        kept = Path(cache_dir).expanduser() / "hashes" / f"{hashlib.sha1(key['path'].encode()).hexdigest()}.json"
        with contextlib.suppress(OSError, ValueError):
            known = json.loads(kept.read_text())
            if {k: known.get(k) for k in key} == key:
                return known["sha256"]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    if kept is not None:
        with contextlib.suppress(OSError, BenchError):  # a cache that cannot be written costs a read next time
            write_atomic(kept, json.dumps({**key, "sha256": digest.hexdigest()}))
    return digest.hexdigest()
