"""The leaderboard in units (bench/leaderboard_plan.py, _unit.py, _merge.py, _cluster.py): the plan,
the merge's pairing within a node (two fake nodes of different speeds), its refusals, and the whole
command through Hydra's local joblib launcher against the one-process run. tests/test_slurm.py runs
it on a real SLURM, a unit cancelled and resumed."""
from __future__ import annotations

import json
import math
import os
import shutil

import pandas as pd
import pytest
from omegaconf import OmegaConf

from bench.errors import BenchError
from bench.registry import REFERENCE
from helpers import CACHE_DIR, DATA_DIR, run_python

ENTRIES = ["prompt_lookup-n3", "lookahead-n5w7g7"]
BOARD = ["model=tiny-random", "device=cpu", "+preset=spec_bench", "dataset.per_group=1", "leaderboard.repeats=2",
         f"leaderboard.only=[{REFERENCE},{','.join(ENTRIES)}]"]
SHARDS = ["leaderboard.cluster.questions=3"]
SPEEDUP = {"prompt_lookup-n3": 2.0, "lookahead-n5w7g7": 4.0}  # each entry's, on either node
# unit -> (node, how much slower than the fast node): lookahead's first slice on the slow node, the rest
# (the autoregressive row's units among them) on the fast one
NODES = {"spec_bench.prompt_lookup-n3.q0-2": ("fast", 1.0), "spec_bench.prompt_lookup-n3.q3-5": ("fast", 1.0),
         "spec_bench.lookahead-n5w7g7.q0-2": ("slow", 2.0), "spec_bench.lookahead-n5w7g7.q3-5": ("fast", 1.0)}
BUILD = {"git_commit": "c0ffee", "git_dirty": False, "git_diff": None, "dtype": "float32", "fast_path": "none",
         "model_source": {"random_seed": 0}, "model_flops_spec": {"matmul_params": 1}, "torch_threads": 1}


def compose(out_dir, *extra):
    from bench.leaderboard import compose_all

    return compose_all([*BOARD, *SHARDS, f"leaderboard.out_dir={out_dir}", *extra])


