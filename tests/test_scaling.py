"""Sweeps and the scaling law: the W x N sweep config (grid, precheck, launchers), the fit,
loading a sweep, scripts/scaling_law.py and notebooks/scaling_law.ipynb on a checked-in fixture."""
import json
import math

import numpy as np
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

import bench.__main__ as entry
from bench import scaling
from helpers import REPO, run_cli, run_python

FIXTURE = REPO / "tests" / "fixtures" / "lookahead_sweep"
GRID_W, GRID_N = [1, 3, 5, 7, 10, 15], [2, 3, 4, 5]


def test_fit_recovers_a_known_law():
    rng = np.random.default_rng(0)
    flops = np.geomspace(1e8, 1e11, 12)
    steps = 500 - 20 * np.log(flops) + rng.normal(0, 0.5, flops.size)
    fit = scaling.fit_law(flops, steps)
    assert fit["b"] == pytest.approx(20, abs=0.5) and fit["a"] == pytest.approx(500, abs=15)
    assert fit["b_per_decade"] == pytest.approx(fit["b"] * math.log(10)) and fit["r2"] > 0.99
    assert fit["points"] == 12
    assert math.isnan(scaling.fit_law([1e9, 1e9], [10, 12])["b"])  # one FLOPs value: no slope


def test_fit_table_fits_all_points_then_each_n():
    rows = [{"N": n, "flops_per_step": f, "steps": 300 - (5 + n) * math.log(f)} for n in (2, 3)
            for f in (1e8, 1e9, 1e10)]
    table = scaling.fit_table(pd.DataFrame(rows)).set_index("N")
    assert list(table.index) == ["all", "2", "3"]
    assert table.loc["2", "b"] == pytest.approx(7) and table.loc["3", "b"] == pytest.approx(8)
    assert table.loc["all", "b"] == pytest.approx(7.5)


def test_residuals_and_local_slopes_show_where_the_line_bends():
    """A straight law up to W=4, flat after: the residuals leave the line and share_of_fit says
    where more FLOPs stopped buying steps."""
    rows = [{"W": w, "N": 5, "flops_per_step": 1e9 * w, "steps": 100 - 10 * math.log(min(w, 4))}
            for w in (1, 2, 4, 8, 16)]
    points = pd.DataFrame(rows)
    fits = scaling.fit_table(points)
    with_res = scaling.with_residuals(points, fits)
    line = fits.set_index("N").loc["5"]
    assert with_res["residual"].tolist() == pytest.approx(
        [s - (line["a"] - line["b"] * math.log(f)) for s, f in zip(points["steps"], points["flops_per_step"])])
    slopes = scaling.local_slopes(points, fits).set_index("W_to")
    assert slopes.loc[2, "b_local"] == pytest.approx(10) and slopes.loc[4, "b_local"] == pytest.approx(10)
    assert slopes.loc[8, "b_local"] == pytest.approx(0) and slopes.loc[16, "share_of_fit"] == pytest.approx(0)
    assert slopes.loc[2, "share_of_fit"] > 1  # steeper than the line that the flat tail pulls down


