"""Spec-Bench: its questions (dataset=spec_bench), its protocol (+preset=spec_bench:
every turn, 3 repeats, 1024 tokens, greedy, batch 1, dtype auto), its table (spec_bench.csv/.md,
checked against a computation written the way Spec-Bench's evaluation/speed.py does it), the
model configs of the field's standard pairs (published drafts, pinned revisions) and the revision
reaching from_pretrained and provenance."""
from __future__ import annotations

import json
import math
import re
from collections import Counter

import numpy as np
import pandas as pd
import pytest
import torch

from bench.datasets import SPEC_BENCH_GROUPS, SpecBench
from bench.errors import BenchError
from helpers import CACHE_DIR, DATA_DIR

SPEC_BENCH = DATA_DIR / "spec_bench" / "question.jsonl"
MT_BENCH = SPEC_BENCH_GROUPS["MT-Bench"]


# ---- dataset=spec_bench --------------------------------------------------------------------

@pytest.mark.parametrize("source", ["data_dir", "file", "directory"])
def test_spec_bench_questions_from_every_local_source(source):
    kwargs = {"data_dir": {"data_dir": str(DATA_DIR)}, "file": {"path": str(SPEC_BENCH)},
              "directory": {"path": str(SPEC_BENCH.parent)}}[source]
    prompts = SpecBench(**kwargs).load()
    assert len(prompts) == 480 and len({p.id for p in prompts}) == 480
    counts = Counter(p.meta["category"] for p in prompts)
    assert len(counts) == 13 and all(counts[c] == 10 for c in MT_BENCH)
    assert all(counts[c] == 80 for c in ("translation", "summarization", "qa", "math_reasoning", "rag"))
    # MT-Bench's 80 questions keep their second turn; every other question has one
    assert all(len(p.turns) == (2 if p.meta["category"] in MT_BENCH else 1) for p in prompts)
    assert prompts[0].id == "81" and prompts[0].turns == prompts[0].raw_turns
    assert [p.id for p in SpecBench(path=str(SPEC_BENCH), limit=3).load()] == ["81", "82", "83"]


def test_spec_bench_config_reads_bench_data_dir(monkeypatch):
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from bench.__main__ import CONF_DIR

    monkeypatch.setenv("BENCH_DATA_DIR", str(DATA_DIR))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["dataset=spec_bench", "dataset.limit=2"])
    prompts = instantiate(cfg.dataset).load()
    assert [p.meta["category"] for p in prompts] == ["writing", "writing"]


def test_spec_bench_missing_or_malformed_is_one_line(tmp_path, monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):  # as the hub fails here, without its retries' wait
        raise huggingface_hub.errors.LocalEntryNotFoundError("offline")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(BenchError, match=r"no Spec-Bench data: looked in dataset.path \(unset\), "
                                         r".*spec_bench/question.jsonl \(missing\), the HF hub's org/none"):
        SpecBench(data_dir=str(tmp_path), hub_id="org/none").load()  # the hub is tried last, and named
    bad = tmp_path / "question.jsonl"
    bad.write_text(json.dumps({"question_id": 1, "turns": ["hi"]}) + "\n")
    with pytest.raises(BenchError, match=r"question.jsonl:1: field 'category' is missing"):
        SpecBench(path=str(bad)).load()
    bad.write_text("".join(json.dumps({"question_id": 1, "category": "qa", "turns": ["hi"]}) + "\n" for _ in range(2)))
    with pytest.raises(BenchError, match="question.jsonl:2: field 'question_id' repeats id '1'"):
        SpecBench(path=str(bad)).load()


# ---- the table, against Spec-Bench's own computation ------------------------------------------

def _record(qid, category, turn, tokens, latencies, accept_lengths):
    """A leaderboard record: the prefill step commits 1 token, then one step per accept length."""
    assert sum(accept_lengths) + 1 == tokens
    return {"key": f"{qid}#{turn}", "prompt_id": qid, "turn": turn, "category": category, "status": "ok",
            "new_tokens": tokens, "latency_s": latencies[0], "repeat_latency_s": latencies,
            "decode_tokens": tokens - 1, "decode_steps": len(accept_lengths), "accept_lengths": accept_lengths}