def fake_record(prompt, turn: int, label: str, latency: float, steps: int, node: str) -> dict:
    """A record of 10 new tokens in `steps` steps taking `latency` seconds, in each of 2 repeats."""
    from decoders.core.trace import output_positions

    committed = [10 // steps] * steps
    share = [latency / steps] * steps
    return {"key": f"{prompt.id}#{turn}", "prompt_id": prompt.id, "turn": turn, "decoder": label.split("-")[0],
            "label": label, "model": "tiny-random", "dataset": "spec_bench", "status": "ok",
            "category": prompt.meta["category"], "new_tokens": 10, "steps": steps, "tokens": list(range(10)),
            "text": "x" * 10, "prompt_text": f"{prompt.id}#{turn}", "tokens_per_step": 10 / steps,
            "latency_s": latency, "repeat_latency_s": [latency, latency], "ttft_s": share[0],
            "tokens_per_s": 10 / latency, "target_time_s": latency, "draft_time_s": 0.0, "overhead_time_s": 0.0,
            "forward_tokens": 10, "draft_tokens": 10 - steps, "accepted_draft_tokens": 10 - steps,
            "draft_forward_tokens": 0, "target_flops": 1.0, "draft_flops": 0.0, "decode_steps": steps - 1,
            "decode_tokens": 10 - committed[0], "decode_flops": 1.0, "decode_draft_flops": 0.0, "lossless": True,
            "node": node, "trace": {"committed": committed, "forward_tokens": committed, "context_tokens": [0] * steps,
                                    "position": output_positions(committed), "target_time": share,
                                    "draft_time": [0.0] * steps, "overhead_time": [0.0] * steps,
                                    "draft_forward_tokens": [0] * steps, "draft_flops": [0.0] * steps}}


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A sharded board of finished units as jobs on two nodes would leave it: the slow node takes twice
    as long for everything, so every entry's speedup is SPEEDUP's on both."""
    from bench.leaderboard_plan import make_units
    from bench.leaderboard_unit import DONE, Plan, plan_path, unit_dir
    from bench.runner import build

    out = tmp_path_factory.mktemp("board") / "board"
    base, labels, runs = compose(out)
    units = make_units(base, labels, runs)
    assert [u.name for u in units] == list(NODES)  # each entry's two slices, the reference in each
    plan = Plan(base, labels, units, runs, [*BOARD, *SHARDS])
    plan_path(out).parent.mkdir(parents=True)
    plan_path(out).write_text(plan.as_json())
    prompts = build(runs["spec_bench", REFERENCE].dataset, "dataset").load()
    for u in units:
        node, slower = NODES[u.name]
        where = unit_dir(out, u)
        for label in u.labels:
            run = where / u.dataset / label
            run.mkdir(parents=True)
            (run / "config.yaml").write_text(OmegaConf.to_yaml(runs[u.dataset, label], resolve=True))
            latency = slower / SPEEDUP.get(label, 1.0)
            steps = 10 if label == REFERENCE else 5
            # lookahead "tuned" itself per unit: a window of its node's (its forecast differs anyway)
            window = 2 if node == "slow" else 5
            tuned = {"window": window, "predicted_speedup": slower} if "lookahead" in label else None
            lines = [json.dumps({**fake_record(p, t, label, latency, steps, node), "tuned": tuned})
                     for p in prompts[u.start:u.stop] for t in range(len(p.turns))]
            (run / "records.jsonl").write_text("\n".join(lines) + "\n")
        (where / "provenance.json").write_text(json.dumps({**BUILD, "node": node, "device_name": f"{node} cpu",
                                                            "unit": u.as_dict(), "attempts": [{"node": node}]}))
        pd.DataFrame({"tokens": [1, 2], "latency_ms": [slower, 1.5 * slower], "vs_one_token": [1.0, 1.5]}).to_csv(
            where / "verification_cost.csv", index=False)
        (where / DONE).write_text(json.dumps(u.as_dict()))
    return out


@pytest.fixture
def board(template, tmp_path):
    return shutil.copytree(template, tmp_path / "board")


def test_units_slice_questions_and_keep_an_entry_carrying_state_whole(tmp_path):
    """questions=3 over 6 questions: two slices an entry, the reference in each; recycling, which drafts
    from what earlier prompts left, gets the dataset in one unit; entries=2 puts two entries in a unit."""
    from bench.leaderboard_plan import make_units, reference_units

    base, labels, runs = compose(tmp_path, f"leaderboard.only=[{REFERENCE},{','.join(ENTRIES)},recycling]")
    units = make_units(base, labels, runs)
    assert [(u.name, u.labels, u.start, u.stop) for u in units] == [
        ("spec_bench.prompt_lookup-n3.q0-2", (REFERENCE, "prompt_lookup-n3"), 0, 3),
        ("spec_bench.prompt_lookup-n3.q3-5", (REFERENCE, "prompt_lookup-n3"), 3, 6),
        ("spec_bench.lookahead-n5w7g7.q0-2", (REFERENCE, "lookahead-n5w7g7"), 0, 3),
        ("spec_bench.lookahead-n5w7g7.q3-5", (REFERENCE, "lookahead-n5w7g7"), 3, 6),
        ("spec_bench.recycling.q0-5", (REFERENCE, "recycling"), 0, 6)]
    assert [u.turns for u in units] == [4, 3, 4, 3, 7]  # the MT-Bench question's two turns among the first three
    assert [u.name for u in reference_units(units)["spec_bench"]] == [u.name for u in units[:2]]
    base.leaderboard.cluster.entries = 2
    assert [u.labels for u in make_units(base, labels, runs)] == [(REFERENCE, *ENTRIES)] * 2 + [
        (REFERENCE, "recycling")]


def test_merged_speedups_are_taken_within_a_node(board):
    """Two nodes, one twice as slow, lookahead's slices on both: every speedup is the entry's on each
    node, where dividing by the table's autoregressive row (timed on the fast node for lookahead's slow
    slice) would not be."""
    from bench import leaderboard_merge
    from bench.leaderboard_tables import board_row
    from bench.leaderboard_unit import load_plan

    leaderboard_merge.merge(board)
    df = pd.read_csv(board / "leaderboard.csv")
    got = df[df["dataset"] == "spec_bench"].set_index("decoder")
    for label, speedup in SPEEDUP.items():
        assert got.loc[label, "speedup"] == pytest.approx(speedup)
        assert got.loc[label, "speedup_ci_low"] == pytest.approx(speedup)  # every pair says the same
        assert got.loc[label, "speedup_per_run_p25"] == pytest.approx(speedup)
    assert got.loc[REFERENCE, "speedup"] == pytest.approx(1.0)
    spec = pd.read_csv(board / "spec_bench.csv").set_index("decoder")
    for label, speedup in SPEEDUP.items():
        for column in ("MT-Bench", "Translation", "Overall"):
            assert spec.loc[label, f"{column} speedup_mean"] == pytest.approx(speedup)
    # the control: lookahead against the autoregressive row's records, across nodes for its first slice
    records, _ = leaderboard_merge.gather(load_plan(board), board)
    crossed = board_row(records["spec_bench", "lookahead-n5w7g7"], records["spec_bench", REFERENCE])["speedup"]
    assert crossed == pytest.approx(4.0 * 5 / 7)  # 4 of the 7 turns at half speed: (4 * 20 + 3 * 40) / 7 / 10
    md = (board / "leaderboard.md").read_text()
    assert "nodes 2 (fast, slow)" in md and "each prompt's pair timed in one unit, on one node" in md
    assert "verification cost on node fast" in md and "verification cost on node slow" in md
    assert ('lookahead-n5w7g7 on spec_bench tuned itself differently in its units (each on its node): '
            '{"window": 2} / {"window": 5}') in md and "prompt_lookup-n3 on spec_bench tuned" not in md
    info = json.loads((board / "provenance.json").read_text())
    assert info["git_commit"] == "c0ffee" and set(info["units"]) == set(NODES)
    assert (board / "plots" / "speedup.png").is_file() and (board / "spec_bench.md").is_file()


def _edit_json(path, **changes):
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("fault,message", [
    ("commit", "different builds (commit"),
    ("model", "different builds (model"),
    ("settings", "other settings than the plan's (gen.max_new_tokens"),
    ("unfinished", "1 of 4 units in"),
    ("node", "a speedup must not cross nodes"),
])
def test_merge_refuses_what_would_mix(board, fault, message):
    """Units of another commit or model, a unit run with other settings, one unfinished, or a record
    timed on another node than the reference it is paired with: one line, nothing merged."""
    from bench import leaderboard_merge

    unit = board / "units" / "spec_bench.lookahead-n5w7g7.q3-5"
    if fault == "commit":
        _edit_json(unit / "provenance.json", git_commit="beef")
    elif fault == "model":
        _edit_json(unit / "provenance.json", model_source={"random_seed": 1})
    elif fault == "settings":
        config = unit / "spec_bench" / "lookahead-n5w7g7" / "config.yaml"
        config.write_text(config.read_text().replace("max_new_tokens: 1024", "max_new_tokens: 512"))
    elif fault == "unfinished":
        (unit / "unit.json").unlink()
    else:
        records = unit / "spec_bench" / "lookahead-n5w7g7" / "records.jsonl"
        records.write_text(records.read_text().replace('"node": "fast"', '"node": "slow"', 1))
    with pytest.raises(BenchError, match=message.replace("(", r"\(")):
        leaderboard_merge.merge(board)
    assert not (board / "leaderboard.csv").exists()


def test_the_plan_estimates_time_from_a_profile_and_a_pilot(board, tmp_path):
    """Without a pilot the tokens are the budget and a forward one token; a device profile prices one-token
    steps; a pilot (an earlier board of this model) gives tokens a turn and tokens per step, and with
    the profile its steps priced there (bench/forecast.py)."""
    from bench.leaderboard_plan import expected, make_units

    profile = tmp_path / "profile"
    profile.mkdir()
    pd.DataFrame({"tokens": [1, 2, 4], "none_ms": [10.0, 12.0, 16.0]}).to_csv(profile / "profile.csv", index=False)
    base, labels, runs = compose(tmp_path / "out", f"leaderboard.cluster.profile={profile}")
    units = make_units(base, labels, runs)
    table = expected(units, base, runs).set_index(["unit", "label"])
    first = table.loc["spec_bench.prompt_lookup-n3.q0-2"]
    assert first.loc[REFERENCE, "tokens"] == 4 * 2 * 1024  # 4 turns x 2 repeats x the budget
    assert first.loc[REFERENCE, "seconds"] == pytest.approx(4 * 2 * 1024 * 0.010)
    assert first.loc["prompt_lookup-n3", "forwards_bound"] and not first.loc[REFERENCE, "forwards_bound"]

    pilot = tmp_path / "pilot"  # the fake board's first slices, laid out as a one-process board's
    for label in (REFERENCE, "prompt_lookup-n3"):
        shutil.copytree(board / "units" / "spec_bench.prompt_lookup-n3.q0-2" / "spec_bench" / label,
                        pilot / "spec_bench" / label)
    base, labels, runs = compose(tmp_path / "out", f"leaderboard.cluster.pilot={pilot}")
    table = expected(make_units(base, labels, runs), base, runs).set_index(["unit", "label"])
    row = table.loc[("spec_bench.prompt_lookup-n3.q3-5", "prompt_lookup-n3")]
    assert (row["tokens"], row["forwards"], row["forwards_bound"]) == (3 * 2 * 10, 3 * 2 * 5, False)
    assert math.isnan(row["seconds"])  # no profile: no time
    base, labels, runs = compose(tmp_path / "out", f"leaderboard.cluster.pilot={pilot}",
                                 f"leaderboard.cluster.profile={profile}")
    table = expected(make_units(base, labels, runs), base, runs).set_index(["unit", "label"])
    # the pilot's 5 steps of 2 tokens, priced at 12 ms (its prefill, 2 tokens after none, as well)
    assert table.loc[("spec_bench.prompt_lookup-n3.q3-5", "prompt_lookup-n3"), "seconds"] == pytest.approx(
        3 * 2 * 5 * 0.012)


def test_a_unit_that_would_not_fit_a_node_is_refused(tmp_path):
    from bench.leaderboard_cluster import plan_board

    overrides = [*BOARD, *SHARDS, f"leaderboard.out_dir={tmp_path / 'out'}", "hydra/launcher=slurm_cpu"]
    base, labels, runs = compose(tmp_path / "out", "hydra/launcher=slurm_cpu", "leaderboard.cluster.memory_gb=0.001")
    with pytest.raises(BenchError, match=r"unit spec_bench.prompt_lookup-n3.q0-2 would not fit a node \(cpu, 0.0 GiB "
                                         r"from leaderboard.cluster.memory_gb\): model tiny-random: needs about"):
        plan_board(base, labels, runs, [*overrides, "leaderboard.cluster.memory_gb=0.001"], "slurm_cpu")
    base, labels, runs = compose(tmp_path / "out", "hydra/launcher=slurm_cpu")
    plan, text = plan_board(base, labels, runs, overrides, "slurm_cpu")
    assert "memory 4.0 GiB (hydra.launcher.mem_gb)" in text and "4 units on hydra/launcher=slurm_cpu" in text
    assert all(cfg.threads == 2 for cfg in plan.runs.values())  # slurm_cpu's cpus_per_task, pinned for the jobs
    assert not (tmp_path / "out").exists()


def cluster_env() -> dict:
    return dict(os.environ, BENCH_DATA_DIR=str(DATA_DIR), BENCH_CACHE_DIR=CACHE_DIR)


# What the sharded and the one-process runs must share to compute the same steps: the fast path and the
# threads (auto picks per process, and a sum's order follows the threads).
SAME = ["gen.max_new_tokens=24", "leaderboard.repeats=1", "model.fast_path=none", "threads=1", "progress=false",
        f"leaderboard.only=[{REFERENCE},{','.join(ENTRIES)},recycling]"]
EXACT = ["prompts", "runs", "tokens_per_step", "mean_accepted_tokens", "acceptance_rate", "same_as_autoregressive",
         "lossless", "flops_per_token_vs_ar"]


def same_figures(sharded, single) -> None:
    """The merged tables' token, step and acceptance figures are the one-process run's exactly, and so is
    every record's output and trace of committed tokens."""
    a, b = pd.read_csv(sharded / "leaderboard.csv"), pd.read_csv(single / "leaderboard.csv")
    assert list(a.columns) == list(b.columns) and list(a["decoder"]) == list(b["decoder"])
    pd.testing.assert_frame_equal(a[EXACT], b[EXACT])
    sa, sb = pd.read_csv(sharded / "spec_bench.csv"), pd.read_csv(single / "spec_bench.csv")
    exact = [c for c in sa.columns if c.endswith("mean_accepted_tokens") or c in ("questions", "of", "runs")]
    assert list(sa.columns) == list(sb.columns)
    pd.testing.assert_frame_equal(sa[exact], sb[exact])
    for run in (single / "spec_bench").iterdir():
        want = {r["key"]: r for r in map(json.loads, (run / "records.jsonl").read_text().splitlines())}
        got = {}
        for unit in (sharded / "units").glob(f"*{run.name}*" if run.name != REFERENCE else "*.prompt_lookup-n3.*"):
            got.update((r["key"], r) for r in map(json.loads, (unit / "spec_bench" / run.name / "records.jsonl")
                                                   .read_text().splitlines()))
        assert set(got) == set(want), run.name
        for key, r in want.items():
            assert (got[key]["tokens"], got[key]["trace"]["committed"]) == (r["tokens"], r["trace"]["committed"])


