"""A run directory is the run's own: a directory that is not a run
is refused before anything is written, a refused run changes nothing (.hydra/ included), resume
checks the records against the run's recorded config wherever it is, every run file is written
whole or not at all, and a config can build only this project's classes. Each refusal is one
line and exit 2."""
import errno
import fcntl
import gzip
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from bench import rundir
from bench.errors import BenchError
from bench.records import RecordLog, read_records, records_path
from bench.targets import check_targets
from helpers import _cli_env, REPO, run_cli, run_python

TINY = ["model=tiny-random", "gen.max_new_tokens=4", "dataset.limit=2", "progress=false", "device=cpu"]
ALLOWED = "_target_ may name only a class in decoders.methods.*, bench.models.*"


def refused(out, message: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr + out.stdout


def snapshot(path: Path) -> dict:
    """Every file under `path` (hidden ones too) and its bytes."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def made_run(tmp_path_factory) -> Path:
    """One finished tiny run; tests work on copies of it."""
    run = tmp_path_factory.mktemp("made") / "run"
    out = run_cli(*TINY, f"hydra.run.dir={run}")
    assert out.returncode == 0, out.stderr[-2000:]
    return run


def copy_of(made_run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(made_run, tmp_path / "run", symlinks=True))


# --- what a run directory may be ---------------------------------------------------------------

def _conf_copy(tmp_path):  # hydra.run.dir=conf replaced conf/config.yaml
    return Path(shutil.copytree(REPO / "conf", tmp_path / "conf"))


def _leaderboard_like(tmp_path):  # hydra.run.dir=results/reference/leaderboard replaced its provenance.json
    d = tmp_path / "board"
    (d / "humaneval" / "autoregressive").mkdir(parents=True)
    (d / "provenance.json").write_text('{"git_commit": "abc"}')
    (d / "leaderboard.md").write_text("| table |")
    return d


def _records_is_a_directory(tmp_path):
    d = tmp_path / "r"
    (d / "records.jsonl").mkdir(parents=True)
    return d


def _dangling_link(tmp_path):
    (tmp_path / "link").symlink_to(tmp_path / "nowhere" / "run")
    return tmp_path / "link"


def _link_loop(tmp_path):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    return tmp_path / "loop"


def _a_file(tmp_path):
    (tmp_path / "f").write_text("mine")
    return tmp_path / "f"


@pytest.mark.parametrize("make,message", [
    (_conf_copy, "exists and is not a run directory of python -m bench (it holds config.yaml, dataset, decoder, ...)"),
    (_leaderboard_like, "exists and is not a run directory of python -m bench (it holds humaneval, leaderboard.md"),
    (_records_is_a_directory, "records.jsonl is not a file, so"),
    (_dangling_link, "a symbolic link that leads nowhere"),
    (_link_loop, "a symbolic link that leads nowhere"),
    (_a_file, "a file, not a directory"),
])
def test_a_directory_that_is_not_a_run_is_refused(tmp_path, make, message):
    place = make(tmp_path)
    with pytest.raises(BenchError) as e:
        rundir.check_owned(place, "hydra.run.dir")
    assert message in str(e.value)
    with pytest.raises(BenchError):
        rundir.check_resume(place, OmegaConf.create({}), True, "hydra.run.dir")


@pytest.mark.slow
def test_new_empty_and_own_directories_are_accepted(tmp_path, made_run):
    (tmp_path / "empty").mkdir()
    (tmp_path / "refused_early").mkdir()
    (tmp_path / "refused_early" / rundir.HYDRA_LOG).write_text("")  # Hydra's log of a run refused before it began
    legacy = copy_of(made_run, tmp_path)
    (legacy / rundir.MARKER).unlink()  # a run made before the marker: records.jsonl + config.yaml
    assert not rundir.check_owned(tmp_path / "new", "k") and not rundir.check_owned(tmp_path / "empty", "k")
    assert not rundir.check_owned(tmp_path / "refused_early", "k")
    assert rundir.check_owned(legacy, "k") and rundir.check_owned(made_run, "k")


@pytest.mark.slow
def test_cli_refuses_a_foreign_directory_and_changes_nothing(tmp_path):
    place = _conf_copy(tmp_path)
    before = snapshot(place)
    refused(run_cli(*TINY, f"hydra.run.dir={place}"), f"hydra.run.dir={place} exists and is not a run directory")
    assert snapshot(place) == before


# --- a refused run changes nothing, .hydra/ included --------------------------------------------

@pytest.mark.slow
def test_refused_runs_leave_the_existing_run_untouched(tmp_path, made_run):
    run = copy_of(made_run, tmp_path)
    assert (run / ".hydra" / "overrides.yaml").is_file() and (run / rundir.MARKER).is_file()
    before = snapshot(run)
    refused(run_cli(*TINY, f"hydra.run.dir={run}"), "already holds records; pass resume=true")
    refused(run_cli(*TINY, "gen.max_new_tokens=5", "resume=true", f"hydra.run.dir={run}"),
            "gen.max_new_tokens: 4 then, 5 now")
    # A second writer: the directory's lock is held (here by this test).
    fd = os.open(run / "records.jsonl.lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, b"pid 1 on the-first-run")
    try:
        held = snapshot(run)
        refused(run_cli(*TINY, "resume=true", f"hydra.run.dir={run}"), "is being written by pid 1 on the-first-run")
        assert snapshot(run) == held
    finally:
        os.ftruncate(fd, 0)
        os.close(fd)
    assert snapshot(run) == before


@pytest.mark.slow
def test_a_gzipped_reference_run_is_read_only(tmp_path, made_run):
    """results/reference/ keeps its records as records.jsonl.gz: readers take it, no run writes into it."""
    run = copy_of(made_run, tmp_path)
    (run / "records.jsonl.gz").write_bytes(gzip.compress((run / "records.jsonl").read_bytes()))
    (run / "records.jsonl").unlink()
    assert rundir.is_run(run) and len(read_records(records_path(run))) == 2
    before = snapshot(run)
    refused(run_cli(*TINY, "resume=true", f"hydra.run.dir={run}"),
            f"{run / 'records.jsonl.gz'}: a reference run's records, compressed and read-only")
    assert snapshot(run) == before


# --- resume against the recorded config, wherever it is -----------------------------------------

def _config(run: Path, **changes):
    cfg = OmegaConf.load(run / "config.yaml")
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value)
    return cfg


@pytest.mark.slow
@pytest.mark.parametrize("damage,message", [
    (lambda run: (run / "config.yaml").unlink() or shutil.rmtree(run / ".hydra"),
     "holds records but no config.yaml (nor .hydra/config.yaml)"),
    (lambda run: (run / "config.yaml").write_text(""), "config.yaml is damaged (empty"),
    (lambda run: (run / "config.yaml").write_text("gen: [\n"), "config.yaml is damaged ("),
    (lambda run: (run / "config.yaml").write_text("- a list\n"), "config.yaml is damaged (empty, or not a mapping"),
    (lambda run: (run / "config.yaml").write_text("gen: ${nowhere}\n"), "config.yaml is damaged ("),
])
def test_resume_refuses_a_missing_or_damaged_config(tmp_path, made_run, damage, message):
    run = copy_of(made_run, tmp_path)
    cfg = _config(made_run, resume=True)
    damage(run)
    with pytest.raises(BenchError) as e:
        rundir.check_resume(run, cfg, True, "hydra.run.dir")
    assert message in str(e.value) and "choose a new hydra.run.dir" in str(e.value)


@pytest.mark.slow
def test_resume_falls_back_to_hydras_config(tmp_path, made_run):
    run = copy_of(made_run, tmp_path)
    (run / "config.yaml").unlink()
    rundir.check_resume(run, _config(made_run, resume=True), True, "hydra.run.dir")  # same settings: fine
    with pytest.raises(BenchError, match="gen.max_new_tokens: 4 then, 32 now"):
        rundir.check_resume(run, _config(made_run, **{"resume": True, "gen.max_new_tokens": 32}), True, "hydra.run.dir")


@pytest.mark.slow
def test_cli_resume_without_config_yaml_checks_hydras(tmp_path, made_run):
    """Records made with 16 tokens, resumed with 32, were accepted (exit 0, config.yaml rewritten)."""
    run = copy_of(made_run, tmp_path)
    (run / "config.yaml").unlink()
    before = snapshot(run)
    refused(run_cli(*TINY, "gen.max_new_tokens=32", "resume=true", f"hydra.run.dir={run}"),
            "gen.max_new_tokens: 4 then, 32 now")
    assert snapshot(run) == before


# --- a full disk --------------------------------------------------------------------------------

FULL_DISK = """
import errno, os, sys
import bench.rundir as rundir
real, name = rundir._write_all, sys.argv.pop(1)
def full(fd, data):  # the disk fills halfway through this file
    if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith("." + name + "."):
        real(fd, data[:len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    real(fd, data)
rundir._write_all = full
from bench.__main__ import main
main()
"""


def run_with_full_disk(name: str, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", FULL_DISK, name, *overrides], capture_output=True, text=True,
                          timeout=600, cwd=REPO, env=_cli_env())


def test_write_atomic_leaves_the_old_file_or_none(tmp_path, monkeypatch):
    path = tmp_path / "config.yaml"
    path.write_text("old: 1\n")

    def full(fd, data):
        os.write(fd, data[:3])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(rundir, "_write_all", full)
    for target in (path, tmp_path / "new.json"):
        with pytest.raises(BenchError, match="No space left on device.*it is left as it was"):
            rundir.write_atomic(target, "new: 2\n")
    assert os.listdir(tmp_path) == ["config.yaml"] and path.read_text() == "old: 1\n"


@pytest.mark.slow
@pytest.mark.parametrize("name,resume", [("config.yaml", False), ("summary.csv", True)])
def test_a_full_disk_is_one_line_leaves_nothing_half_written_and_resume_works(tmp_path, made_run, name, resume):
    run = copy_of(made_run, tmp_path) if resume else tmp_path / "run"
    before = snapshot(run) if resume else {}
    args = [*TINY, f"hydra.run.dir={run}", *(["resume=true"] if resume else [])]
    refused(run_with_full_disk(name, *args), f"cannot write {run / name} (No space left on device)")
    assert not [p for p in run.rglob("*.tmp")]
    if name in before:
        assert (run / name).read_bytes() == before[name]
    else:
        assert not (run / name).exists()
    again = run_cli(*args if resume else [*args, "resume=true"])  # room made: the same settings resume
    assert again.returncode == 0, again.stderr[-2000:]
    assert (run / name).stat().st_size > 0


# --- no write through a planted symbolic link ---------------------------------

# Every name a run opens in its directory, Hydra's job log and .hydra/ itself included.
RUN_FILES = ["records.jsonl", "records.jsonl.lock", "records.jsonl.tmp", "records.rejected.jsonl", "config.yaml",
             "provenance.json", "summary.csv", "summary.md", "summary_by_category.csv", rundir.MARKER,
             rundir.HYDRA_LOG, ".hydra", ".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml"]


def plant(run: Path, name: str, target: Path) -> None:
    """`run/name` made a link to `target`, replacing what the run wrote there."""
    link = run / name
    if link.is_dir() and not link.is_symlink():
        shutil.rmtree(link)
    elif os.path.lexists(link):
        link.unlink()
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)


def outside(tmp_path: Path, name: str, dangling: bool = False) -> Path:
    """What a planted link points at: a file of the user's (a directory for .hydra), or nothing."""
    target = tmp_path / "outside"
    if dangling:
        return target
    if name == ".hydra":
        target.mkdir()
        (target / "config.yaml").write_text("mine: 1\n")
    else:
        target.write_text("precious\n")
    return target


def seen(target: Path):
    return snapshot(target) if target.is_dir() else target.read_bytes() if target.exists() else None


@pytest.mark.slow
@pytest.mark.parametrize("dangling", [False, True], ids=["to-a-file", "dangling"])
@pytest.mark.parametrize("name", RUN_FILES)
def test_a_planted_link_is_refused_before_anything_is_written(tmp_path, made_run, name, dangling):
    """Fresh (the directory holds only the link) and a finished run resumed: check_owned, which
    every run, sweep job and leaderboard entry passes before writing, names the link."""
    target = outside(tmp_path, name, dangling)
    before = seen(target)
    for run in (tmp_path / "fresh", copy_of(made_run, tmp_path)):
        run.mkdir(exist_ok=True)
        plant(run, name, target)
        with pytest.raises(BenchError, match=f"^{run / name} is a symbolic link; .*choose a new hydra.run.dir"):
            rundir.check_owned(run, "hydra.run.dir")
    assert seen(target) == before


# End to end, the three files and one the run writes whole, fresh and resumed, and the three
# as dangling links on resume (a CLI run each, ~7 s on 2 cores); check_owned's cases above cover
# every name of RUN_FILES without starting a run.
_CLI_LINKS = [(name, resume, False) for name in ("records.jsonl.lock", "records.jsonl.tmp", "records.jsonl",
                                                  "provenance.json") for resume in (False, True)] + [
    (name, True, True) for name in ("records.jsonl.lock", "records.jsonl.tmp", "records.jsonl")]


@pytest.mark.slow
@pytest.mark.parametrize("name,resume,dangling", _CLI_LINKS,
                         ids=[f"{n}-{'resume' if r else 'fresh'}{'-dangling' if d else ''}" for n, r, d in _CLI_LINKS])
def test_cli_refuses_a_planted_link_and_writes_nothing_through_it(tmp_path, made_run, name, resume, dangling):
    run = copy_of(made_run, tmp_path) if resume else tmp_path / "run"
    run.mkdir(exist_ok=True)
    target = outside(tmp_path, name, dangling)
    before = seen(target)
    plant(run, name, target)
    out = run_cli(*TINY, f"hydra.run.dir={run}", *(["resume=true"] if resume else []))
    refused(out, f"{run / name} is a symbolic link")
    assert seen(target) == before  # unchanged; a dangling link's target not created
    assert (run / name).is_symlink()


@pytest.mark.parametrize("name", ["records.jsonl.lock", "records.jsonl", "records.jsonl.tmp",
                                  "records.rejected.jsonl"])
def test_record_log_opens_nothing_through_a_link(tmp_path, name):
    """Below the directory check: RecordLog itself never follows a link (O_NOFOLLOW), here on a
    resume that must set a damaged line aside (so it writes .tmp and the rejected file)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "records.jsonl").write_bytes(b"{torn\n")
    target = outside(tmp_path, name)
    plant(run, name, target)
    with pytest.raises(BenchError, match=f"^{run / name} is a symbolic link"):
        RecordLog(run / "records.jsonl", resume=True)
    assert target.read_bytes() == b"precious\n"


def test_write_atomic_does_not_write_through_a_planted_temporary_file(tmp_path):
    target = outside(tmp_path, "config.yaml")
    plant(tmp_path, f".config.yaml.{os.getpid()}.tmp", target)
    with pytest.raises(BenchError, match="is a symbolic link"):
        rundir.write_atomic(tmp_path / "config.yaml", "new: 2\n")
    assert target.read_bytes() == b"precious\n" and not (tmp_path / "config.yaml").exists()


# --- _target_: only this project's classes ------------------------------------------------------

@pytest.mark.parametrize("key,target", [
    ("decoder._target_", "builtins.open"),
    ("model._target_", "shutil.copyfile"),
    ("decoder._target_", "bench.records.RecordLog"),  # ours, but not a config class: it rewrites files
    ("decoder._target_", "bench.models.os.system"),  # under an allowed module, but not a class defined there
    ("decoder._target_", "antigravity.fly"),  # refused by name, never imported
    ("decoder.draft._target_", "subprocess.Popen"),
    ("logger._target_", "decoders.methods.nowhere.Missing"),
])
def test_only_project_classes_may_be_targets(key, target):
    cfg = OmegaConf.create({"decoder": {"_target_": "decoders.methods.autoregressive.Autoregressive", "draft": {}},
                            "model": {"_target_": "bench.models.TinyRandomModel"}, "logger": {}})
    OmegaConf.update(cfg, key, target, force_add=True)
    with pytest.raises(BenchError) as e:
        check_targets(cfg)
    assert f"{key}={target}: " in str(e.value) and "_target_ may name only a class in" in str(e.value)
    assert "antigravity" not in sys.modules


def test_hydra_may_name_its_own_classes_and_ours():
    launcher = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
    check_targets(OmegaConf.create({"hydra": {"launcher": {"_target_": launcher},
                                              "callbacks": {"stop": {"_target_": "bench.slurm.StopOnSlurmSignal"}}},
                                    "items": [{"_target_": "bench.datasets.HumanEval"}]}))
    with pytest.raises(BenchError, match=r"hydra.callbacks.x._target_=builtins.print"):
        check_targets(OmegaConf.create({"hydra": {"callbacks": {"x": {"_target_": "builtins.print"}}}}))
    with pytest.raises(BenchError, match=r"decoder._target_=hydra.utils.instantiate"):
        check_targets(OmegaConf.create({"decoder": {"_target_": "hydra.utils.instantiate"}}))


@pytest.mark.slow
def test_cli_target_override_is_refused_before_anything_runs(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    refused(run_cli(*TINY, "decoder._target_=builtins.open", f"+decoder.file={victim}", "+decoder.mode=w",
                    f"hydra.run.dir={tmp_path / 'r'}"), f"decoder._target_=builtins.open: not allowed; {ALLOWED}")
    assert victim.read_text() == "keep me" and not (tmp_path / "r").exists()


@pytest.mark.slow
@pytest.mark.parametrize("override", ["hydra.output_subdir=/tmp/elsewhere", "+hydra.job_logging.handlers.file.mode=w"])
def test_hydra_keys_that_write_elsewhere_are_refused(override):
    refused(run_cli(*TINY, override), "not overridable here")


@pytest.mark.slow
def test_show_builds_only_project_classes_and_reads_a_damaged_config_in_one_line(tmp_path, made_run, capsys):
    from bench import show

    run = copy_of(made_run, tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    cfg = OmegaConf.load(run / "config.yaml")
    cfg.model = {"_target_": "shutil.copyfile", "src": "/dev/null", "dst": str(victim)}
    (run / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    for body, message in [(None, f"model._target_=shutil.copyfile: not allowed; {ALLOWED}"),
                          ("model: [\n", "config.yaml is damaged (")]:
        if body is not None:
            (run / "config.yaml").write_text(body)
        with pytest.raises(SystemExit) as e:
            show.main([str(run), "--prompt", "HumanEval/0"])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and message in err[0], err
    assert victim.read_text() == "keep me"


# --- sweeps still work, and are refused the same way ---------------------------------------------

@pytest.mark.slow
def test_a_sweep_refused_changes_nothing(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", *TINY, "dataset.limit=1", "decoder=autoregressive", f"hydra.sweep.dir={sweep}"]
    assert run_cli(*args).returncode == 0
    before = snapshot(sweep)
    assert "multirun.yaml" in before and any(k.endswith(rundir.MARKER) for k in before)
    refused(run_cli(*args), "already holds records; pass resume=true")
    assert snapshot(sweep) == before  # multirun.yaml included: refused before Hydra started
    with pytest.raises(BenchError, match="is not a sweep directory of python -m bench"):
        rundir.check_sweep_dir(_leaderboard_like(tmp_path))


@pytest.mark.parametrize("overrides", [["hydra.sweep.subdir=../../x"], ["hydra.sweep.subdir=/tmp/elsewhere"],
                                       ["dataset=jsonl", "dataset.path=../../../p.jsonl"]])
def test_a_sweep_job_directory_outside_the_sweep_is_refused(tmp_path, capsys, overrides):
    """hydra.sweep.subdir, given or made of an override's own path (the default subdir is the
    overrides), must keep every job inside hydra.sweep.dir, where resume and bench.report look:
    else one line, before anything is written."""
    from bench.__main__ import precheck

    sweep = tmp_path / "a" / "b" / "sweep"
    with pytest.raises(SystemExit) as e:
        precheck(["-m", *TINY, *overrides, f"hydra.sweep.dir={sweep}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "a job's directory must lie inside hydra.sweep.dir" in err[0], err
    assert list(tmp_path.iterdir()) == []
    assert rundir.job_dir(sweep, "x/../y") == sweep / "y"  # a path that stays inside is the job's


# --- the Ctrl-C hint, pasted into a shell --------------------------------------------------------

def test_resume_hint_is_shell_quoted(tmp_path, monkeypatch):
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from bench.__main__ import CONF_DIR, hydra_quote, resume_command

    run = tmp_path / "my runs" / "it's, here"
    argv = ["bench", "model=tiny-random", "dataset.path='a b.jsonl'", f"hydra.run.dir={hydra_quote(run)}"]
    monkeypatch.setattr(sys, "argv", argv)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        HydraConfig.instance().set_config(compose("config", overrides=argv[1:], return_hydra_config=True))
    words = shlex.split(resume_command(run))  # as a shell splits the pasted line
    assert words[:6] == ["python", "-m", "bench", "model=tiny-random", "dataset.path='a b.jsonl'", "resume=true"]
    assert OverridesParser.create().parse_overrides(words[6:])[0].value() == str(run)  # as Hydra reads it


# --- the leaderboard's directory ------------------------------------------------------------------

def test_leaderboard_out_dir_is_new_empty_or_a_leaderboards(tmp_path):
    rundir.check_board_dir(tmp_path / "new")
    rundir.check_board_dir(tmp_path)  # empty
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "leaderboard.md").write_text("|x|\n")  # made before the marker existed
    rundir.check_board_dir(legacy)
    rundir.claim_board(tmp_path / "claimed")
    rundir.check_board_dir(tmp_path / "claimed")
    with pytest.raises(BenchError, match="is not a leaderboard's directory"):
        rundir.check_board_dir(REPO / "conf")  # would replace conf/leaderboard.yaml
    (tmp_path / "file").write_text("x")
    with pytest.raises(BenchError, match="a file, not a directory"):
        rundir.check_board_dir(tmp_path / "file")


@pytest.mark.slow
def test_cli_leaderboard_refuses_a_foreign_out_dir_and_changes_nothing(tmp_path):
    foreign = tmp_path / "conf-copy"
    shutil.copytree(REPO / "conf", foreign)
    before = snapshot(foreign)
    out = run_python("-m", "bench.leaderboard", "model=tiny-random", "device=cpu", f"leaderboard.out_dir={foreign}",
                     env=_cli_env())
    refused(out, "is not a leaderboard's directory")
    assert snapshot(foreign) == before
