"""A run directory is the run's own (tests/test_rundir.py injects each fault):
- A directory that exists and is not a run of this harness (nor empty) is refused, in one line,
  before anything is written: `hydra.run.dir=conf` must not replace conf/config.yaml.
- Before anything is written into an existing run, its records are checked against the settings
  the run recorded (config.yaml, else Hydra's .hydra/config.yaml); a run whose config is missing
  or damaged is refused with a hint, never resumed on trust.
- Every file a run writes besides records.jsonl (which records.py guards) is written whole or not
  at all: a temporary file in the same directory, fsynced, then renamed over the old one.
- A run never writes through a symbolic link it did not make: a directory holding one (at its
  top or in .hydra/, .hydra itself included) is refused in one line before anything is written,
  and every file is created with O_NOFOLLOW (records.open_own) besides.
A run is recognised by MARKER (written by every run once it holds the directory's lock), or, for
runs made before the marker existed, by a records.jsonl beside a recorded config. A run whose
records are gzipped (records.jsonl.gz: a checked-in reference run) is read-only: refused.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from .errors import BenchError
from .records import GZIPPED, link_refusal, open_own, records_path
from .registry import CONF_DIR

MARKER = ".bench-run"
HYDRA_LOG = "__main__.log"  # Hydra's job log for python -m bench, created before the run starts
CONFIG_FILES = ("config.yaml", ".hydra/config.yaml")


def write_atomic(path: Path, data: str | bytes, hint: str = "make room and rerun with resume=true") -> None:
    """`path` holds `data` whole, or is left as it was (a full disk, a kill mid-write)."""
    path = Path(path)
    data = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = open_own(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:  # the rename itself survives a crash
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise BenchError(f"cannot write {path} ({e.strerror or e}); it is left as it was: {hint}") from None


def _write_all(fd: int, data: bytes) -> None:
    done = 0
    while done < len(data):
        done += os.write(fd, data[done:])


def is_run(run_dir: Path) -> bool:
    run_dir = Path(run_dir)
    return (run_dir / MARKER).is_file() or (
        records_path(run_dir).is_file() and any((run_dir / name).is_file() for name in CONFIG_FILES))


def _entries(path: Path, key: str) -> list[str] | None:
    """The names in directory `path` (None: it does not exist); a dangling link, a file or an
    unreadable directory is refused in one line naming `key`."""
    try:
        if os.path.lexists(path) and not path.exists():
            raise BenchError(f"{key}={path}: a symbolic link that leads nowhere (dangling, or a loop); "
                             "give a directory")
        if not path.exists():
            return None
        if not path.is_dir():
            raise BenchError(f"{key}={path}: a file, not a directory; choose a new or empty directory")
        return sorted(p.name for p in path.iterdir())
    except OSError as e:  # e.g. ELOOP from a link inside the path, or no permission to list it
        raise BenchError(f"{key}={path}: cannot read it ({e.strerror or e}); choose a readable directory") from None


def _shown(entries: list[str]) -> str:
    return ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")


def _mark(directory: Path, marker: str, harness: str) -> None:
    if not (directory / marker).is_file():
        write_atomic(directory / marker, json.dumps({"harness": harness,
                                                     "since": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")


def _refuse_links(path: Path, entries: list[str], key: str) -> None:
    """A planted link (records.jsonl.lock -> a file of the user's) would be written through: refused."""
    names = list(entries)
    hydra = path / ".hydra"
    if ".hydra" in entries and hydra.is_dir() and not hydra.is_symlink():
        names += [f".hydra/{name}" for name in _entries(hydra, key) or []]
    for name in names:
        if (path / name).is_symlink():
            raise BenchError(link_refusal(path / name, key))


def check_owned(run_dir: Path, key: str) -> bool:
    """Whether `run_dir` holds a run of this harness (False: it does not exist or is empty). Anything
    else that exists there (a file, a broken link, someone's directory) is refused in one line."""
    path = Path(run_dir)
    entries = _entries(path, key)
    if entries is None:
        return False
    _refuse_links(path, entries, key)
    if GZIPPED in entries:
        raise BenchError(f"{path / GZIPPED}: a reference run's records, compressed and read-only; nothing is "
                         f"resumed or written there: choose a new {key}")
    records = path / "records.jsonl"
    if os.path.lexists(records) and not records.is_file():
        raise BenchError(f"{records} is not a file, so {run_dir} is not a run directory of python -m bench; "
                         f"remove it or choose a new {key}")
    if entries in ([], [HYDRA_LOG]):  # empty, or left by a run refused before it started
        return False
    if is_run(path):
        return True
    raise BenchError(f"{key}={run_dir} exists and is not a run directory of python -m bench "
                     f"(it holds {_shown(entries)}); "
                     "a run writes only into a new or empty directory, or its own to resume: choose another")


def has_records(run_dir: Path) -> bool:
    records = Path(run_dir) / "records.jsonl"
    return records.is_file() and records.stat().st_size > 0


def recorded_config(run_dir: Path, key: str):
    """(file, config) of the settings the run recorded, or None if it recorded none. A damaged file
    (unparsable, empty, not a mapping) is refused: the records cannot be checked against it."""
    for name in CONFIG_FILES:
        path = Path(run_dir) / name
        if not os.path.lexists(path):
            continue
        try:
            cfg = OmegaConf.load(path)
            if not isinstance(cfg, DictConfig) or not cfg:
                raise ValueError("empty, or not a mapping of settings")
            OmegaConf.to_container(cfg, resolve=True)  # its interpolations must resolve to compare
        except Exception as e:
            reason = " ".join(str(e).split()[:30]) or type(e).__name__
            raise BenchError(f"{path} is damaged ({reason}), so {run_dir}'s records cannot be checked against "
                             f"these settings; restore it, or choose a new {key}") from None
        return path, cfg
    return None


# Keys (at any depth) that may change between a run and its resumption without changing its records:
# those Hydra leaves out of a sweep run's directory name (conf/config.yaml's
# override_dirname.exclude_keys, the one list), less Hydra's own.
RESUME_FREE = frozenset(key for key in OmegaConf.load(CONF_DIR / "config.yaml").hydra.job.config.override_dirname
                        .exclude_keys if not key.startswith("hydra."))


def _comparable(cfg: DictConfig) -> dict:
    def strip(node):
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k not in RESUME_FREE}
        return node

    return strip(OmegaConf.to_container(cfg, resolve=True))