def _speed_py(records, reference, categories, runs):
    """Spec-Bench's evaluation/speed.py, written out: per run, a question's tokens / seconds summed
    over its turns (the method's tokens its new_tokens, the baseline's its answers' text encoded
    again less one: speed_py_tokens), the mean of those over the reference's mean; mean and std
    (ddof 1) over runs; mean accepted tokens: the mean of every step's accept length."""
    def speeds(recs, k, count):
        by_q = {}
        for r in recs:
            if r["category"] in categories:
                tokens, seconds = by_q.get(r["prompt_id"], (0, 0.0))
                by_q[r["prompt_id"]] = (tokens + r[count], seconds + r["repeat_latency_s"][k])
        return [t / s for t, s in by_q.values()]

    ratios = [np.mean(speeds(records, k, "new_tokens")) / np.mean(speeds(reference, k, "speed_py_tokens"))
              for k in range(runs)]
    steps = [a for r in records if r["category"] in categories for a in r["accept_lengths"]]
    return np.mean(ratios), np.std(ratios, ddof=1), np.mean(steps)


def test_spec_bench_table_matches_speed_py():
    from bench import spec_bench_table

    rng = np.random.default_rng(0)
    fast, ref = [], []
    for qid, category in [("81", "writing"), ("101", "coding"), ("161", "translation"), ("162", "translation"),
                          ("481", "rag"), ("999", "custom")]:
        for turn in range(2 if category in MT_BENCH else 1):
            lengths = [int(x) for x in rng.integers(1, 5, size=int(rng.integers(2, 6)))]
            fast.append(_record(qid, category, turn, sum(lengths) + 1, list(rng.uniform(0.5, 2.0, 3)), lengths))
            ar_tokens = sum(lengths) + 1  # lossless: the same tokens, one per step
            ref.append(_record(qid, category, turn, ar_tokens, list(rng.uniform(1.0, 4.0, 3)), [1] * (ar_tokens - 1)))
            ref[-1]["speed_py_tokens"] = ar_tokens - int(rng.integers(1, 3))  # the EOS, a merge: text != ids
    records = {("spec_bench", "autoregressive"): ref, ("spec_bench", "fast"): fast}
    df = spec_bench_table.table(records, ["spec_bench"], ["autoregressive", "fast"])
    # Spec-Bench's columns in its order, a category it does not know as its own, then Overall
    assert list(dict.fromkeys(df["column"])) == ["MT-Bench", "Translation", "RAG", "custom", "Overall"]
    columns = {"MT-Bench": MT_BENCH, "Translation": ("translation",), "RAG": ("rag",), "custom": ("custom",),
               "Overall": ("writing", "coding", "translation", "rag", "custom")}
    for _, row in df[df["decoder"] == "fast"].iterrows():
        mean, std, accepted = _speed_py(fast, ref, columns[row["column"]], 3)
        assert row["runs"] == 3
        assert row["speedup_mean"] == pytest.approx(mean, rel=1e-12)
        assert row["speedup_std"] == pytest.approx(std, rel=1e-12)
        assert row["mean_accepted_tokens"] == pytest.approx(accepted, rel=1e-12)
    assert row["questions"] == 6  # Overall: questions, not turns
    ar = df[df["decoder"] == "autoregressive"]
    for _, row in ar.iterrows():  # speed.py on the baseline against itself: the two counts' ratio, not 1
        mean, std, _ = _speed_py(ref, ref, columns[row["column"]], 3)
        assert row["speedup_mean"] == pytest.approx(mean, rel=1e-12) and row["speedup_mean"] > 1.0
        assert row["speedup_std"] == pytest.approx(std, rel=1e-12, abs=1e-15)
    assert (ar["mean_accepted_tokens"] == 1.0).all()
    assert set(df["reference_tokens"]) == {"text encoded again (speed.py)"}
    # records from before the count (no speed_py_tokens): generated tokens, and the table says so
    older = spec_bench_table.table({("spec_bench", "autoregressive"): [{k: v for k, v in r.items()
                                                                       if k != "speed_py_tokens"} for r in ref],
                                    ("spec_bench", "fast"): fast}, ["spec_bench"], ["autoregressive", "fast"])
    assert (older[older["decoder"] == "autoregressive"]["speedup_mean"] == 1.0).all()
    assert set(older["reference_tokens"]) == {"generated"}
    assert "the reference's tokens: generated" in spec_bench_table.markdown(older)
    wide = spec_bench_table.csv_layout(df)
    assert list(wide["decoder"]) == ["autoregressive", "fast"]
    assert list(wide.columns[:5]) == ["dataset", "decoder", "MT-Bench speedup_mean", "MT-Bench speedup_std",
                                      "MT-Bench mean_accepted_tokens"]
    md = spec_bench_table.markdown(df)
    assert "| decoder        | MT-Bench" in md and "mean ± std over 3 runs" in md and "Overall" in md
    # one run: no spread to report
    single = spec_bench_table.cell([dict(r, repeat_latency_s=r["repeat_latency_s"][:1]) for r in fast],
                                   [dict(r, repeat_latency_s=r["repeat_latency_s"][:1]) for r in ref])
    assert single["runs"] == 1 and math.isnan(single["speedup_std"]) and single["speedup_mean"] > 0


