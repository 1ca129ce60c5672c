"""`python -m bench` as a user runs it: outputs, overrides, errors, resume after SIGKILL."""
import json
import os
import signal

import pandas as pd
import pytest

from bench import drift
from helpers import CACHE_DIR, run_cli, run_python, start_cli, wait_for_records

TINY = ["model=tiny-random", "device=cpu", "gen.max_new_tokens=8"]


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_run_writes_the_run_directory(tmp_path):
    out = run_cli(*TINY, "dataset.limit=3", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    for name in ["config.yaml", "records.jsonl", "summary.csv", "summary.md", "provenance.json"]:
        assert (tmp_path / name).is_file(), name
    recs = records(tmp_path)
    assert [r["prompt_id"] for r in recs] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert all(r["status"] == "ok" and r["new_tokens"] == len(r["tokens"]) == 8 for r in recs)
    assert all(r["steps"] == 8 and len(r["trace"]["committed"]) == 8 for r in recs)
    assert all(r["rendering"] == "chat" and r["quality"]["passed"] in (True, False) for r in recs)
    summary = pd.read_csv(tmp_path / "summary.csv")
    assert summary.loc[0, "records"] == 3 and summary.loc[0, "tokens_per_step"] == 1.0
    assert summary.loc[0, "quality_metric"] == "pass@1"
    prov = json.loads((tmp_path / "provenance.json").read_text())
    assert prov["dtype"] == "float32" and prov["device"] == "cpu" and prov["torch_threads"] >= 1
    assert prov["packages"]["transformers"].startswith("5.") and "git_commit" in prov
    step = prov["reference_step"]  # the machine's speed before and after the timed prompts (bench/drift.py)
    assert step["start_ms"] > 0 and step["end_ms"] > 0 and step["drifted"] == (abs(step["change"]) > step["bound"])
    # the ending: a few lines, no check_lossless so no speedup, and where the files went
    assert "tokens per step  1.00" in out.stdout and "speedup          n/a" in out.stdout, out.stdout
    assert f"{tmp_path}: summary.md" in out.stdout and len(out.stdout.strip().splitlines()) <= 10
    assert "tok_s=" in out.stderr and "tok_per_step=" in out.stderr and "3/3" in out.stderr  # live progress


@pytest.mark.slow
def test_sampling_overrides_are_applied_and_seeded(tmp_path):
    args = [*TINY, "decoder=hf_generate", "dataset=mt_bench", "dataset.limit=2", "gen.temperature=0.8",
            "gen.top_p=0.9", "gen.top_k=50"]
    a, b, c = (run_cli(*args, f"seed={s}", f"hydra.run.dir={tmp_path / d}") for s, d in [(3, "a"), (3, "b"), (4, "c")])
    assert a.returncode == b.returncode == c.returncode == 0, a.stderr + c.stderr
    ra, rb, rc = records(tmp_path / "a"), records(tmp_path / "b"), records(tmp_path / "c")
    assert [(r["prompt_id"], r["turn"]) for r in ra] == [("81", 0), ("81", 1), ("82", 0), ("82", 1)]
    assert [r["tokens"] for r in ra] == [r["tokens"] for r in rb]  # same seed, same samples
    assert [r["tokens"] for r in ra] != [r["tokens"] for r in rc]
    config = (tmp_path / "a" / "config.yaml").read_text()
    assert "temperature: 0.8" in config and "top_p: 0.9" in config and "top_k: 50" in config
    # Turn 2 is asked after the model's own first answer.
    assert ra[0]["text"] in ra[1]["prompt_text"]


@pytest.mark.slow
def test_check_lossless_records_identity_and_same_process_speedup(tmp_path):
    out = run_cli(*TINY, "decoder=hf_pld", "dataset=gsm8k", "dataset.limit=2", "check_lossless=true",
                  f"hydra.run.dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    recs = records(tmp_path)
    assert all(r["lossless"] is True and r["first_divergence"] is None for r in recs)
    assert all(r["reference"]["decoder"] == "autoregressive" and r["reference"]["latency_s"] > 0 for r in recs)
    # the drift check keeps the reference's own step on each prompt (bench/drift.py: during)
    during = json.loads((tmp_path / "provenance.json").read_text())["reference_step"]["during"]
    # (records keep times to the microsecond, so each step to about 1e-3 ms)
    assert during["prompt_step_ms"] == pytest.approx([drift.prompt_step_ms(r["reference"]) for r in recs], abs=1e-3)
    summary = pd.read_csv(tmp_path / "summary.csv")
    assert summary.loc[0, "lossless"] == summary.loc[0, "lossless_up_to_ties"] == 1.0
    assert summary.loc[0, "real_divergences"] == 0
    assert summary.loc[0, "speedup"] > 0 and summary.loc[0, "speedup_geomean"] > 0
    assert summary.loc[0, "quality_metric"] == "accuracy"
    # the run ends with the comparison, its figures those of the records and summary.csv
    tokens_per_step = sum(r["new_tokens"] for r in recs) / sum(r["steps"] for r in recs)
    mine = sum(r["new_tokens"] / r["latency_s"] for r in recs) / 2
    ref = sum(r["reference"]["new_tokens"] / r["reference"]["latency_s"] for r in recs) / 2
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "hf_pld vs autoregressive: tiny-random, gsm8k, 2 prompts", out.stdout
    assert lines[1] == f"  tokens per step  {tokens_per_step:.2f} vs 1.00"
    assert lines[2].startswith(f"  speedup          {summary.loc[0, 'speedup']:.2f}x (95% CI "
                               f"{summary.loc[0, 'speedup_ci_low']:.2f}-{summary.loc[0, 'speedup_ci_high']:.2f} "
                               f"over prompts): {mine:.1f} vs {ref:.1f} tokens/s")
    assert lines[3] == "  lossless         2/2 identical to autoregressive greedy"
    assert lines[4] == f"  quality          accuracy {summary.loc[0, 'quality']:.3f} (2 scored)"
    assert lines[5] == f"  files            {tmp_path}: summary.md (every figure), records.jsonl (per prompt)"
    assert len(lines) == 6


def test_ending_says_how_many_departures_were_ties(tmp_path):
    from bench.ending import comparison

    def record(key, lossless, tie=None, real=None):
        return {"key": key, "decoder": "eagle", "model": "m", "dataset": "d", "status": "ok", "new_tokens": 4,
                "steps": 2, "latency_s": 1.0, "reference": {"new_tokens": 4, "steps": 4, "latency_s": 2.0},
                "lossless": lossless, "divergence_tie": tie, "first_real_divergence": real,
                "quality_metric": None, "quality_score": None, "decoder_lossless": True}

    records = [record("a#0", True), record("b#0", False, tie=True), record("c#0", False, tie=False, real=3),
               {"key": "d#0", "status": "skipped"}]
    text = comparison(records, tmp_path)
    assert "eagle vs autoregressive: m, d, 3 prompts (1 skipped)" in text
    assert "tokens per step  2.00 vs 1.00" in text
    assert "speedup          2.00x (95% CI 2.00-2.00 over prompts): 4.0 vs 2.0 tokens/s" in text
    assert ("lossless         1/3 identical to autoregressive greedy; 2/3 up to ties (1 departs only at ties, "
            "within 4 ulps); 1 real divergence (first: c#0 at token 3)") in text, text
    assert "quality" not in text


@pytest.mark.slow
@pytest.mark.parametrize("decoder,draft", [("spec_chain", ["draft=tiny-random", "draft.seed=1"]),
                                           ("sequoia", ["model.num_layers=3", "draft.layers=1", "draft.adapter=null"]),
                                           ("medusa", ["decoder.heads=null"]),
                                           ("eagle", ["decoder.draft_weights=null", "decoder.draft_seed=1"]),
                                           ("bpd", ["decoder.heads=null", "decoder.rescore=ngram", "decoder.paths=2"]),
                                           ("bpd", ["decoder.heads=null", "decoder.rescore=neural", "draft.layers=1",
                                                    "draft.adapter=null"])])
def test_draft_decoders_run_lossless(tmp_path, decoder, draft):
    """A model config as the draft (another tiny-random: same tokenizer), or a self-draft."""
    out = run_cli(*TINY, f"decoder={decoder}", *draft, "dataset=gsm8k", "dataset.limit=2", "check_lossless=true",
                  f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 0, out.stderr
    summary = pd.read_csv(tmp_path / "run" / "summary.csv")
    assert summary.loc[0, "lossless"] == 1.0 and summary.loc[0, "draft_flops_per_token"] > 0
    assert all(r["depth_proposed"] for r in records(tmp_path / "run"))
    assert all(r["decoder_lossless"] is True for r in records(tmp_path / "run"))


@pytest.mark.slow
def test_typical_acceptance_is_flagged_lossy_in_records(tmp_path):
    out = run_cli(*TINY, "decoder=medusa", "decoder.heads=null", "decoder.accept_rule=typical", "dataset=gsm8k",
                  "dataset.limit=1", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    assert [r["decoder_lossless"] for r in records(tmp_path)] == [False]
    assert pd.read_csv(tmp_path / "summary.csv").loc[0, "decoder_lossless"] == False  # noqa: E712


@pytest.mark.slow
def test_default_model_end_to_end(tmp_path):
    """The main job on the embedded default: SmolLM2 on HumanEval, checked lossless."""
    out = run_cli("dataset.limit=2", "gen.max_new_tokens=24", "check_lossless=true", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    summary = pd.read_csv(tmp_path / "summary.csv")
    row = summary.iloc[0]
    assert (row["decoder"], row["model"], row["dataset"]) == ("autoregressive", "smollm2-135m", "humaneval")
    assert row["records"] == 2 and row["lossless"] == 1.0 and row["tokens_per_step"] == 1.0
    assert all(r["text"].strip() for r in records(tmp_path))  # real text from a real model
    from bench.models import GGUFPackageModel  # Spec-Bench's count of a baseline's tokens, kept per record
    tokenizer = GGUFPackageModel().load_tokenizer()
    assert [r["speed_py_tokens"] for r in records(tmp_path)] == [
        len(tokenizer(r["text"].strip()).input_ids) - 1 for r in records(tmp_path)]


@pytest.mark.slow
@pytest.mark.parametrize("batch", [[], ["decoder=lookahead", "gen.batch_size=2"]], ids=["one", "batched"])
def test_a_prompt_cut_by_the_context_runs_and_only_an_overlong_one_is_skipped(tmp_path, batch):
    """As in Spec-Bench, a generation that reaches the context stops there
    (stop_reason "context") and its prompt is not skipped; only a prompt that fills the context by
    itself is, with its reason."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in [
        {"id": "short", "prompt": "Say hi."},
        {"id": "near", "prompt": "word " * 180},
        {"id": "long", "prompt": ["word " * 400, "and then?"]},
    ]) + "\n")
    out = run_cli(*TINY, "gen.max_new_tokens=128", *batch, "dataset=jsonl", f"dataset.path={prompts}",
                  "model.max_context=256", f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 0, out.stderr
    by_key = {r["key"]: r for r in records(tmp_path / "run")}
    assert by_key["short#0"]["status"] == "ok" and by_key["short#0"]["stop_reason"] != "context"
    near = by_key["near#0"]
    assert near["status"] == "ok" and 128 + near["prompt_tokens"] > 256  # it would not fit whole
    assert near["stop_reason"] == "context" and near["new_tokens"] == 256 - near["prompt_tokens"]
    assert (by_key["long#0"]["status"] == "skipped"
            and "leaves no room in the model's context of 256" in by_key["long#0"]["reason"])
    assert by_key["long#1"]["status"] == "skipped" and "earlier turn" in by_key["long#1"]["reason"]
    summary = pd.read_csv(tmp_path / "run" / "summary.csv")
    assert summary.loc[0, "records"] == 2 and summary.loc[0, "skipped"] == 2


@pytest.mark.slow
def test_show_prints_the_prompt_ids_a_run_fed_the_model(tmp_path, capsys):
    """bench.show --prompt-ids prints the exact prompt text and ids of a turn; they
    are the ones the run fed the model: greedy decoding from them gives the record's tokens again."""
    from omegaconf import OmegaConf

    from bench import show
    from bench.runner import build
    from decoders.core.sampling import Sampling
    from decoders.methods.autoregressive import autoregressive_decode

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "two", "prompt": ["Say hi.", "And again?"]}) + "\n")
    run = tmp_path / "run"
    out = run_cli(*TINY, "dataset=jsonl", f"dataset.path={prompts}", f"hydra.run.dir={run}")
    assert out.returncode == 0, out.stderr
    record = {r["key"]: r for r in records(run)}["two#1"]
    capsys.readouterr()
    show.main([str(run), "--prompt", "two", "--turn", "1", "--prompt-ids"])
    printed = capsys.readouterr().out
    assert f"\n{record['prompt_text']}\n" in printed and "chat rendering" in printed
    ids = json.loads(printed.rsplit("ids: ", 1)[1])
    assert len(ids) == record["prompt_tokens"]
    lm = build(OmegaConf.load(run / "config.yaml").model, "model").load()
    assert autoregressive_decode(lm, ids, 8, Sampling(), lm.stop_ids).tokens == record["tokens"]


ERRORS = [
    (["decoder=nope"],
     "unknown decoder 'nope'; choose one of: autoregressive, bpd, dflash, eagle, hf_assisted, hf_generate, hf_pld"),
    (["model=nope"], "unknown model 'nope'"),
    (["dataset=nope"], "unknown dataset 'nope'"),
    (["gen.max_new_tokens=0"], "gen.max_new_tokens must be an integer >= 1"),
    (["gen.temperature=inf"], "gen.temperature must be a finite number, got inf"),
    (["gen.top_p=nan"], "gen.top_p must be a finite number, got nan"),
    (["seed=abc"], "seed must be an integer, got 'abc'"),
    (["model.fast_path=fast"], "model.fast_path='fast' is not allowed; use auto, none, prepacked"),
    (["model.compile=max"], "model.compile='max' is not allowed; use auto, none, inductor"),
    (["gen.temperature=-1"], "gen.temperature must be 0 (greedy) or at least 1e-06, got -1.0"),
    (["gen.top_p=1.5"], "gen.top_p must be in (0, 1]"),
    (["decoder=hf_pld", "decoder.num_tokens=0"], "decoder.num_tokens must be an integer >= 1"),
    (["-m", "decoder=hf_pld", "decoder.num_tokens=4,0"], "decoder.num_tokens must be an integer >= 1"),
    (["gen.nope=1"], "gen.nope"),
    (["check_lossless=true", "gen.temperature=0.7"], "check_lossless=true compares against autoregressive greedy"),
    (["threads=0"], "threads must be a positive integer"),
    (["dataset=jsonl"], "dataset=jsonl needs dataset.path=FILE"),
    (["dataset=gsm8k", "dataset.path=/no/such/dir"], "dataset.path=/no/such/dir does not exist"),
    (["model=codellama-7b", "model.path=/no/such/model"], "no directory at model.path=/no/such/model"),
    (["dataset.limit=0"], "dataset.limit must be a positive integer"),
    (["decoder=lookahead", "decoder.window=0"], "decoder.window must be an integer >= 1 or auto, got 0"),
    (["-m", "decoder=lookahead", "decoder.window=3,0"], "decoder.window must be an integer >= 1"),
    (["decoder=lookahead", "decoder.ngram=1"], "decoder.ngram must be an integer >= 2"),
    (["decoder=lookahead", "decoder.guess_set_size=-2"], "decoder.guess_set_size must be an integer >= 0"),
    (["decoder=lookahead", "decoder.init=zeros"], "decoder.init must be one of prompt, vocab, repeat"),
    (["decoder=lookahead", "decoder.window=auto", "decoder.auto_windows=[2,0]"], "decoder.auto_windows[] must be"),
    (["decoder=jacobi", "decoder.block_size=0"], "decoder.block_size must be an integer >= 1"),
    (["decoder=spec_chain", "decoder.depth=0"], "decoder.depth must be an integer >= 1, got 0"),
    (["decoder=spec_chain", "draft=nope"], "unknown draft 'nope'; choose one of: "),
    (["decoder=spec_chain", "draft.layers=0"], "draft.layers must be an integer >= 1, got 0"),
    (["decoder=specinfer", "decoder.depth=0"], "decoder.depth must be an integer >= 1, got 0"),
    (["decoder=sequoia", "decoder.tree=big"], "decoder.tree must be one of fixed, auto, got 'big'"),
    (["decoder=sequoia", "decoder.acceptance_file=/no/such.json"],
     "decoder.acceptance_file: no acceptance vector at /no/such.json"),
    (["decoder=hf_assisted", "decoder.num_assistant_tokens=0"], "decoder.num_assistant_tokens must be an integer >= 1"),
    (["decoder=spec_chain", "model.num_layers=3", "draft.layers=2",
      "draft.adapter=adapters/smollm2-135m-self4.safetensors"],
     "smollm2-135m-self4.safetensors was trained for 4 layers and hidden size 576"),
    (["decoder=spec_chain", "draft=tiny-random", "draft.vocab_size=100"],
     "draft: draft tiny-random's head covers 100 ids"),
    (["decoder=spec_chain", "draft.layers=2"], "draft: draft.layers must be an integer in [1, 1] for a 2-layer target"),
    (["decoder=medusa", "decoder.heads=adapters/smollm2-135m-heads4.safetensors"],
     "was trained for hidden size 576; tiny-random has 64"),
    (["decoder=medusa", "decoder.heads=/no/such.safetensors"], "decoder.heads: no heads file at /no/such.safetensors"),
    (["decoder=medusa", "decoder.choices=wide"],
     "decoder.choices must be auto, chain, prior, a tree its authors published (mc_sim_7b_63) or a list of rank paths"),
    (["decoder=medusa", "decoder.choices=[[0],[1,1]]"], "decoder.choices: path [1, 1] has no parent path [1]"),
    (["decoder=medusa", "decoder.accept_rule=loose"], "decoder.accept_rule must be one of exact, typical"),
    (["decoder=eagle", "decoder.draft_weights=adapters/smollm2-135m-eagle.safetensors"],
     "smollm2-135m-eagle.safetensors was trained for hidden size 576; tiny-random has 64"),
    (["decoder=dflash", "decoder.draft_weights=adapters/smollm2-135m-dflash.safetensors"],
     "smollm2-135m-dflash.safetensors was trained for hidden size 576; tiny-random has 64"),
    (["decoder=eagle", "decoder.draft_weights=/no/such.safetensors"],
     "decoder.draft_weights: no EAGLE draft file at /no/such.safetensors"),
    (["decoder=eagle", "+decoder.head=null"],
     "decoder.head is now decoder.draft_weights; use decoder.draft_weights=null"),
    (["decoder=eagle", "decoder.head_seed=1"], "decoder.head_seed is now decoder.draft_seed; use decoder.draft_seed=1"),
    (["decoder=eagle", "decoder.tree=wide"],
     "decoder.tree must be dynamic, static, a tree its authors published (mc_sim_7b_63) or a list of rank paths, "
     "got 'wide'"),
    (["decoder=eagle", "decoder.tree=[[0],[1,1]]"], "decoder.tree: path [1, 1] has no parent path [1]"),
    (["decoder=eagle", "decoder.top_k=0"], "decoder.top_k must be an integer >= 1, got 0"),
    (["decoder=eagle", "decoder.draft_weights=adapters/smollm2-135m-heads4.safetensors"],
     "is not an EAGLE draft file (format 'medusa-heads-v1')"),
    (["decoder=bpd", "decoder.rescore=lm"], "decoder.rescore must be one of none, ngram, neural, got 'lm'"),
    (["decoder=bpd", "decoder.paths=0"], "decoder.paths must be an integer >= 1, got 0"),
    (["decoder=bpd", "decoder.rescore=ngram", "decoder.ngram=/no/such.json.gz"],
     "decoder.ngram: no n-gram LM at /no/such.json.gz"),
    (["decoder=bpd", "decoder.heads=null", "decoder.block=9"],
     "decoder.block=9 needs as many heads; these heads have 4"),
    # Settings that skipped every prompt, failed every program or crashed at scoring
    (["model.max_context=-1"], "model: model.max_context must be a positive integer or null (the model's own "
                               "context), got -1"),
    (["model.max_context=0"], "model: model.max_context must be a positive integer or null"),
    (["dataset.timeout=-5"], "dataset: dataset.timeout must be a finite number of seconds > 0, at most 86400 "
                             "(a day), got -5"),
    (["dataset.timeout=nan"], "dataset: dataset.timeout must be a finite number of seconds > 0, at most 86400 "
                              "(a day), got nan"),
    (["dataset.timeout=inf"], "dataset: dataset.timeout must be a finite number of seconds > 0"),
    (["dataset.timeout=1e300"], "dataset: dataset.timeout must be a finite number of seconds > 0, at most 86400 "
                                "(a day), got 1e+300"),
]


@pytest.mark.slow
@pytest.mark.parametrize("overrides,message", ERRORS, ids=[" ".join(o) for o, _ in ERRORS])
def test_bad_input_is_one_line_and_exit_2(tmp_path, overrides, message):
    run = tmp_path / "run"
    out = run_cli(*TINY, *overrides, f"hydra.run.dir={run}", f"hydra.sweep.dir={run}")
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("error: ") and message in lines[0], lines[0]
    assert "Traceback" not in out.stderr + out.stdout
    # refused before the run claimed its directory (Hydra may have made it, for its log)
    assert {p.name for p in run.glob("*")} <= {"__main__.log"}, sorted(p.name for p in run.rglob("*"))


@pytest.mark.slow
def test_missing_data_names_where_it_looked(tmp_path):
    env = dict(os.environ, BENCH_DATA_DIR=str(tmp_path), BENCH_CACHE_DIR=CACHE_DIR, HF_HUB_OFFLINE="1")
    out = run_python("-m", "bench", *TINY, "dataset=mt_bench", f"hydra.run.dir={tmp_path / 'r'}", env=env, timeout=300)
    assert out.returncode == 2
    line = out.stderr.strip()
    assert "\n" not in line and "no MT-Bench data" in line
    assert str(tmp_path / "mt_bench" / "question.jsonl") in line and "lighteval/mt-bench" in line
    assert "dataset.path=" in line and "BENCH_DATA_DIR" in line


@pytest.mark.slow
def test_existing_run_needs_resume_and_resume_needs_same_config(tmp_path):
    assert run_cli(*TINY, "dataset.limit=1", f"hydra.run.dir={tmp_path}").returncode == 0
    again = run_cli(*TINY, "dataset.limit=1", f"hydra.run.dir={tmp_path}")
    assert again.returncode == 2 and "pass resume=true" in again.stderr
    other = run_cli(*TINY, "dataset.limit=1", "gen.max_new_tokens=9", "resume=true", f"hydra.run.dir={tmp_path}")
    assert other.returncode == 2 and "gen.max_new_tokens: 8 then, 9 now" in other.stderr
    same = run_cli(*TINY, "dataset.limit=1", "resume=true", f"hydra.run.dir={tmp_path}")
    assert same.returncode == 0 and len(records(tmp_path)) == 1


@pytest.mark.slow
def test_sigkill_then_resume_gives_every_record_exactly_once(tmp_path):
    args = ["model=tiny-random", "gen.max_new_tokens=48", "dataset.limit=14", f"hydra.run.dir={tmp_path}"]
    proc = start_cli(*args)
    path = tmp_path / "records.jsonl"
    wait_for_records(path, 3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_at_kill = path.read_text().count("\n")
    assert 3 <= done_at_kill < 14, "the kill must land mid-run for this test to mean anything"
    with open(path, "a") as f:  # and as if it died mid-write
        f.write('{"key": "HumanEval/13#0", "status": "o')
    out = run_cli(*args, "resume=true")
    assert out.returncode == 0, out.stderr
    recs = records(tmp_path)
    keys = [r["key"] for r in recs]
    assert sorted(keys) == sorted(f"HumanEval/{i}#0" for i in range(14)) and len(set(keys)) == 14
    assert pd.read_csv(tmp_path / "summary.csv").loc[0, "records"] == 14


@pytest.mark.slow
def test_multirun_sweep_and_report(tmp_path):
    out = run_cli("-m", *TINY, "decoder=autoregressive,hf_pld", "dataset.limit=2", f"hydra.sweep.dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    runs = sorted(p.parent.name for p in tmp_path.rglob("summary.csv"))
    assert runs == ["dataset.limit=2,decoder=autoregressive,device=cpu,gen.max_new_tokens=8,model=tiny-random",
                    "dataset.limit=2,decoder=hf_pld,device=cpu,gen.max_new_tokens=8,model=tiny-random"]
    report = run_python("-m", "bench.report", tmp_path, "--out", tmp_path / "rep")
    assert report.returncode == 0, report.stderr
    table = pd.read_csv(tmp_path / "rep" / "report.csv")
    assert sorted(table["decoder"]) == ["autoregressive", "hf_pld"] and (table["records"] == 2).all()
    assert "decoder.name" in table.columns  # the swept parameter is a column


@pytest.mark.slow
def test_wandb_offline_logging(tmp_path):
    out = run_cli(*TINY, "dataset.limit=2", "logger=wandb", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    offline_runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 1 and any(offline_runs[0].glob("*.wandb"))


@pytest.mark.slow
def test_hydra_flags_pass_through():
    shown = run_cli("--cfg", "job", "model=tiny-random", "decoder=hf_pld")
    assert shown.returncode == 0, shown.stderr
    assert "_target_: decoders.methods.hf_peers.HFPromptLookup" in shown.stdout and "name: tiny-random" in shown.stdout
    helped = run_cli("--help")
    assert (helped.returncode == 0
            and "decoder: autoregressive, bpd, dflash, eagle, hf_assisted, hf_generate, hf_pld" in helped.stdout)