def config_difference(saved: Path | DictConfig, cfg: DictConfig, ignore: tuple[str, ...] = ()) -> str | None:
    """The first setting in which `cfg` differs from the run's saved config (a file or its
    contents), or None. RESUME_FREE keys (at any depth) and the dotted paths in `ignore` may differ."""
    if not isinstance(saved, DictConfig):
        saved = OmegaConf.load(saved)
    saved, now = _comparable(saved), _comparable(cfg)
    for path in ignore:
        *parents, leaf = path.split(".")
        for tree in (saved, now):
            for key in parents:
                tree = tree.get(key, {}) if isinstance(tree, dict) else {}
            if isinstance(tree, dict):
                tree.pop(leaf, None)
    return _first_difference(saved, now)


def _first_difference(a, b, prefix="") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            diff = _first_difference(a.get(k), b.get(k), f"{prefix}{k}.")
            if diff:
                return diff
        return None
    return None if a == b else f"{prefix[:-1]}: {a!r} then, {b!r} now"


def check_resume(run_dir: Path, cfg, resume: bool, key: str, ignore: tuple[str, ...] = ()) -> None:
    """May this run (or leaderboard entry) write into `run_dir`? Its records (if any) must be
    resumed, with the settings they were made with (RESUME_FREE keys and `ignore` may differ).
    Writes nothing."""
    if not check_owned(run_dir, key) or not has_records(run_dir):
        return
    if not resume:
        raise BenchError(f"{Path(run_dir) / 'records.jsonl'} already holds records; pass resume=true to continue "
                         f"that run, or choose a new {key}")
    found = recorded_config(run_dir, key)
    if found is None:
        raise BenchError(f"{run_dir} holds records but no config.yaml (nor .hydra/config.yaml) saying how they were "
                         f"made, so resuming could mix settings; restore it, or choose a new {key}")
    diff = config_difference(found[1], cfg, ignore=ignore)
    if diff:
        raise BenchError(f"{run_dir} holds records made with other settings ({diff}); resume with the same settings, "
                         f"or choose a new {key}")


IDENTITY = "identity.json"


def record_settings(cfg) -> dict:
    """The settings every record of a run names: a record naming others is not the run's."""
    return {"decoder": cfg.decoder.name, "model": cfg.model.name, "dataset": cfg.dataset.name}


def dataset_identity(prompts: dict[str, str]) -> dict:
    """A run's dataset as the content hashes of the prompts it used (id -> bench.datasets.prompt_sha256),
    and one hash of them all."""
    whole = hashlib.sha256(json.dumps(prompts, sort_keys=True).encode()).hexdigest()
    return {"sha256": whole, "prompts": dict(prompts)}