def test_spec_bench_table_says_what_it_covers():
    """The table says how many questions its figures count of those asked, which
    were skipped (a turn that could not run drops its question, for every decoder) and how many
    turns stopped at the context; a turn stopped there counts with its tokens, as in Spec-Bench."""
    from bench import spec_bench_table

    ref, fast = [], []
    for qid, category in [("81", "writing"), ("161", "translation"), ("162", "translation")]:
        for turn in range(2 if category in MT_BENCH else 1):
            ref.append(_record(qid, category, turn, 3, [2.0], [1, 1]))
            fast.append(_record(qid, category, turn, 3, [1.0], [2]))
    skipped = {"status": "skipped", "reason": "prompt of 4100 tokens leaves no room in the model's context of 4096"}
    ref[-1] = {k: v for k, v in ref[-1].items() if k in ("key", "prompt_id", "turn", "category")} | skipped
    fast[-1] = {k: v for k, v in fast[-1].items() if k in ("key", "prompt_id", "turn", "category")} | skipped
    fast[1]["stop_reason"] = "context"  # 81's second turn ran to the context: it still counts
    df = spec_bench_table.table({("spec_bench", "autoregressive"): ref, ("spec_bench", "fast"): fast},
                                ["spec_bench"], ["autoregressive", "fast"])
    overall = df[(df["column"] == "Overall") & (df["decoder"] == "fast")].iloc[0]
    assert (overall["questions"], overall["of"], overall["skipped"], overall["context_stops"]) == (2, 3, 1, 1)
    assert overall["speedup_mean"] == pytest.approx(2.0)  # 81 (both turns) and 161, not 162
    md = spec_bench_table.markdown(df)
    assert "- fast: 2 of 3 questions; 1 skipped (162: each record says why); 1 turn stopped at the context" in md
    assert "- autoregressive: 2 of 3 questions; 1 skipped (162: each record says why); 0 turns" in md
    wide = spec_bench_table.csv_layout(df)
    assert list(wide.columns[-5:]) == ["questions", "of", "skipped", "context_stops", "reference_tokens"]
    assert list(wide["of"]) == [3, 3] and list(wide["skipped"]) == [1, 1]


# ---- the preset and the model configs ---------------------------------------------------------

