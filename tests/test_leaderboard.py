"""The leaderboard end to end on tiny-random (two prompts per dataset, every decoder), its
resume, its presets (+preset=speculative / lookahead / heads / baselines / leaders / long_outputs), repeats, and the
step-by-step view."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pandas as pd
import pytest
from omegaconf import OmegaConf

from bench import drift
from bench.registry import decoder_configs
from helpers import CACHE_DIR, DATA_DIR, on_cpu, REPO, run_python

TINY = ["model=tiny-random", "device=cpu", "gen.max_new_tokens=10", "leaderboard.limit=2", "draft.layers=1",
        "draft.adapter=null",
        "leaderboard.verification_tokens=[1,2,4]", "leaderboard.sweeps=[tests/fixtures/lookahead_sweep]",
        # the shipped heads are SmolLM2's: tiny-random gets untrained ones
        'leaderboard.decoders.medusa=["decoder=medusa","decoder.heads=null"]',
        'leaderboard.decoders.eagle=["decoder=eagle","decoder.draft_weights=null"]',
        'leaderboard.decoders.eagle-static=["decoder=eagle","decoder.draft_weights=null","decoder.tree=static"]',
        'leaderboard.decoders.dflash=["decoder=dflash","decoder.draft_weights=null","decoder.auto_sizes=[2,4]"]',
        'leaderboard.decoders.bpd=["decoder=bpd","decoder.heads=null"]',
        'leaderboard.decoders.bpd-ngram=["decoder=bpd","decoder.heads=null","decoder.rescore=ngram","decoder.paths=4"]',
        # a 2 x 2 grid over 16 tokens: its default (4 x 4 over 3 prompts of 48) first decodes 144 times
        'leaderboard.decoders.lookahead-auto=["decoder=lookahead","decoder.window=auto","decoder.ngram=auto",'
        '"decoder.guess_set_size=auto","decoder.auto_windows=[1,3]","decoder.auto_ngrams=[3,5]","decoder.auto_tokens=16"]']
LABELS = ["autoregressive", "hf_generate", "hf_pld", "prompt_lookup", "recycling", "suffix", "eagle", "eagle-static",
          "dflash", "hf_assisted", "jacobi", "lookahead",
          "lookahead-auto", "spec_chain", "specinfer", "sequoia", "sequoia-auto", "medusa", "bpd", "bpd-ngram"]
COLUMNS = ["decoder", "dataset", "prompts", "tokens_per_step", "mean_accepted_tokens", "tokens_per_s", "speedup",
           "speedup_geomean", "speedup_pooled", "acceptance_rate", "flops_per_token_vs_ar", "same_as_autoregressive",
           "lossless", "lossless_up_to_ties", "real_divergences", "quality_metric", "quality"]


def run_module(module: str, *args: str, timeout: int = 1200) -> subprocess.CompletedProcess:
    env = dict(os.environ, BENCH_DATA_DIR=str(DATA_DIR), BENCH_CACHE_DIR=CACHE_DIR)
    args = on_cpu(args) if module == "bench.leaderboard" else args  # bench.report / bench.show load no model
    return run_python("-m", module, *args, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def board(tmp_path_factory):
    out = tmp_path_factory.mktemp("leaderboard")
    result = run_module("bench.leaderboard", *TINY, f"leaderboard.out_dir={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result


@pytest.mark.slow
def test_table_has_every_decoder_dataset_and_column(board):
    out, result = board
    df = pd.read_csv(out / "leaderboard.csv")
    assert set(COLUMNS) <= set(df.columns)
    assert set(df["decoder"]) == set(LABELS)
    assert set(df["dataset"]) == {"mt_bench", "humaneval", "gsm8k", "all"}
    assert (df["prompts"][df["dataset"] != "all"] == 2).all() and (df["prompts"][df["dataset"] == "all"] == 6).all()
    # every decoder here is lossless (fp32, greedy): output identical to autoregressive on every prompt
    assert (df["same_as_autoregressive"] == 1.0).all(), df[["decoder", "dataset", "same_as_autoregressive"]]
    assert (df["lossless"] == 1.0).all() and (df["real_divergences"] == 0).all(), df[["decoder", "dataset", "lossless"]]
    ar = df[df["decoder"] == "autoregressive"]
    assert (ar["tokens_per_step"] == 1.0).all() and (ar["mean_accepted_tokens"] == 1.0).all()
    assert (ar[["speedup", "speedup_geomean", "speedup_pooled"]] == 1.0).all().all()
    assert (df["tokens_per_step"] >= 1.0).all() and (df["tokens_per_s"] > 0).all()
    assert set(df[df["dataset"] == "humaneval"]["quality_metric"]) == {"pass@1"}
    md = (out / "leaderboard.md").read_text()
    assert "verification cost on this device" in md and "Spec-Bench" in md and "bpd-ngram" in md
    assert "Where a decoding step's time goes" in md and "draft_in_ar_steps" in md
    assert (df["step_ms"] > 0).all() and (df["draft_ms"] >= 0).all()
    assert (ar["step_in_ar_steps"] == 1.0).all() and (ar["draft_in_ar_steps"] == 0.0).all()
    drafted = df[df["decoder"].isin(["eagle", "medusa", "spec_chain"])]
    assert (drafted["draft_ms"] > 0).all()
    parts = df["target_ms"] + df["draft_ms"] + df["other_ms"]
    assert ((parts - df["step_ms"]).abs() < 1e-9 * df["step_ms"]).all()
    assert "| greedy |" in md and "same_as_autoregressive" in md and "lossless_up_to_ties" in md
    assert "leaderboard | gsm8k" in result.stderr  # the progress bar


@pytest.mark.slow
def test_the_drift_check_keeps_the_references_own_step_on_each_prompt(board):
    """bench/drift.py's `during`: per dataset, the autoregressive entry's decoding step on each prompt
    timed, read off its records, and whether the slowest passes the bound over the fastest."""
    out, _ = board
    info = json.loads((out / "provenance.json").read_text())
    for ds in ("mt_bench", "humaneval", "gsm8k"):
        lines = (out / ds / "autoregressive" / "records.jsonl").read_text().splitlines()
        during = info["reference_step"][ds]["during"]
        steps = [drift.prompt_step_ms(json.loads(line)) for line in lines]  # records: times to the microsecond
        assert during["prompt_step_ms"] == pytest.approx(steps, abs=1e-3)
        assert len(during["prompt_step_ms"]) == 2 and during["drifted"] == (during["change"] > during["bound"])


@pytest.mark.slow
def test_auto_tuners_forecast_beside_measurement(board):
    out, _ = board
    tuning = pd.read_csv(out / "tuning.csv")
    assert {"lookahead-auto", "sequoia-auto", "medusa"} <= set(tuning["decoder"])
    assert tuning[tuning["decoder"] == "lookahead-auto"]["predicted_speedup"].gt(0).all()
    assert tuning[tuning["decoder"] == "medusa"]["expected_tokens"].ge(1).all()
    assert tuning["speedup"].gt(0).all() and tuning["mean_accepted_tokens"].ge(1).all()


@pytest.mark.slow
def test_results_break_down_by_category(board):
    """MT-Bench prompts carry a category; every record keeps it and the leaderboard breaks it down."""
    out, _ = board
    records = [json.loads(x) for x in (out / "mt_bench" / "medusa" / "records.jsonl").read_text().splitlines()]
    assert all(r["category"] for r in records)
    by = pd.read_csv(out / "leaderboard_by_category.csv")
    assert set(by["dataset"]) == {"mt_bench"} and set(by["decoder"]) == set(LABELS)
    assert set(by["category"]) == {r["category"] for r in records}
    assert by.groupby("decoder")["prompts"].sum().eq(2).all()


@pytest.mark.slow
@pytest.mark.parametrize("label", ["hf_assisted", "spec_chain", "specinfer", "sequoia", "sequoia-auto"])
def test_draft_flops_count_and_the_drafts_prompt_pass_is_its_prefill(board, label):
    """hf_assisted reported zero draft FLOPs; decode FLOPs counted the draft's pass over the prompt."""
    out, _ = board
    for r in map(json.loads, (out / "gsm8k" / label / "records.jsonl").read_text().splitlines()):
        assert r["draft_flops"] > 0 and 0 < r["decode_draft_flops"] < r["draft_flops"]
        assert sum(r["trace"]["draft_prefill_flops"]) == pytest.approx(r["draft_flops"] - r["decode_draft_flops"])
        assert sum(x > 0 for x in r["trace"]["draft_prefill_flops"]) == 1