@pytest.mark.slow
def test_joblib_runs_the_units_and_merges_the_one_process_table(tmp_path):
    """hydra/launcher=joblib: the plan printed, 5 units run as local processes and merged into the
    tables the one-process run writes, with its tokens, steps and acceptance; a rerun submits nothing
    and merges again; --dry-run writes nothing."""
    sharded, single = tmp_path / "sharded", tmp_path / "single"
    command = ["-m", "bench.leaderboard", *BOARD, *SHARDS, *SAME, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
               f"leaderboard.out_dir={sharded}"]
    dry = run_python(*command, "--dry-run", env=cluster_env(), timeout=600)
    assert dry.returncode == 0 and "plan: 5 units on hydra/launcher=joblib" in dry.stdout, dry.stderr[-2000:]
    assert "spec_bench.recycling.q0-5" in dry.stdout and not sharded.exists()
    result = run_python(*command, env=cluster_env(), timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in (sharded / "jobs").glob("unit*")) == [f"unit{i}" for i in range(5)]
    board = run_python("-m", "bench.leaderboard", *BOARD, *SAME, f"leaderboard.out_dir={single}", env=cluster_env(),
                       timeout=1200)
    assert board.returncode == 0, board.stderr[-3000:]
    same_figures(sharded, single)
    before = (sharded / "units" / "spec_bench.recycling.q0-5" / "provenance.json").read_text()
    again = run_python(*command, env=cluster_env(), timeout=600)
    assert again.returncode == 0 and "| prompt_lookup-n3 |" in again.stdout, again.stderr[-2000:]
    assert (sharded / "units" / "spec_bench.recycling.q0-5" / "provenance.json").read_text() == before  # not rerun
    # the one-process command into the sharded board, and the sharded one with other slices: one line each
    for extra, message in (([], "holds a sharded leaderboard (units/)"),
                           (["hydra/launcher=joblib", "leaderboard.cluster.questions=2"], "units planned otherwise")):
        refused = run_python("-m", "bench.leaderboard", *BOARD, *SAME, *extra, f"leaderboard.out_dir={sharded}",
                             env=cluster_env(), timeout=600)
        lines = refused.stderr.strip().splitlines()
        assert refused.returncode == 2 and len(lines) == 1 and message in lines[0], refused.stderr[-2000:]