@pytest.mark.slow
def test_preset_follows_spec_bench_protocol_with_each_targets_drafts(monkeypatch):
    from bench.leaderboard import compose_all

    monkeypatch.delenv("BENCH_COMPILE", raising=False)  # the suite's own default (none) would hide the preset's

    base, labels, runs = compose_all(["+preset=spec_bench", "model=vicuna-7b-v1.3"])
    board = base.leaderboard
    assert list(board.datasets) == ["spec_bench"] and board.limit == 480 and board.turns == "all"
    assert board.repeats == 3 and board.out_dir == "results/spec_bench"
    assert base.gen.max_new_tokens == 1024 and base.gen.temperature == 0 and base.gen.batch_size == 1
    assert base.dtype == "auto"  # float16 on CUDA, as Spec-Bench runs; float32 on CPU
    from bench.models import resolve_dtype
    assert resolve_dtype(base.dtype, torch.device("cuda")) == torch.float16
    authors = {"eagle2-t60d5k10", "eagle1-mc_sim_7b_63", "medusa-mc_sim_7b_63"}
    assert labels[0] == "autoregressive" and {"medusa", "eagle"} | authors <= set(labels)
    eagle, eagle1, eagle2, medusa, medusa1 = (runs["spec_bench", x] for x in (
        "eagle", "eagle1-mc_sim_7b_63", "eagle2-t60d5k10", "medusa", "medusa-mc_sim_7b_63"))
    assert {r.decoder.draft_weights for r in (eagle, eagle1, eagle2)} == {"yuhuili/EAGLE-Vicuna-7B-v1.3"}
    assert {r.decoder.heads for r in (medusa, medusa1)} == {"FasterDecoding/medusa-vicuna-7b-v1.3"}
    # the authors' settings: EAGLE-2's total_token 60 / depth 5 / top_k 10 in our counting, their named trees
    assert (eagle2.decoder.tree, eagle2.decoder.tree_size, eagle2.decoder.depth, eagle2.decoder.top_k) == \
        ("dynamic", 59, 6, 10)
    assert eagle1.decoder.tree == "mc_sim_7b_63" and medusa1.decoder.choices == "mc_sim_7b_63"
    assert eagle.decoder.tree == "dynamic" and medusa.decoder.choices == "auto"  # ours, beside them
    # one path for every entry: eager, as the hf_* peers and Spec-Bench's baselines run (7B configs default to auto)
    assert {run.model.compile for run in runs.values()} == {"none"}
    assert eagle.model.revision == "236eeeab96f0dc2e463f2bebb7bb49809279c6d6"
    lookahead = runs["spec_bench", "lookahead-n5w7g7"].decoder
    assert (lookahead.ngram, lookahead.window, lookahead.guess_set_size) == (5, 7, 7)
    assert runs["spec_bench", "hf_pld-n3"].decoder.max_ngram == 3
    # EAGLE-3 on its target; a target without a published draft refuses the entry in one line
    _, _, runs = compose_all(["+preset=spec_bench", "model=llama-3.1-8b-instruct",
                              "leaderboard.only=[autoregressive,eagle3,hf_pld-n3]"])
    assert runs["spec_bench", "eagle3"].decoder.draft_weights == "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
    with pytest.raises(BenchError,
                       match=r"leaderboard entry \S+ needs model.drafts.\w+, but model codellama-7b names no drafts"):
        compose_all(["+preset=spec_bench", "model=codellama-7b"])
    _, labels, _ = compose_all(["+preset=spec_bench", "model=codellama-7b",
                                "leaderboard.only=[autoregressive,hf_pld-n3,lookahead-n5w7g7,recycling]"])
    assert labels == ["autoregressive", "hf_pld-n3", "lookahead-n5w7g7", "recycling"]


@pytest.mark.parametrize("choice, path, revision, drafts", [
    ("vicuna-7b-v1.3", "lmsys/vicuna-7b-v1.3", "236eeeab96f0dc2e463f2bebb7bb49809279c6d6",
     {"eagle": "yuhuili/EAGLE-Vicuna-7B-v1.3", "medusa": "FasterDecoding/medusa-vicuna-7b-v1.3"}),
    ("vicuna-7b", "lmsys/vicuna-7b-v1.3", "236eeeab96f0dc2e463f2bebb7bb49809279c6d6",
     {"eagle": "yuhuili/EAGLE-Vicuna-7B-v1.3", "medusa": "FasterDecoding/medusa-vicuna-7b-v1.3"}),
    ("llama2-7b-chat", "meta-llama/Llama-2-7b-chat-hf", "f5db02db724555f92da89c216ac04704f23d4590",
     {"eagle": "yuhuili/EAGLE-llama2-chat-7B"}),
    ("llama-3.1-8b-instruct", "meta-llama/Llama-3.1-8B-Instruct", "0e9e39f249a16976918f6564b8830bc894c89659",
     {"eagle3": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"}),
    ("codellama-7b", "codellama/CodeLlama-7b-hf", "6c284d1468fe6c413cf56183e69b194dcfa27fe6", {}),
    ("codellama-7b-instruct", "codellama/CodeLlama-7b-Instruct-hf", "22cb240e0292b0b5ab4c17ccd97aa3a2f799cbed", {}),
])
def test_standard_pairs_pin_a_revision_and_name_their_drafts(choice, path, revision, drafts):
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from bench.__main__ import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"model={choice}"])
    spec = instantiate(cfg.model, _convert_="all")  # builds the spec only: nothing is downloaded
    assert (spec.name, spec.path, spec.revision, spec.drafts) == (choice, path, revision, drafts)
    assert re.fullmatch(r"[0-9a-f]{40}", spec.revision)  # a commit, not a branch that moves