@pytest.mark.slow
def test_a_sweep_over_datasets_gives_one_law_each_and_checks_outputs(tmp_path):
    """Two datasets in one sweep: one Analysis each; an autoregressive run beside a lookahead run
    of the same prompts makes same_as_autoregressive 1 (lookahead is lossless)."""
    out = run_cli("-m", "model=tiny-random", "decoder=autoregressive,lookahead", "dataset=gsm8k,humaneval",
                  "dataset.limit=1", "gen.max_new_tokens=8", "quality=false", "warmup=false", "progress=false",
                  f"hydra.sweep.dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    analyses = scaling.analyse_each([tmp_path])
    assert sorted(analyses) == ["tiny-random_gsm8k", "tiny-random_humaneval"]
    for a in analyses.values():
        assert a.points["same_as_autoregressive"].tolist() == [1.0] and a.baseline > 0
    with pytest.raises(ValueError, match="one scaling law per model and dataset"):
        scaling.analyse([tmp_path])
    script = run_python("scripts/scaling_law.py", tmp_path, "--out", tmp_path / "law", timeout=120)
    assert script.returncode == 0, script.stderr
    assert (tmp_path / "law" / "tiny-random_gsm8k" / "scaling_fit.md").exists()
    assert "## tiny-random on humaneval" in script.stdout


def test_fixture_loads_as_the_grid():
    runs = scaling.load_runs([FIXTURE])
    assert len(runs) == len(GRID_W) * len(GRID_N)
    assert sorted(set(runs["W"])) == GRID_W and sorted(set(runs["N"])) == GRID_N
    assert (runs["G"] == runs["W"]).all()  # G follows W, as in the paper
    points, tokens = scaling.scaling_points(runs)
    assert tokens == 64 and len(points) == len(runs)
    assert np.allclose(points["steps"], 64 / points["tokens_per_step"])
    assert list(points[["N", "W"]].itertuples(index=False)) == sorted(
        (n, w) for n in GRID_N for w in GRID_W)
    # A real model: more compute per step buys fewer steps.
    analysis = scaling.analyse([FIXTURE])
    assert analysis.b > 0 and analysis.baseline is None
    assert scaling.scaling_points(runs, tokens=128)[0]["steps"].tolist() == pytest.approx(
        (2 * points["steps"]).tolist())


def test_loading_refuses_what_is_not_one_lookahead_sweep(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        scaling.load_runs([tmp_path / "nope"])
    (tmp_path / "killed").mkdir()
    (tmp_path / "killed" / "records.jsonl").write_text("")
    with pytest.raises(FileNotFoundError, match="no finished runs"), pytest.warns(UserWarning, match="1 unfinished"):
        scaling.load_runs([tmp_path])
    runs = scaling.load_runs([FIXTURE])
    with pytest.raises(ValueError, match="no finished lookahead runs"):
        scaling.scaling_points(runs.assign(decoder="jacobi"))
    mixed = runs.copy()
    mixed.loc[0, "model"] = "other"
    with pytest.raises(ValueError, match="one scaling law per model and dataset"):
        scaling.scaling_points(mixed)


@pytest.mark.slow
def test_script_writes_plots_and_reports_b(tmp_path):
    out = run_python("scripts/scaling_law.py", FIXTURE, "--out", tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    for name in ["steps_vs_flops.png", "residuals.png", "tokens_per_s_vs_window.png"]:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fits = pd.read_csv(tmp_path / "scaling_fit.csv")
    assert fits["N"].astype(str).tolist() == ["all"] + [str(n) for n in GRID_N]
    b = scaling.analyse([FIXTURE]).b
    assert fits.loc[0, "b"] == pytest.approx(b) and f"b = {b:.4g}" in out.stdout
    assert len(pd.read_csv(tmp_path / "scaling_points.csv")) == 24
    assert "a - b ln(FLOPs per step)" in (tmp_path / "scaling_fit.md").read_text()
    # T scales the steps, so a and b double with it.
    twice = run_python("scripts/scaling_law.py", FIXTURE, "--out", tmp_path / "t", "--tokens", "128", timeout=120)
    assert twice.returncode == 0, twice.stderr
    assert pd.read_csv(tmp_path / "t" / "scaling_fit.csv").loc[0, "b"] == pytest.approx(2 * b)
    missing = run_python("scripts/scaling_law.py", tmp_path / "nope", timeout=120)
    assert missing.returncode == 2 and missing.stderr.strip().startswith("error: ") and "nope" in missing.stderr


@pytest.mark.slow
def test_notebook_runs_on_the_fixture(monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("SWEEP_DIRS", str(FIXTURE))
    monkeypatch.delenv("SCALING_TOKENS", raising=False)
    nb = nbformat.read(REPO / "notebooks" / "scaling_law.ipynb", as_version=4)
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(REPO / "notebooks")}}).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 3  # law, residuals, throughput
    text = "".join(o.get("text", "") for o in outputs)
    assert f"b = {scaling.analyse([FIXTURE]).b:.4g}" in text and "24 lookahead runs" in text


# --- the sweep configs and the precheck -------------------------------------------------------

def checked_jobs(monkeypatch, *argv) -> list[list[str]]:
    """The job overrides the precheck composes and checks for this command line."""
    jobs = []
    monkeypatch.setattr(entry, "_compose_job", lambda hydra_overrides, combo: jobs.append(combo))
    monkeypatch.setattr(entry, "_check_jobs", lambda composed, multirun: None)
    entry.precheck(list(argv))
    return jobs


def test_precheck_checks_every_job_of_the_sweep_config(monkeypatch):
    jobs = checked_jobs(monkeypatch, "+sweep=lookahead_grid", "model=tiny-random")
    grid = {(job[0], job[1]) for job in jobs}
    assert len(jobs) == 24 and grid == {(f"decoder.window={w}", f"decoder.ngram={n}") for w in GRID_W for n in GRID_N}
    assert all("+sweep=lookahead_grid" in job and "model=tiny-random" in job for job in jobs)
    # A command-line list replaces the config's for that key, as in Hydra's basic sweeper.
    narrowed = checked_jobs(monkeypatch, "-m", "+sweep=lookahead_grid", "decoder.window=1,3")
    assert sorted({j[0] for j in narrowed}) == ["decoder.window=1", "decoder.window=3"] and len(narrowed) == 8
    # Without a sweep config, a single run is one job.
    assert len(checked_jobs(monkeypatch, "decoder=lookahead")) == 1


def test_bad_value_in_a_sweep_config_fails_before_anything_runs(tmp_path, capsys):
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "bad.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /decoder: lookahead\n"
        "hydra:\n  mode: MULTIRUN\n  sweeper:\n    params:\n      decoder.window: 3,5,0\n      decoder.ngram: 2,3\n")
    with pytest.raises(SystemExit) as exit_:
        entry.precheck([f"hydra.searchpath=[file://{tmp_path}]", "+sweep=bad", "model=tiny-random"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: decoder: decoder.window must be an integer >= 1 or auto, got 0"
    with pytest.raises(SystemExit):
        entry.precheck(["+sweep=nope"])
    assert "unknown sweep 'nope'; choose one of: chain_budget, eagle_tree, lookahead_grid" in capsys.readouterr().err


def test_launcher_presets_compose():
    with initialize_config_dir(config_dir=str(entry.CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["+sweep=lookahead_grid", "hydra/launcher=slurm",
                                           "hydra.launcher.partition=gpu", "hydra.launcher.timeout_min=30"],
                      return_hydra_config=True)
        launcher = cfg.hydra.launcher
        assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
        assert (launcher.partition, launcher.timeout_min, launcher.gpus_per_node) == ("gpu", 30, 1)
        assert cfg.decoder.name == "lookahead" and str(cfg.hydra.mode) == "RunMode.MULTIRUN"
        joblib = compose("config", overrides=["+sweep=lookahead_grid", "hydra/launcher=joblib",
                                              "hydra.launcher.n_jobs=2"], return_hydra_config=True)
        assert joblib.hydra.launcher._target_.endswith("JoblibLauncher") and joblib.hydra.launcher.n_jobs == 2
        large = compose("config", overrides=["+sweep=lookahead_grid_large"], return_hydra_config=True)
        assert large.hydra.sweeper.params["decoder.window"] == "1,2,4,8,16,32,64"
        law = compose("config", overrides=["+sweep=scaling_law", "hydra/launcher=slurm_cpu"], return_hydra_config=True)
        assert law.hydra.launcher._target_.endswith("submitit_launcher.SlurmLauncher")
        assert (law.gen.max_new_tokens, law.quality, law.decoder.name) == (256, False, "lookahead")


def test_scaling_law_sweep_is_the_papers_grid_on_two_datasets(monkeypatch):
    """W doubling 1..32 x N 3..11 (G = W) on 10 MT-Bench and 10 HumanEval prompts: 60 jobs, the
    same with the SLURM launcher (only the launcher changes)."""
    for launcher in ([], ["hydra/launcher=slurm_cpu"]):
        jobs = checked_jobs(monkeypatch, "+sweep=scaling_law", *launcher)
        assert len(jobs) == 60
        grid = {tuple(sorted(o for o in job if o.split("=")[0] in ("decoder.window", "decoder.ngram", "dataset")))
                for job in jobs}
        assert grid == {tuple(sorted((f"decoder.window={w}", f"decoder.ngram={n}", f"dataset={d}")))
                        for w in (1, 2, 4, 8, 16, 32) for n in (3, 5, 7, 9, 11) for d in ("mt_bench", "humaneval")}
        assert all("dataset.limit=10" in job for job in jobs)


@pytest.mark.slow
def test_sweep_runs_in_parallel_resumes_and_loads(tmp_path):
    """A real (tiny) sweep on the joblib launcher: run dirs that the report and the scaling law read;
    resumed on the submitit launcher."""
    args = ["+sweep=lookahead_grid", "model=tiny-random", "dataset.limit=1", "gen.max_new_tokens=8",
            "decoder.window=1,3", "decoder.ngram=2,3", "quality=false", "threads=1", "hydra/launcher=joblib",
            "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={tmp_path}"]
    out = run_cli(*args)  # no -m: the sweep config is a multirun by itself
    assert out.returncode == 0, out.stderr
    runs = sorted(p.parent for p in tmp_path.rglob("summary.csv"))
    assert len(runs) == 4
    analysis = scaling.analyse([tmp_path])
    assert sorted(zip(analysis.points["W"], analysis.points["N"])) == [(1, 2), (1, 3), (3, 2), (3, 3)]
    assert analysis.tokens == 8 and (analysis.points["G"] == analysis.points["W"]).all()
    report = run_python("-m", "bench.report", tmp_path, "--out", tmp_path / "report", timeout=120)
    assert report.returncode == 0, report.stderr
    table = pd.read_csv(tmp_path / "report" / "report.csv")  # swept parameters as columns, rows in grid order
    assert list(zip(table["decoder.ngram"], table["decoder.window"])) == [(2, 1), (2, 3), (3, 1), (3, 3)]
    # Rerun with resume=true: every run is complete, nothing is generated twice. This time through
    # submitit (locally), the path a SLURM sweep takes short of sbatch.
    before = {r: (r / "records.jsonl").read_text() for r in runs}
    again = run_cli(*[a for a in args if "launcher" not in a], "hydra/launcher=submitit_local", "resume=true")
    assert again.returncode == 0, again.stderr
    assert len(list((tmp_path / ".submitit").rglob("*_result.pkl"))) == 4
    assert {r: (r / "records.jsonl").read_text() for r in runs} == before
    assert [json.loads(text)["key"]
            for text in (runs[0] / "records.jsonl").read_text().splitlines()] == ["HumanEval/0#0"]