@pytest.mark.slow
def test_a_resumed_entry_rebuilds_what_it_carries_between_prompts(tmp_path, monkeypatch):
    """Recycling drafts from a table its earlier prompts filled: resumed after its first question, it
    decodes that question again (untimed) before going on, so that every later question starts from
    the table the run that was not interrupted had there (it started from an empty one)."""
    from bench import leaderboard, leaderboard_run
    from decoders.methods.recycling import Recycling

    starts = []  # (prompt, the table as the prompt starts)
    generate = Recycling.generate

    def logged(self, lm, prompt_ids, *args):
        starts.append((tuple(prompt_ids), {k: list(v) for k, v in self.carried(lm).items()}))
        return generate(self, lm, prompt_ids, *args)

    monkeypatch.setattr(Recycling, "generate", logged)
    _, labels, runs = leaderboard.compose_all(
        ["model=tiny-random", "device=cpu", f"leaderboard.only=[{REFERENCE},recycling]", "leaderboard.datasets=[gsm8k]",
         "leaderboard.limit=3", "gen.max_new_tokens=24", "quality=false", "progress=false", "warmup=false"])
    whole = leaderboard_run.run_dataset("gsm8k", labels, runs, tmp_path / "whole", {})
    uninterrupted = list(starts)
    resumed = tmp_path / "resumed" / "gsm8k"
    shutil.copytree(tmp_path / "whole" / "gsm8k", resumed)
    for label in labels:  # as if stopped after the first question
        records = resumed / label / "records.jsonl"
        records.write_text(records.read_text().splitlines()[0] + "\n")
    starts.clear()
    again = leaderboard_run.run_dataset("gsm8k", labels, runs, tmp_path / "resumed", {})
    assert len(uninterrupted) == 3 and uninterrupted[1][1]  # the second question starts from a filled table
    assert starts == uninterrupted  # the first decoded again, untimed; the others from the same tables
    assert [r["tokens"] for r in again["recycling"]] == [r["tokens"] for r in whole["recycling"]]