def recorded_identity(run_dir: Path, key: str) -> dict | None:
    """What the run recorded as defining its results (IDENTITY), or None where it recorded nothing; a
    damaged file is refused: the records could not be checked against it."""
    path = Path(run_dir) / IDENTITY
    if not os.path.lexists(path):
        return None
    try:
        data = json.loads(path.read_bytes())
        if not (isinstance(data, dict) and all(isinstance(data.get(k), dict) for k in ("dataset", "model", "code"))
                and isinstance(data["dataset"].get("prompts"), dict)):
            raise ValueError("not the identity a run writes")
    except (OSError, ValueError) as e:
        raise BenchError(f"{path} is damaged ({' '.join(str(e).split()[:20])}), so {run_dir}'s records cannot be "
                         f"checked against this run; restore it, or choose a new {key}") from None
    return data


def check_identity(run_dir: Path, identity: dict, key: str) -> None:
    """May this run add records to `run_dir`? Only where the records there were made from what makes
    this run's (the parts `identity` gives: "code", "dataset" prompts, "model" weights): else one line
    naming the first difference. A run with records and no IDENTITY (made before runs recorded one) is
    refused: it cannot be checked. Writes nothing."""
    if not has_records(run_dir):
        return
    then = recorded_identity(run_dir, key)
    where = f"{run_dir} holds records"
    if then is None:
        raise BenchError(f"{where} but no {IDENTITY} saying what made them (dataset, model weights, code): they "
                         f"cannot be checked, so resuming could mix results; choose a new {key}")
    if "code" in identity and then["code"] != identity["code"]:
        raise BenchError(f"{where} made by code {_code(then['code'])}; this is {_code(identity['code'])}: resume "
                         f"with the code that made them, or choose a new {key}")
    if "model" in identity and then["model"] != identity["model"]:
        old, new = then["model"], identity["model"]
        raise BenchError(f"{where} of model {old.get('name')} with weights {old.get('weights')}; these are "
                         f"{new.get('name')} with {new.get('weights')}: resume with the same weights, or choose a "
                         f"new {key}")
    old, new = then["dataset"]["prompts"], identity.get("dataset", {}).get("prompts", {})
    changed = next((pid for pid in new if pid in old and old[pid] != new[pid]), None)
    if changed is not None:
        raise BenchError(f"{where} of prompt {changed!r} made from other text than the dataset's now (sha256 "
                         f"{old[changed][:12]} then, {new[changed][:12]} now): resume with the same prompts, or "
                         f"choose a new {key}")


def _code(code: dict) -> str:
    commit = (code.get("commit") or "outside git")[:12]
    return f"{commit} with uncommitted changes {str(code.get('changes_sha256'))[:12]}" if code.get("dirty") else commit


def write_identity(run_dir: Path, identity: dict) -> None:
    """IDENTITY, once the run holds the directory and check_identity passed: a run that adds prompts (a
    leaderboard's raised limit) adds their hashes to the ones recorded."""
    then = recorded_identity(run_dir, "hydra.run.dir") if has_records(run_dir) else None
    prompts = {**(then["dataset"]["prompts"] if then else {}), **identity["dataset"]["prompts"]}
    write_atomic(Path(run_dir) / IDENTITY, json.dumps({**identity, "dataset": dataset_identity(prompts)}, indent=1)
                 + "\n")


def record_rule(run_dir: Path) -> dict:
    """What makes a record one of the run's, for readers (bench.report), as resume has it: the settings
    its config names and, where it recorded IDENTITY, the prompts it lists by content. A config or
    identity that cannot be read leaves that part of the rule out."""
    rule: dict = {}
    found = None
    with contextlib.suppress(BenchError):
        found = recorded_config(run_dir, "run directory")
    if found is not None:
        with contextlib.suppress(Exception):  # not the settings a run writes: no settings to hold records to
            rule["settings"] = record_settings(found[1])
    with contextlib.suppress(BenchError):
        identity = recorded_identity(run_dir, "run directory")
        if identity is not None:
            rule.update(prompts=identity["dataset"]["prompts"], listed=True)
    return rule


def claim(run_dir: Path) -> None:
    """Marks a directory that check_resume let this run have as a run's, before anything else is
    written there: whatever happens next (a full disk, a kill), it is recognised as a run."""
    _mark(Path(run_dir), MARKER, "decoding-bench")