def test_configured_revision_reaches_from_pretrained_and_provenance(tmp_path, monkeypatch):
    """A local directory stands in for the hub (unreachable here): the loading code is the real one,
    the revision goes to both from_pretrained calls and provenance records it."""
    import transformers

    from bench import provenance
    from bench.models import PretrainedModel, TinyRandomModel

    spec = TinyRandomModel(cache_dir=CACHE_DIR, device="cpu", dtype="float32")
    tokenizer = spec.load_tokenizer()
    spec.build(len(tokenizer), tokenizer.eos_token_id).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    seen = []
    for cls in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        original = cls.from_pretrained

        def spy(source, *args, _original=original, _cls=cls, **kwargs):
            seen.append((_cls.__name__, source, kwargs.get("revision")))
            return _original(source, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", spy)
    revision = "0123456789abcdef0123456789abcdef01234567"
    lm = PretrainedModel(name="local", path=str(tmp_path), revision=revision, device="cpu", dtype="float32",
                         fast_path="none").load()
    assert {(name, rev) for name, _, rev in seen} == {("AutoModelForCausalLM", revision), ("AutoTokenizer", revision)}
    source = provenance.collect(lm)["model_source"]
    assert source == {"path": str(tmp_path), "local": True, "revision": revision, "commit": None}


# ---- the preset end to end on CPU -------------------------------------------------------------

@pytest.mark.slow
def test_spec_bench_preset_runs_every_turn_and_writes_its_table(tmp_path, monkeypatch):
    """tiny-random, one two-turn MT-Bench question and one translation, 6 tokens, 2 repeats."""
    from bench.leaderboard import main

    rows = [json.loads(line) for line in SPEC_BENCH.read_text().splitlines()]
    questions = tmp_path / "question.jsonl"
    questions.write_text("".join(json.dumps(r) + "\n"
                                 for r in [rows[0], next(r for r in rows if r["category"] == "translation")]))
    monkeypatch.setenv("BENCH_CACHE_DIR", CACHE_DIR)
    out = tmp_path / "board"
    main(["+preset=spec_bench", "model=tiny-random", "model.fast_path=none", f"dataset.path={questions}",
          "gen.max_new_tokens=6", "leaderboard.repeats=2", "leaderboard.only=[autoregressive,prompt_lookup-n3]",
          "leaderboard.verification_tokens=[1,2]", f"leaderboard.out_dir={out}", "progress=false"])
    logs = {label: [json.loads(line)
                    for line in (out / "spec_bench" / label / "records.jsonl").read_text().splitlines()]
            for label in ("autoregressive", "prompt_lookup-n3")}
    for records in logs.values():
        assert [r["key"] for r in records] == ["81#0", "81#1", "161#0"]  # MT-Bench's second turn is asked
        assert all(len(r["repeat_latency_s"]) == 2 for r in records)
        assert records[0]["text"] in records[1]["prompt_text"]  # turn 2 follows the method's own answer
    assert [r["tokens"] for r in logs["prompt_lookup-n3"]] == [r["tokens"] for r in logs["autoregressive"]]
    wide = pd.read_csv(out / "spec_bench.csv")
    assert list(wide["decoder"]) == ["autoregressive", "prompt_lookup-n3"] and (wide["runs"] == 2).all()
    for column in ("MT-Bench", "Translation", "Overall"):
        assert (wide[f"{column} speedup_mean"] > 0).all() and (wide[f"{column} speedup_std"] >= 0).all()
    # the reference against itself, as speed.py computes it: its generated tokens over its text's (random
    # tokens' text encodes again quite differently, and this tokenizer adds no BOS for the - 1 to remove)
    ref = [dict(r, accept_lengths=[1]) for r in logs["autoregressive"]]
    expected, _, _ = _speed_py(ref, ref, {r["category"] for r in ref}, 2)
    assert wide.loc[0, "Overall speedup_mean"] == pytest.approx(expected, rel=1e-12) and expected != 1.0
    assert wide.loc[0, "Overall mean_accepted_tokens"] == 1.0
    assert (wide["reference_tokens"] == "text encoded again (speed.py)").all()
    assert (wide["questions"] == 2).all() and (wide["of"] == 2).all() and (wide["skipped"] == 0).all()
    md = (out / "spec_bench.md").read_text()
    assert "mean ± std over 2 runs" in md
    assert "- prompt_lookup-n3: 2 of 2 questions; 0 skipped; 0 turns stopped at the context" in md
    assert (out / "leaderboard.csv").is_file()  # ours, beside it
    info = json.loads((out / "provenance.json").read_text())
    assert info["leaderboard"]["turns"] == "all" and info["dtype"] == "float32"


def test_a_sentencepiece_only_tokenizer_loads_as_sentencepiece_encodes(tmp_path):
    """vicuna-7b-v1.3 ships tokenizer.model alone (no tokenizer.json): transformers converts it with
    sentencepiece and protobuf (pyproject's dependencies). A small BPE model of that kind encodes as
    sentencepiece's own processor does."""
    import sentencepiece
    from sentencepiece import sentencepiece_model_pb2 as pb
    from transformers import AutoTokenizer

    model = pb.ModelProto()
    model.trainer_spec.model_type = pb.TrainerSpec.BPE
    model.trainer_spec.byte_fallback = True
    model.normalizer_spec.name, model.normalizer_spec.add_dummy_prefix = "identity", True
    model.normalizer_spec.remove_extra_whitespaces = False
    pieces = [("<unk>", pb.ModelProto.SentencePiece.UNKNOWN), ("<s>", pb.ModelProto.SentencePiece.CONTROL),
              ("</s>", pb.ModelProto.SentencePiece.CONTROL)]
    pieces += [(f"<0x{i:02X}>", pb.ModelProto.SentencePiece.BYTE) for i in range(256)]
    words = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "he", "ll", "lo", "▁he", "llo", "▁hello", "▁w", "or", "ld",
             "▁world"]
    pieces += [(w, pb.ModelProto.SentencePiece.NORMAL) for w in words]
    for i, (piece, kind) in enumerate(pieces):
        p = model.pieces.add()
        p.piece, p.type, p.score = piece, kind, -float(i) if kind == pb.ModelProto.SentencePiece.NORMAL else 0.0
    (tmp_path / "tokenizer.model").write_bytes(model.SerializeToString())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    reference = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    for text in ["hello world", "hello  wor", "held Ω"]:
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == reference.encode(text), text


@pytest.mark.slow
def test_per_group_samples_every_column_and_composes_with_the_preset(monkeypatch):
    """dataset.per_group=N keeps the first N questions of each of Spec-Bench's six task groups (MT-Bench's
    eight categories are one group), so a short run fills every column of the table; it is a key of the
    preset's dataset, settable on the leaderboard's command line."""
    from bench.datasets import SPEC_BENCH_GROUPS, SpecBench
    from bench.leaderboard import compose_all

    prompts = SpecBench(path=str(SPEC_BENCH), per_group=2).load()
    group_of = {c: g for g, cats in SPEC_BENCH_GROUPS.items() for c in cats}
    assert [group_of[p.meta["category"]] for p in prompts] == [g for g in SPEC_BENCH_GROUPS for _ in range(2)]
    assert [p.id for p in prompts[:4]] == ["81", "82", "161", "162"]  # each group's first, in file order
    with pytest.raises(BenchError, match="dataset.per_group must be a positive integer or null"):
        SpecBench(path=str(SPEC_BENCH), per_group=0).load()
    _, _, runs = compose_all(["+preset=spec_bench", "model=smollm2-135m", "dataset.per_group=2"])
    assert {run.dataset.per_group for run in runs.values()} == {2}