def test_a_stop_waits_for_a_prompts_records_to_be_written_together():
    """SIGTERM (scancel) during a prompt's appends is raised once every entry's record of it is written:
    a unit resumed elsewhere never pairs an entry's record with a reference timed on another node."""
    import signal
    import threading
    import time
    from types import SimpleNamespace

    from bench.leaderboard_run import record_prompt
    from bench.slurm import Stopped

    written = []

    class Log:
        def __init__(self, label):
            self.label = label

        def append(self, record):
            if not written:
                os.kill(os.getpid(), signal.SIGTERM)  # the stop comes during the first append
                time.sleep(0.05)  # long enough for another thread to take it
            written.append(self.label)

    def stop(signum, frame):
        raise Stopped("stopped")

    labels = [REFERENCE, "prompt_lookup-n3"]
    entries = SimpleNamespace(ctxs={REFERENCE: SimpleNamespace(sampling=SimpleNamespace(greedy=False))},
                              logs={label: Log(label) for label in labels}, calibration=dict.fromkeys(labels))
    # another thread, as torch's OpenMP workers are: the kernel may hand it the process's SIGTERM (blocking
    # the signal in the main thread alone held nothing then)
    done = threading.Event()
    other = threading.Thread(target=done.wait)
    other.start()
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        with pytest.raises(Stopped):
            record_prompt(entries, "q#0", {label: {"status": "ok"} for label in labels}, dict.fromkeys(labels, [1.0]))
    finally:
        signal.signal(signal.SIGTERM, previous)
        done.set()
        other.join()
    assert written == labels