@pytest.mark.slow
def test_sampling_leaderboard_says_so_and_does_not_call_equality_lossless(tmp_path):
    result = run_module("bench.leaderboard", *TINY, "leaderboard.limit=1",
                        "leaderboard.only=[autoregressive,spec_chain]",
                        "leaderboard.datasets=[gsm8k]", "gen.temperature=0.7", f"leaderboard.out_dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    df = pd.read_csv(tmp_path / "leaderboard.csv")
    assert "lossless" not in df and "lossless_up_to_ties" not in df and "same_as_autoregressive" in df
    md = (tmp_path / "leaderboard.md").read_text()
    assert "sampling (temperature 0.7" in md and "| greedy |" not in md and "not a test of losslessness" in md


@pytest.mark.slow
def test_plots_and_their_data_are_written(board):
    out, _ = board
    for name in ("speedup", "tokens_vs_flops", "acceptance_by_depth", "accepted_by_output_position"):
        assert (out / "plots" / f"{name}.png").stat().st_size > 1000
        assert len(pd.read_csv(out / "plots" / f"{name}.csv")) > 0
    points = pd.read_csv(out / "plots" / "tokens_vs_flops.csv")
    assert (points["source"] == "leaderboard").sum() == len(LABELS) * 3
    assert (points["source"] != "leaderboard").sum() == 24  # the fixture sweep's 24 lookahead (W, N) points
    acceptance = pd.read_csv(out / "plots" / "acceptance_by_depth.csv")
    assert {"spec_chain", "sequoia", "medusa", "bpd"} <= set(acceptance["decoder"])
    # every entry, by output position: autoregressive commits one token a step wherever it is
    by_position = pd.read_csv(out / "plots" / "accepted_by_output_position.csv")
    assert set(by_position["decoder"]) == set(LABELS)
    assert (by_position[by_position["decoder"] == "autoregressive"]["mean_accepted_tokens"] == 1.0).all()
    assert (by_position["mean_accepted_tokens"] >= 1.0).all() and (by_position["position"] % 8 == 0).all()
    cost = pd.read_csv(out / "verification_cost.csv")
    assert list(cost["tokens"]) == [1, 2, 4] and (cost["vs_one_token"] > 0).all()


@pytest.mark.slow
def test_every_entry_is_a_run_directory_that_report_reads(board):
    out, _ = board
    for label in LABELS:
        run = out / "gsm8k" / label
        assert (run / "config.yaml").is_file() and (run / "summary.csv").is_file()
        assert len((run / "records.jsonl").read_text().splitlines()) == 2
    result = run_module("bench.report", str(out / "humaneval"))
    assert result.returncode == 0 and "lookahead" in result.stdout


@pytest.mark.slow
def test_a_rerun_resumes_without_duplicates(board):
    out, _ = board
    victim = out / "humaneval" / "sequoia" / "records.jsonl"
    lines = victim.read_text().splitlines()
    # as if killed after the first prompt, and the second prompt's record of another entry pasted in
    # (such a record was once kept and tabled as sequoia's)
    foreign = (out / "humaneval" / "spec_chain" / "records.jsonl").read_text().splitlines()[1]
    victim.write_text(lines[0] + "\n" + foreign + "\n")
    before = {p: p.read_text() for p in out.rglob("records.jsonl") if p != victim}
    result = run_module("bench.leaderboard", *TINY, f"leaderboard.out_dir={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    again = victim.read_text().splitlines()
    assert len(again) == 2 and again[0] == lines[0]
    assert json.loads(again[1])["prompt_id"] == json.loads(lines[1])["prompt_id"]
    assert json.loads(again[1])["decoder"] == "sequoia"
    assert (victim.parent / "records.rejected.jsonl").read_text() == foreign + "\n"
    assert all(p.read_text() == text for p, text in before.items())  # finished runs untouched


@pytest.mark.slow
def test_a_rerun_with_other_settings_is_refused_and_changes_nothing(board):
    out, _ = board
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    result = run_module("bench.leaderboard", *TINY, "gen.max_new_tokens=12", f"leaderboard.out_dir={out}")
    assert result.returncode == 2
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "holds records made with other settings" in lines[0], result.stderr
    assert "gen.max_new_tokens: 10 then, 12 now" in lines[0]
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


@pytest.mark.slow
def test_a_rerun_by_other_code_is_refused_and_changes_nothing(board, tmp_path):
    """Each entry is a run directory with the same contract as a run's: records made by other code (or
    from other prompts, or other weights) are not continued. Here one entry's recorded commit differs
    and it lacks a prompt: the rerun is refused in one line, and nothing changes."""
    out, _ = board
    copy = tmp_path / "board"
    shutil.copytree(out, copy)
    entry = copy / "gsm8k" / "jacobi"
    identity = json.loads((entry / "identity.json").read_text())
    identity["code"] = {"commit": "0" * 40, "dirty": False, "changes_sha256": None}
    (entry / "identity.json").write_text(json.dumps(identity))
    lines = (entry / "records.jsonl").read_text().splitlines(keepends=True)
    (entry / "records.jsonl").write_text("".join(lines[:-1]))
    before = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    result = run_module("bench.leaderboard", *TINY, f"leaderboard.out_dir={copy}")
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert f"{entry} holds records made by code 000000000000; this is" in lines[0], lines[0]
    assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()} == before


@pytest.mark.slow
def test_a_smaller_limit_tables_only_its_prompts(board, tmp_path):
    out, _ = board
    copy = tmp_path / "board"
    shutil.copytree(out, copy)
    args = [a for a in TINY if not a.startswith("leaderboard.limit=")]
    result = run_module("bench.leaderboard", *args, "leaderboard.limit=1", f"leaderboard.out_dir={copy}")
    assert result.returncode == 0, result.stderr[-3000:]
    df = pd.read_csv(copy / "leaderboard.csv")
    assert (df["prompts"][df["dataset"] != "all"] == 1).all() and (df["prompts"][df["dataset"] == "all"] == 3).all()
    for p in copy.rglob("records.jsonl"):  # nothing re-run, nothing dropped
        assert p.read_text() == (out / p.relative_to(copy)).read_text()


@pytest.mark.slow
def test_show_renders_each_step(board):
    out, _ = board
    run = out / "humaneval" / "lookahead"
    record = json.loads((run / "records.jsonl").read_text().splitlines()[0])
    result = run_module("bench.show", str(run), "--prompt", record["prompt_id"], "--no-color")
    assert result.returncode == 0, result.stderr
    page = next((run / "show").glob("*.html")).read_text()
    assert page.count('class="step"') == len(record["trace"]["committed"]) == record["steps"]
    counts = [int(x.split('"')[0]) for x in page.split('data-tokens="')[1:]]
    assert counts == record["trace"]["committed"]
    import html
    import re
    texts = [html.unescape(m) for m in re.findall(r'<span class="step"[^>]*>(.*?)</span>', page, flags=re.S)]
    assert "".join(texts) == record["text"]
    assert "tokens per step" in page and record["decoder"] in page


@pytest.mark.slow
@pytest.mark.parametrize("args,message", [
    (["/no/such/run", "--prompt", "x"], "no run directory at /no/such/run"),
    (["{run}", "--prompt", "nope/1"], "no record for prompt 'nope/1' turn 0"),
    (["{empty}", "--prompt", "x"], "holds no records.jsonl"),
])
def test_show_errors_are_one_line(board, tmp_path, args, message):
    out, _ = board
    args = [a.format(run=out / "gsm8k" / "autoregressive", empty=tmp_path) for a in args]
    result = run_module("bench.show", *args)
    assert result.returncode == 2
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr


@pytest.mark.slow
def test_leaderboard_errors_are_one_line(tmp_path):
    result = run_module("bench.leaderboard", "model=tiny-random", "leaderboard.only=[nope]",
                        f"leaderboard.out_dir={tmp_path}")
    assert result.returncode == 2 and result.stderr.strip().startswith("error: leaderboard.only: unknown label")
    result = run_module("bench.leaderboard", "model=tiny-random", "leaderboard.only=[lookahead]",
                        f"leaderboard.out_dir={tmp_path}")
    assert result.returncode == 2 and "needs the autoregressive entry" in result.stderr
    # a draft file that is not there: refused before anything is claimed (it was after each entry's
    # config.yaml and an empty records.jsonl)
    board = tmp_path / "board"
    result = run_module("bench.leaderboard", "model=tiny-random", "leaderboard.only=[autoregressive,eagle]",
                        'leaderboard.decoders.eagle=["decoder=eagle","decoder.draft_weights=/no/such.safetensors"]',
                        "leaderboard.datasets=[gsm8k]", "leaderboard.limit=1", f"leaderboard.out_dir={board}")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "/no/such.safetensors" in lines[0], result.stderr[-2000:]
    assert not board.exists() or not any(board.iterdir())


# Each preset's entries, in its order (conf/preset/<name>.yaml), and its repeats.
PRESETS = {
    "speculative": (["autoregressive", "hf_assisted", "spec_chain-8", "specinfer-2x4", "sequoia-8", "sequoia-auto"], 1),
    "lookahead": (["autoregressive", "hf_pld", "prompt_lookup", "jacobi", "lookahead", "lookahead-w15n7",
                   "lookahead-auto"], 2),
    "heads": (["autoregressive", "medusa", "medusa-auto-32", "medusa-auto-64", "medusa-chain", "bpd-p1", "bpd-ngram-p1",
               "bpd-p4", "bpd-ngram-p4"], 1),
    "baselines": (["autoregressive", "hf_generate"], 3),
    "leaders": (["autoregressive", "eagle", "eagle-8", "eagle-auto", "eagle-static", "dflash", "dflash-chain",
                 "recycling", "suffix", "medusa", "lookahead-auto", "sequoia-auto", "hf_pld", "prompt_lookup"], 1),
    "long_outputs": (["autoregressive", "prompt_lookup", "lookahead", "recycling", "eagle", "medusa", "spec_chain",
                      "sequoia"], 1),
}
LIMITS = {"leaders": 5, "long_outputs": 6}  # prompts per dataset, where a preset's differs from 4
DATASETS = {"long_outputs": ["mt_bench"]}  # where a preset's differ from the three


def preset_overrides(name: str) -> list[str]:
    """tiny-random, one dataset, one prompt, 8 tokens; entries with heads or an EAGLE draft get
    untrained ones (the shipped ones are SmolLM2's), as the main board's TINY does."""
    tiny = ["model=tiny-random", "gen.max_new_tokens=8", "leaderboard.limit=1", "leaderboard.datasets=[gsm8k]",
            "draft.layers=1", "draft.adapter=null", "leaderboard.verification_tokens=[1,2]", "progress=false"]
    preset = OmegaConf.load(REPO / "conf" / "preset" / f"{name}.yaml").leaderboard
    entries = {**{name: [f"decoder={name}"] for name in decoder_configs()},  # every method's own entry
               **OmegaConf.load(REPO / "conf" / "leaderboard.yaml").leaderboard.decoders, **preset.get("decoders", {})}
    untrained = {"decoder=medusa": "decoder.heads=null", "decoder=bpd": "decoder.heads=null",
                 "decoder=eagle": "decoder.draft_weights=null", "decoder=dflash": "decoder.draft_weights=null"}
    for label in preset.only:
        extra = [untrained[o] for o in entries[label] if o in untrained]
        if extra:
            tiny.append(f"leaderboard.decoders.{label}=[{','.join(json.dumps(o) for o in [*entries[label], *extra])}]")
    return [f"+preset={name}", *tiny]


@pytest.mark.slow
def test_presets_write_to_their_own_directory_not_the_reference():
    from bench.leaderboard import compose_all

    assert compose_all(["model=tiny-random"])[1] == LABELS  # each method's own entry, its variants after it
    for name, (labels, repeats) in PRESETS.items():
        base, composed, runs = compose_all([f"+preset={name}", "model=tiny-random"])
        assert composed == labels and base.leaderboard.repeats == repeats
        assert base.leaderboard.out_dir == f"results/{name}"  # results/reference/<topic> only when asked for
        assert (base.leaderboard.limit == LIMITS.get(name, 4)
                and list(base.leaderboard.datasets) == DATASETS.get(name, ["humaneval", "mt_bench", "gsm8k"]))
    # the speculative preset's fixed-size methods get the same draft-node budget
    _, _, runs = compose_all(["+preset=speculative", "model=tiny-random"])
    chain, tree, seq = (runs["gsm8k", x].decoder for x in ("spec_chain-8", "specinfer-2x4", "sequoia-8"))
    assert chain.depth == tree.num_drafts * tree.depth == seq.budget == 8


def test_entries_take_each_datasets_node_as_composing_on_it_would_give():
    """compose_entries composes an entry on the first dataset and swaps in each other dataset's node;
    that gives every config a compose on that dataset gives, with a dataset key set for all
    (dataset.data_dir) and one entry's own (composed on each). The control: another dataset's."""
    from hydra import compose, initialize_config_dir

    from bench.leaderboard import CONF_DIR, compose_all

    overrides = ["model=tiny-random", "leaderboard.limit=3", "dataset.data_dir=/elsewhere",
                 'leaderboard.decoders.lookahead=["decoder=lookahead","dataset.limit=1"]']
    base, _, runs = compose_all(overrides)
    entries = base.leaderboard.decoders
    as_composed = lambda cfg: OmegaConf.to_container(cfg, resolve=True)  # noqa: E731
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for ds in ("humaneval", "gsm8k"):  # not the first: mt_bench's configs are composed
            for label in ("autoregressive", "eagle-static", "lookahead", "sequoia-auto"):
                expected = compose("leaderboard", overrides=[*overrides, f"dataset={ds}", "dataset.limit=3",
                                                             *entries[label]])
                expected.leaderboard.decoders = entries
                assert as_composed(runs[ds, label]) == as_composed(expected), (ds, label)
    assert runs["gsm8k", "lookahead"].dataset.limit == 1 and runs["gsm8k", "eagle"].dataset.limit == 3
    assert runs["gsm8k", "eagle"].dataset.data_dir == "/elsewhere"
    assert as_composed(runs["gsm8k", "eagle-static"]) != as_composed(runs["humaneval", "eagle-static"])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_tables_its_entries_with_provenance(name, tmp_path):
    labels, repeats = PRESETS[name]
    result = run_module("bench.leaderboard", *preset_overrides(name), f"leaderboard.out_dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    df = pd.read_csv(tmp_path / "leaderboard.csv")
    rows = df[df["dataset"] == "gsm8k"]
    assert list(rows["decoder"]) == labels  # the preset's entries, in its order
    assert (rows["prompts"] == 1).all() and (rows["runs"] == repeats).all()
    assert (df["lossless"] == 1.0).all(), df[["decoder", "lossless"]]  # fp32 greedy: every entry is lossless
    for column in ("speedup", "speedup_per_run_median", "speedup_per_run_p25", "speedup_per_run_p75"):
        assert (df[column] > 0).all(), column
    assert (df["speedup_per_run_p25"] <= df["speedup_per_run_p75"]).all()
    assert df["decode_overhead_frac"].between(0, 1).all()
    record = json.loads((tmp_path / "gsm8k" / labels[-1] / "records.jsonl").read_text().splitlines()[0])
    assert len(record["repeat_latency_s"]) == repeats and record["repeat_latency_s"][0] == record["latency_s"]
    info = json.loads((tmp_path / "provenance.json").read_text())
    assert {"git_commit", "git_dirty", "packages", "device", "dtype", "torch_threads"} <= set(info)
    assert f"+preset={name}" in info["leaderboard"]["overrides"] and info["leaderboard"]["labels"] == labels
    assert info["leaderboard"]["repeats"] == repeats
    assert set(info["reference_step"]) == {"gsm8k"} and info["reference_step"]["gsm8k"]["start_ms"] > 0
    assert info["reference_step"]["gsm8k"]["during"] is None  # one prompt: no spread between prompts
    assert (df["speedup_ci_low"] <= df["speedup"]).all() and (df["speedup"] <= df["speedup_ci_high"]).all()
    assert OmegaConf.load(tmp_path / "leaderboard.yaml").leaderboard.only == labels
    md = (tmp_path / "leaderboard.md").read_text()
    assert all(f"| {label} " in md for label in labels) and "speedup_per_run_p25" in md
    assert (f"x {repeats} runs each" in md) == (repeats > 1)


def test_repeats_pair_each_run_with_the_references_same_run():
    """board_row over repeats: speedup and its per-run spread pair run k with the reference's run k."""
    from bench.leaderboard_tables import board_row

    def record(key, latencies):
        return {"key": key, "status": "ok", "new_tokens": 10, "steps": 10, "latency_s": latencies[0],
                "repeat_latency_s": latencies, "target_flops": 1.0, "draft_flops": 0.0, "draft_tokens": 0,
                "accepted_draft_tokens": 0, "tokens": [1] * 10, "decode_tokens": 9, "decode_steps": 9,
                "decode_flops": 1.0, "decode_draft_flops": 0.0,
                "trace": {"overhead_time": [0.0] + [1.0] * 9, "target_time": [5.0] + [3.0] * 9,
                          "draft_time": [0.0] * 10}}

    reference = [record("a#0", [1.0, 2.0]), record("b#0", [1.0, 1.0])]
    mine = [record("a#0", [0.5, 2.0]), record("b#0", [0.5, 0.25])]
    row = board_row(mine, reference)
    assert row["runs"] == 4 and row["tokens_per_s"] == pytest.approx(40 / 3.25)
    # per-run ratios 2, 1, 2, 4; Spec-Bench's speedup: mean tokens/s (20+5+20+40)/4 over (10+5+10+10)/4
    assert row["speedup"] == pytest.approx(85 / 35)
    assert row["speedup_per_run_median"] == pytest.approx(2.0)
    assert (row["speedup_per_run_p25"], row["speedup_per_run_p75"]) == (pytest.approx(1.75), pytest.approx(2.5))
    assert row["decode_overhead_frac"] == pytest.approx(0.25)  # the prefill step (no overhead) left out
    # where a step's time goes, in ms and in the reference's steps (the same traces here: one step each)
    assert (row["step_ms"], row["target_ms"], row["draft_ms"], row["other_ms"]) == (4000.0, 3000.0, 0.0, 1000.0)
    assert (row["step_in_ar_steps"], row["target_in_ar_steps"], row["other_in_ar_steps"]) == (1.0, 0.75, 0.25)
    # its interval: within the most and least a resample can give (all of a's run 2: 1x; all of b's run 2: 4x)
    assert 1.0 <= row["speedup_ci_low"] < row["speedup"] < row["speedup_ci_high"] <= 4.0
    # records written before repeats existed: one run each, the same figures as before
    old = [{k: v for k, v in r.items() if k != "repeat_latency_s"} for r in mine]
    assert board_row(old, reference)["runs"] == 2


def test_ordering_marks_say_what_the_intervals_allow():
    """faster / slower / indistinct against autoregressive, and which entries of the same dataset
    the table cannot order (overlapping intervals); the reference and NaN intervals claim nothing."""
    import pandas as pd

    from bench.leaderboard_tables import ordering_marks

    nan = float("nan")
    df = pd.DataFrame({"decoder": ["autoregressive", "a", "b", "c", "d", "a"],
                       "dataset": ["x", "x", "x", "x", "x", "y"],
                       "speedup_ci_low": [1.0, 1.2, 1.3, 0.8, nan, 0.9],
                       "speedup_ci_high": [1.0, 1.5, 1.6, 0.95, nan, 1.1]})
    marked = ordering_marks(df)
    assert marked["vs_autoregressive"].tolist() == ["", "faster", "faster", "slower", "", "indistinct"]
    assert marked["overlaps"].tolist() == ["", "b", "a", "", "", ""]


@pytest.mark.slow
def test_repeats_must_be_a_positive_integer(tmp_path):
    result = run_module("bench.leaderboard", "model=tiny-random", "leaderboard.repeats=0",
                        f"leaderboard.out_dir={tmp_path}")
    assert (result.returncode == 2
            and result.stderr.strip() == "error: leaderboard.repeats must be an integer >= 1, got 0")


def test_a_departure_at_a_tie_is_no_loss_but_not_the_same_output():
    """same_as_autoregressive counts equal outputs; lossless is bench/metrics.py's check, ties excused."""
    from bench.leaderboard_tables import board_row

    def record(key, tokens, **verdict):
        return {"key": key, "status": "ok", "new_tokens": 3, "steps": 3, "latency_s": 1.0, "target_flops": 1.0,
                "draft_flops": 0.0, "draft_tokens": 0, "accepted_draft_tokens": 0, "tokens": tokens, **verdict}

    reference = [record("a#0", [1, 2, 3], lossless=True), record("b#0", [1, 2, 3], lossless=True),
                 record("c#0", [1, 2, 3], lossless=True)]
    mine = [record("a#0", [1, 2, 3], lossless=True), record("b#0", [1, 2, 4], lossless=False, divergence_tie=True),
            record("c#0", [1, 5, 3], lossless=False, divergence_tie=False)]
    row = board_row(mine, reference)
    assert row["same_as_autoregressive"] == pytest.approx(1 / 3)
    assert row["lossless"] == pytest.approx(1 / 3) and row["lossless_up_to_ties"] == pytest.approx(2 / 3)
    assert row["real_divergences"] == 1
    unjudged = [{k: v for k, v in r.items() if k not in ("lossless", "divergence_tie")} for r in mine]
    assert board_row(unjudged, reference)["real_divergences"] is None  # no verdicts: nothing claimed


@pytest.mark.slow
def test_leaderboard_records_carry_the_lossless_verdict(board):
    out, _ = board
    for r in map(json.loads, (out / "gsm8k" / "lookahead" / "records.jsonl").read_text().splitlines()):
        assert r["lossless"] is True and r["first_divergence"] is None and r["reference"] is None


@pytest.mark.slow
def test_timed_repeats_start_from_the_same_carried_state(tmp_path, monkeypatch):
    """Recycling's hot table (what a decoder carries between prompts) is, at the
    start of each timed repeat of a prompt, what it was at the start of the first; the next prompt
    starts from the table its predecessor's first run left; the warm-up leaves it as it was (empty).
    On the old code repeats 2-3 drafted from a table holding the prompt's own continuation."""
    from bench import leaderboard, leaderboard_run
    from decoders.methods.recycling import Recycling

    starts = []
    generate = Recycling.generate

    def logged(self, lm, prompt_ids, *args):
        starts.append((list(prompt_ids), {k: list(v) for k, v in self.carried(lm).items()}))
        return generate(self, lm, prompt_ids, *args)

    monkeypatch.setattr(Recycling, "generate", logged)
    _, labels, runs = leaderboard.compose_all(
        ["model=tiny-random", "leaderboard.only=[autoregressive,recycling]", "leaderboard.datasets=[gsm8k]",
         "leaderboard.limit=2", "leaderboard.repeats=3", "gen.max_new_tokens=12", "quality=false", "progress=false"])
    leaderboard_run.run_dataset("gsm8k", labels, runs, tmp_path, {}, repeats=3)
    warm, *timed = starts
    assert warm[1] == {} and len(timed) == 6  # the warm-up, then 2 prompts x 3 repeats
    first, second = timed[:3], timed[3:]
    assert first[0][1] == {} and all(s == first[0] for s in first)  # every repeat: the table as at the first run
    assert second[0][1] and all(s == second[0] for s in second)
    assert set(second[0][1]) > set(first[0][1])  # and the second prompt drafts from what the first one's run left