def write_run_files(run_dir: Path, cfg, hydra=None) -> None:
    """Once the run holds the directory's lock: config.yaml (resolved, as run) and, for python -m
    bench, what Hydra would have written into .hydra/ (conf/config.yaml turns Hydra's own writing
    off, so that a refused run cannot overwrite an existing run's)."""
    run_dir = Path(run_dir)
    write_atomic(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    if hydra is not None:
        hydra_dir = run_dir / ".hydra"
        if hydra_dir.is_symlink():  # write_atomic's O_NOFOLLOW guards the file, not the directory above it
            raise BenchError(link_refusal(hydra_dir))
        write_atomic(hydra_dir / "config.yaml", OmegaConf.to_yaml(cfg))
        write_atomic(hydra_dir / "hydra.yaml", OmegaConf.to_yaml(OmegaConf.create({"hydra": hydra})))
        write_atomic(hydra_dir / "overrides.yaml", OmegaConf.to_yaml(OmegaConf.create(list(hydra.overrides.task))))


BOARD_MARKER = ".bench-leaderboard"
BOARD_FILES = ("leaderboard.md", "leaderboard.csv")  # a leaderboard's made before BOARD_MARKER existed


def check_board_dir(out_dir: Path, key: str = "leaderboard.out_dir") -> None:
    """A leaderboard writes its tables (leaderboard.yaml, provenance.json, ...) only into a new or
    empty directory, or a leaderboard's own: leaderboard.out_dir=conf must not replace
    conf/leaderboard.yaml. Its per-entry run directories are then checked as runs'."""
    entries = _entries(Path(out_dir), key)
    if not entries or BOARD_MARKER in entries or any(name in entries for name in BOARD_FILES):
        return
    raise BenchError(f"{key}={out_dir} exists and is not a leaderboard's directory (it holds {_shown(entries)}); a "
                     "leaderboard writes only into a new or empty directory, or its own to resume: choose another")


def claim_board(out_dir: Path) -> None:
    """Marks a directory check_board_dir let this leaderboard have, before anything else is written."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    _mark(Path(out_dir), BOARD_MARKER, "decoding-bench leaderboard")


def check_report_dir(out_dir: Path, name: str = "report", key: str = "--out") -> None:
    """A report (bench.report's report.csv/.md, bench.forecast's forecast.csv/.md: NAME.csv and NAME.md)
    is written only into a new or empty directory, or a report's own of that name (nothing else in it):
    --out must not replace a run's, a leaderboard's or the user's files, nor write through a link
    planted in their place."""
    path = Path(out_dir)
    entries = _entries(path, key)
    if not entries:
        return
    _refuse_links(path, entries, key)
    if not set(entries) <= {f"{name}.csv", f"{name}.md"}:
        what = f"a {name}"
        raise BenchError(f"{key} {out_dir} exists and holds more than {what} ({_shown(entries)}); {what} is "
                         f"written only into a new or empty directory, or {what}'s own: choose another")


def write_report(out_dir: Path, name: str, table, md: str) -> list[Path]:
    """NAME.csv (the table) and NAME.md into out_dir, once check_report_dir allows it; the paths written."""
    check_report_dir(out_dir, name)
    hint = "give a writable directory with room"
    csv, text = Path(out_dir) / f"{name}.csv", Path(out_dir) / f"{name}.md"
    write_atomic(csv, table.to_csv(index=False), hint)
    write_atomic(text, md + "\n", hint)
    return [csv, text]


def print_report(md: str, written: list[Path]) -> None:
    """A report's table on stdout, then where write_report put it (stderr), as every report command ends."""
    print(md)
    if written:
        print(f"\nwrote {' and '.join(map(str, written))}", file=sys.stderr)


def job_dir(sweep_dir, subdir) -> Path:
    """A sweep job's directory, hydra.sweep.subdir under hydra.sweep.dir, where it lies inside it: a
    subdir that climbs out (../x, or an override's own path such as dataset.path=../../x in the
    default subdir) or is absolute would put a job where the sweep's resume and bench.report never
    look. Refused in one line."""
    inside = os.path.normpath(str(subdir))
    if os.path.isabs(inside) or inside == "." or inside.split(os.sep)[0] == "..":
        raise BenchError(f"hydra.sweep.subdir={subdir}: a job's directory must lie inside hydra.sweep.dir "
                         f"({sweep_dir}); give a relative path that stays there (no leading / and no .. above it)")
    return Path(sweep_dir) / inside


def check_sweep_dir(sweep_dir: Path, key: str = "hydra.sweep.dir") -> None:
    """A sweep writes into a new or empty directory, or into a sweep's (Hydra's multirun.yaml is
    there); each of its run directories is then checked as a run's."""
    path = Path(sweep_dir)
    if os.path.lexists(path) and not path.exists():
        raise BenchError(f"{key}={sweep_dir}: a symbolic link that leads nowhere (dangling, or a loop); "
                         "give a directory")
    if not path.exists():
        return
    if not path.is_dir():
        raise BenchError(f"{key}={sweep_dir}: a file, not a directory; choose a new or empty directory")
    try:
        entries = sorted(p.name for p in path.iterdir())
    except OSError as e:
        raise BenchError(f"{key}={sweep_dir}: cannot read it ({e.strerror or e}); "
                         "choose a readable directory") from None
    if entries and "multirun.yaml" not in entries:
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise BenchError(f"{key}={sweep_dir} exists and is not a sweep directory of python -m bench "
                         f"(it holds {shown}); choose a new or empty directory")
