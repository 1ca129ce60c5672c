"""The scripts run end to end on tiny-random (the side-by-side benchmarks are leaderboard presets:
tests/test_leaderboard.py)."""
import json
import os
import subprocess

import pytest
import torch

from helpers import CACHE_DIR, DATA_DIR, REPO, SESSION_TOKENIZER, run_python, script_module, writable_copy


def run_script(name: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, BENCH_DATA_DIR=str(DATA_DIR), BENCH_CACHE_DIR=CACHE_DIR, HF_HUB_OFFLINE="1")
    return run_python(REPO / "scripts" / name, *args, timeout=timeout, env=env)


@pytest.mark.slow
def test_ablation_sweeps_and_plots(tmp_path):
    """The three budget sweeps and the sampling sweep run as multiruns on tiny-random, and
    plot_ablation.py draws both plots from them."""
    from helpers import run_cli
    tiny = ["model=tiny-random", "model.num_layers=3", "draft.layers=1", "draft.adapter=null", "dataset=gsm8k",
            "dataset.limit=1", "gen.max_new_tokens=6", "progress=false", "decoder.auto_tokens=4"]
    sweeps = {"sequoia_budget": ["decoder.budget=1,4"], "specinfer_budget": ["decoder.depth=1,2"],
              "chain_budget": ["decoder.depth=1,4"],
              "sampling_robustness": ["decoder=sequoia", "gen.temperature=0.7,1.0", "gen.top_p=1.0"]}
    for name, grid in sweeps.items():
        extra = [o for o in tiny if not (o.startswith("decoder.auto") and name in ("specinfer_budget", "chain_budget"))]
        out = run_cli(f"+sweep={name}", *extra, *grid, f"hydra.sweep.dir={tmp_path / name}")
        assert out.returncode == 0, (name, out.stderr[-2000:])
    out = run_script("plot_ablation.py", *(str(tmp_path / n) for n in sweeps), "--out", str(tmp_path / "plots"))
    assert out.returncode == 0, out.stderr[-2000:]
    import pandas as pd
    budget = pd.read_csv(tmp_path / "plots" / "budget_vs_tokens_per_step.csv")
    assert sorted(set(budget["decoder"])) == ["sequoia", "spec_chain", "specinfer"]
    assert sorted(budget[budget["decoder"] == "specinfer"]["budget"]) == [2, 4]
    sampled = pd.read_csv(tmp_path / "plots" / "sampling_robustness.csv")
    assert set(sampled["temperature"]) == {0.0, 0.7, 1.0}  # greedy budget runs are the temperature-0 points
    assert (tmp_path / "plots" / "budget_vs_tokens_per_step.png").stat().st_size > 0
    assert (tmp_path / "plots" / "sampling_robustness.png").stat().st_size > 0


@pytest.fixture(scope="module")
def base_tokenizer(tmp_path_factory) -> list[str]:
    """Overrides giving tiny-random a tokenizer without a chat template (a base model's, e.g. codellama-7b)."""
    from bench.models import TinyRandomModel

    tokenizer = TinyRandomModel().load_tokenizer()
    tokenizer.chat_template = None
    path = tmp_path_factory.mktemp("base-tokenizer")
    tokenizer.save_pretrained(path)
    return ["model.tokenizer._target_=bench.models.PretrainedModel", "+model.tokenizer.name=base",
            f"+model.tokenizer.path={path}"]


@pytest.mark.slow
def test_train_heads_and_ngram_on_tiny_random(tmp_path, base_tokenizer):
    """Both training scripts end to end (2 steps; the corpus's self-distilled answers come from
    the tiny model itself, rendered raw: its tokenizer has no chat template; the heads train on a
    bfloat16 target), and the files they write load into the decoders."""
    common = ["--gsm8k-questions", "2", "--answer-tokens", "8", "model=tiny-random", "device=cpu",
              f"cache_dir={tmp_path}", *base_tokenizer]
    out = run_script("train_heads.py", "--steps", "2", "--heads", "2", "--seq-len", "32", "--batch", "2",
                     "--device", "cpu", "--dtype", "bfloat16", "--out", str(tmp_path / "heads.safetensors"), *common,
                     timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "head 1 (token t+3)" in out.stdout and (tmp_path / "heads.png").is_file()
    out = run_script("train_ngram.py", "--order", "3", "--max-train-tokens", "20000", "--out",
                     str(tmp_path / "ngram.json.gz"), *common, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "\n20000 tokens, " in "\n" + out.stdout, out.stdout
    out = run_script("draft_vocab.py", "--size", "300", "--out", str(tmp_path / "vocab.json"), *common, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    vocab = json.loads((tmp_path / "vocab.json").read_text())
    assert len(vocab["tokens"]) == 300 and 0 <= vocab["heldout_coverage"] <= 1 and vocab["model"] == "tiny-random"
    # Heads trained and measured over that vocabulary, as decoder.readout_vocab then reads them.
    out = run_script("train_heads.py", "--steps", "2", "--heads", "2", "--seq-len", "32", "--batch", "2",
                     "--device", "cpu", "--readout-vocab", str(tmp_path / "vocab.json"),
                     "--out", str(tmp_path / "heads300.safetensors"), *common, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    from decoders.methods.autoregressive import autoregressive_decode
    from decoders.methods.bpd import BPD
    from decoders.methods.heads import load_heads
    from decoders.methods.ngram_lm import NgramLM
    from decoders.core.sampling import Sampling
    from helpers import tiny_lm

    lm = tiny_lm(seed=0, vocab=49152, name="tiny-random")  # the files record the model they were trained for
    heads = load_heads(lm, tmp_path / "heads.safetensors")
    assert heads.k == 2 and len(heads.info["accuracy"]) == 2 and heads.info["steps"] == 2
    assert heads.info["readout_vocab"] == 49152 and load_heads(lm, tmp_path / "heads300.safetensors").info[
        "readout_vocab"] == 300
    info = NgramLM.load(tmp_path / "ngram.json.gz").info
    assert info["order"] == 3 and info["train_tokens"] == 20000
    reference = autoregressive_decode(lm, [5, 6, 7], 6, Sampling(), set()).tokens
    for readout in ("full", str(tmp_path / "vocab.json")):
        dec = BPD(heads=str(tmp_path / "heads.safetensors"), rescore="ngram", ngram=str(tmp_path / "ngram.json.gz"),
                  paths=2, readout_vocab=readout)
        assert dec.generate(lm, [5, 6, 7], 6, Sampling(), set()).tokens == reference
        assert dec.tuning["readout_vocab"] == (49152 if readout == "full" else 300)


@pytest.mark.slow
def test_train_exit_adapter_for_a_model_without_a_chat_template(tmp_path, base_tokenizer):
    """scripts/train_exit_adapter.py end to end (2 steps, float32 target), its self-distilled requests
    rendered raw, and its file loads into draft=self."""
    out = run_script("train_exit_adapter.py", "--steps", "2", "--seq-len", "32", "--batch", "2", "--generated", "2",
                     "--heldout", "2", "--device", "cpu", "--dtype", "float32", "--bf16",
                     "--out", str(tmp_path / "self1.safetensors"),
                     "model=tiny-random", "draft.layers=1", f"cache_dir={tmp_path}", *base_tokenizer, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "held-out top-1 agreement" in out.stdout
    from decoders.methods.draft_model import SelfDraft
    from helpers import tiny_lm

    draft = SelfDraft(layers=1, adapter=str(tmp_path / "self1.safetensors")).build(
        tiny_lm(seed=0, vocab=49152, name="tiny-random"))
    assert draft.model.base_model.norm[0].proj.weight.dtype == torch.float32
    from decoders.core.weights_file import load_weights
    meta, _ = load_weights(tmp_path / "self1.safetensors", "exit-adapter-v1", "draft.adapter", "exit adapter", "")
    assert json.loads(meta["info"])["bf16"] is True  # bfloat16 autocast over a float32 target


@pytest.mark.slow
def test_profile_device_prints_both_paths_side_by_side(tmp_path):
    import csv
    import json

    out = run_script("profile_device.py", "--max-tokens", "4", "--repeats", "1", "--out", str(tmp_path / "out"),
                     "--split", "2", "model=tiny-random", f"cache_dir={tmp_path}", *SESSION_TOKENIZER, "device=cpu")
    assert out.returncode == 0, out.stderr[-2000:]
    from decoders.core.kernels import dtype_supported

    labels = ["none", "prepacked>=1", "prepacked>=2", "prepacked>=4"]  # what auto chooses among
    labels += ["kernel"] if dtype_supported(torch.float32) is None else []  # ours, where this CPU runs it
    assert all(f"{p}: one autoregressive step" in out.stdout for p in labels)
    assert "of memory-copy bandwidth" in out.stdout and "the step's floor" in out.stdout and "x the floor" in out.stdout
    rows = list(csv.DictReader(open(tmp_path / "out" / "profile.csv")))
    assert [r["tokens"] for r in rows] == ["1", "2", "3", "4"]
    assert {"none_vs_own_step", "prepacked>=1_vs_own_step", "prepacked>=4_vs_native_step"} <= set(rows[0])
    info = json.loads((tmp_path / "out" / "provenance.json").read_text())
    assert set(info["profiles"]) == set(labels) and info["copy_bandwidth_bytes_per_s"] > 0
    assert info["step_vs_floor"]["none"] == pytest.approx(info["autoregressive_s"]["none"] / info["floor_s"])
    assert float(rows[0]["none_vs_floor"]) == pytest.approx(float(rows[0]["none_ms"]) / 1e3 / info["floor_s"], rel=1e-6)
    assert len(set(info["profiles"].values())) == len(labels)  # each threshold its own cached profile
    assert (tmp_path / "out" / "profile.png").stat().st_size > 0
    split = list(csv.DictReader(open(tmp_path / "out" / "split.csv")))  # --split: each path's step and 2 tokens
    assert [(r["path"], r["tokens"]) for r in split] == [(p, t) for p in labels for t in ("1 (step)", "2")]
    assert "where each forward's time goes" in out.stdout and all(r["held_back_by"] for r in split)
    # the native path compiled, beside a packed one: inductor takes 33 s over it on a Zen 3, 73 over the packed
    # path (test_compile.py compiles the suite's own path)
    compiled = run_script("profile_device.py", "--paths", "prepacked>=4,none+inductor", "--max-tokens", "4",
                          "--repeats", "1", "--out", str(tmp_path / "c"), "model=tiny-random", "model.num_layers=1",
                          f"cache_dir={tmp_path}", *SESSION_TOKENIZER, "device=cpu")
    assert compiled.returncode == 0, compiled.stderr[-2000:]
    assert "none+inductor: compiled in" in compiled.stdout
    info = json.loads((tmp_path / "c" / "provenance.json").read_text())
    assert info["compile_seconds"]["none+inductor"] > 0
    assert len(set(info["profiles"].values())) == 2  # the compiled curve is cached apart
    bad = run_script("profile_device.py", "--paths", "prepacked>=0", "model=tiny-random", "device=cpu",
                     f"cache_dir={tmp_path}")
    assert bad.returncode == 2 and "prepacked>=N (N >= 1)" in bad.stderr
    bad = run_script("profile_device.py", "--split", "0,8", "model=tiny-random", "device=cpu", f"cache_dir={tmp_path}")
    assert bad.returncode == 2 and "--split 0,8: give forward widths >= 1" in bad.stderr


@pytest.mark.slow
def test_bench_linear_kernels_runs(tmp_path):
    out = run_script("bench_linear_kernels.py", "--layers", "1", "--repeats", "1", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "onednn_prepacked" in out.stdout and (tmp_path / "kernels.csv").is_file()
    from decoders.core.kernels import dtype_supported

    def table_rows(label):  # the tables' rows of `label` (a row names its dtype, or is indented under it)
        rows = []
        for line in out.stdout.splitlines():
            tokens = line.split()
            if tokens[:1] in (["float32"], ["bfloat16"]):
                tokens = tokens[1:]
            elif not line.startswith(" "):
                continue
            if tokens[:1] == [label]:
                rows.append(line)
        return rows

    assert len(table_rows("native")) == 4  # the control: float32's and bfloat16's, in both tables
    assert bool(table_rows("kernel")) == (dtype_supported(torch.float32) is None)  # ours, where this CPU runs it


@pytest.mark.slow
def test_divergence_gaps_finds_where_an_output_departs(tmp_path):
    import json

    import pandas as pd

    env = dict(os.environ, BENCH_DATA_DIR=str(DATA_DIR), BENCH_CACHE_DIR=CACHE_DIR)
    board = run_python("-m", "bench.leaderboard", "model=tiny-random", "device=cpu", "gen.max_new_tokens=8",
                       "leaderboard.limit=2", "leaderboard.datasets=[gsm8k]",
                       "leaderboard.only=[autoregressive,jacobi]",
                       "leaderboard.verification_tokens=[1,2]", f"leaderboard.out_dir={tmp_path}", env=env)
    assert board.returncode == 0, board.stderr[-2000:]
    path = tmp_path / "gsm8k" / "jacobi" / "records.jsonl"
    records = [json.loads(x) for x in path.read_text().splitlines()]
    records[1]["tokens"][3] = (records[1]["tokens"][3] + 1) % 64  # as if it had departed at position 3
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = run_script("divergence_gaps.py", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    df = pd.read_csv(tmp_path / "divergences.csv")
    assert len(df) == 1 and df.loc[0, "decoder"] == "jacobi" and df.loc[0, "first_divergence"] == 3
    assert df.loc[0, "divergence_logit_gap"] > 0 and df.loc[0, "dtype"] == "float32"
    # a token changed by hand is no tie: its logit is far below the reference's top-1
    assert df.loc[0, "divergence_ulps"] > 1e3 and not df.loc[0, "divergence_tie"]
    assert "real_divergences" in out.stdout and "lossless_up_to_ties" in out.stdout
    # Bad input is one line and exit 2 (it was exit 1, and a damaged or foreign
    # config.yaml a traceback or, with another _target_, whatever class that named).
    config = tmp_path / "gsm8k" / "autoregressive" / "config.yaml"
    good = config.read_text()
    for body, message in ((None, "no autoregressive/records.jsonl under"),
                          (good.replace("\nmodel:\n", "\nmodel: 5\nold_model:\n", 1), "model is 5, not the settings"),
                          (good.replace("_target_: bench.models.", "_target_: os.system #", 1), "_target_"),
                          (good + "\nbroken: [\n", "is damaged")):
        if body is None:
            out = run_script("divergence_gaps.py", str(tmp_path / "nope"))
        else:
            config.write_text(body)
            out = run_script("divergence_gaps.py", str(tmp_path))
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and message in lines[0], out.stderr[-2000:]


@pytest.mark.slow
def test_compare_leaderboards_finds_a_changed_step(tmp_path):
    """The before/after check of a refactor: a copy of a leaderboard is identical (exit 0); one
    record whose per-step acceptance differs is reported (exit 1)."""
    import shutil

    reference = REPO / "results" / "reference" / "leaderboard"
    shutil.copytree(reference / "gsm8k" / "jacobi", tmp_path / "before" / "gsm8k" / "jacobi")  # records.jsonl.gz
    writable_copy(reference / "gsm8k" / "jacobi", tmp_path / "after" / "gsm8k" / "jacobi")
    out = run_script("compare_leaderboards.py", str(tmp_path / "before"), str(tmp_path / "after"))
    assert out.returncode == 0 and "all identical: True" in out.stdout, out.stderr
    records = tmp_path / "after" / "gsm8k" / "jacobi" / "records.jsonl"
    lines = records.read_text().splitlines()
    first = json.loads(lines[0])
    first["trace"]["accepted_draft_tokens"][1] += 1
    records.write_text("\n".join([json.dumps(first)] + lines[1:]) + "\n")
    out = run_script("compare_leaderboards.py", str(tmp_path / "before"), str(tmp_path / "after"))
    assert out.returncode == 1 and "| gsm8k | jacobi | 5 | 5 | 5 | 4 | 4 | yes |" in out.stdout, out.stdout


@pytest.mark.slow
def test_train_eagle_on_tiny_random(tmp_path):
    """scripts/train_eagle.py end to end on a float16 target (fp32 master weights under autocast with
    loss scaling) with a draft vocabulary: its file drives decoder=eagle; a run stopped after 2 steps
    (exit 75, state saved) and run again ends with the same draft, bit for bit, as the uninterrupted
    run; --evaluate reads drafts' held-out accuracy by request family, side by side."""
    from safetensors.torch import load_file

    from decoders.core.sampling import Sampling
    from decoders.methods.autoregressive import autoregressive_decode
    from decoders.methods.eagle import Eagle
    from decoders.methods.eagle_draft import load_draft
    from helpers import tiny_lm

    common = ["--chunks", "6", "--epochs", "2", "--generated-repeats", "1", "--unroll", "2", "--seq-len", "32",
              "--batch", "2", "--draft-vocab", "40", "--depth", "3", "--gsm8k-questions", "2", "--answer-tokens", "8",
              "--function-requests", "3", "--general-requests", "3", "--device", "cpu", "--dtype", "float16",
              "model=tiny-random", "device=cpu", f"cache_dir={tmp_path}", *SESSION_TOKENIZER]
    whole = run_script("train_eagle.py", *common, "--out", str(tmp_path / "whole.safetensors"), timeout=900)
    assert whole.returncode == 0, whole.stderr[-2000:]
    assert "depth 3: top-1" in whole.stdout and (tmp_path / "whole.png").is_file()

    lm = tiny_lm(seed=0, vocab=49152, name="tiny-random")  # the files record the model they were trained for
    draft = load_draft(lm, tmp_path / "whole.safetensors")
    assert len(draft.vocab) == 40 and len(draft.accuracy()) == 3 and draft.info["unroll"] == 2
    reference = autoregressive_decode(lm, [5, 6, 7], 8, Sampling(), set()).tokens
    for tree in ("dynamic", "static"):
        dec = Eagle(draft_weights=str(tmp_path / "whole.safetensors"), tree=tree, tree_size=6, depth=3, top_k=3)
        assert dec.generate(lm, [5, 6, 7], 8, Sampling(), set()).tokens == reference

    parts = ["--out", str(tmp_path / "parts.safetensors")]
    first = run_script("train_eagle.py", *common, *parts, "--stop-after-steps", "2")
    assert first.returncode == 75 and "stopped at step 2 of" in first.stdout, first.stderr[-2000:]
    assert list((tmp_path / "train_eagle").glob("parts-*.pt")) and not (tmp_path / "parts.safetensors").exists()
    second = run_script("train_eagle.py", *common, *parts)
    assert second.returncode == 0 and "resuming from" in second.stdout, second.stderr[-2000:]
    assert not list((tmp_path / "train_eagle").glob("parts-*.pt"))  # a finished run leaves no state behind
    a, b = load_file(tmp_path / "whole.safetensors"), load_file(tmp_path / "parts.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    whole_file, parts_file = tmp_path / "whole.safetensors", tmp_path / "parts.safetensors"
    evaluated = run_script("train_eagle.py", *common, "--evaluate", str(whole_file), str(parts_file))
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    for family in ("all", "code", "instructions", "general"):  # the families with a held-out (every 10th) answer
        assert f"  {family} " in evaluated.stdout, evaluated.stdout
    assert f"| depth | {whole_file} | {parts_file} |" in evaluated.stdout, evaluated.stdout  # side by side


@pytest.mark.slow
def test_train_block_draft_on_tiny_random(tmp_path):
    """scripts/train_block_draft.py end to end on tiny-random with a draft vocabulary: the file records the
    shape it was trained in, the held-out accuracy by block position and rank it measured and the KL of
    every position, and decoder=dflash decodes exactly with it, as a chain and a tree."""
    import json

    from decoders.core.sampling import Sampling
    from decoders.methods.autoregressive import autoregressive_decode
    from decoders.methods.block_draft import load_block_draft
    from decoders.methods.dflash import DFlash
    from helpers import tiny_lm

    vocab = tmp_path / "vocab.json"
    vocab.write_text(json.dumps({"format": "draft-vocab-v1", "vocab_size": 49152, "model": "tiny-random",
                                 "tokens": list(range(0, 80, 2))}))
    out = tmp_path / "block.safetensors"
    run = run_script("train_block_draft.py", "--block-size", "4", "--intermediate-size", "16", "--anchors", "4",
                     "--chunks", "6", "--epochs", "3", "--generated-repeats", "1", "--seq-len", "32", "--batch", "2",
                     "--lr", "1e-2", "--vocab", str(vocab), "--gsm8k-questions", "2", "--answer-tokens", "8",
                     "--function-requests", "3", "--general-requests", "3", "--out", str(out), "--device", "cpu",
                     "model=tiny-random", "device=cpu", f"cache_dir={tmp_path}", *SESSION_TOKENIZER, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "position 3: top-1" in run.stdout and "chain: mean accepted drafts" in run.stdout
    assert out.with_suffix(".png").is_file()

    lm = tiny_lm(seed=0, vocab=49152, name="tiny-random")  # the file records the model it was trained for
    draft = load_block_draft(lm, out)
    assert draft.vocab.tolist() == list(range(0, 80, 2)) and draft.intermediate_size == 16 and draft.block_size == 4
    assert len(draft.accuracy()) == 3 and len(draft.accuracy()[0]) == 10
    kl = draft.info["final_kl"]
    assert len(kl) == 3 and all(k > 0 for k in kl)
    reference = autoregressive_decode(lm, [5, 6, 7], 12, Sampling(), set()).tokens
    for tree in ("chain", "tree"):
        dec = DFlash(draft_weights=str(out), tree=tree, tree_size=6, block_size=4, top_k=3)
        assert dec.generate(lm, [5, 6, 7], 12, Sampling(), set()).tokens == reference


@pytest.mark.slow
def test_train_eagle3_on_tiny_random(tmp_path):
    """scripts/train_eagle.py --layout eagle3 end to end on an 8-layer tiny-random target (EAGLE-3 reads
    layers 2, 4 and 5): it writes the authors' layout (a directory), which decoder.draft_weights loads
    as an EAGLE-3 draft whose lm_head training moved, with the held-out accuracy it measured, and
    decodes exactly with; stopped and resumed it ends bit for bit as the whole run (its fused fc, d2t / t2d
    and own lm_head included); --evaluate prints drafts side by side."""
    from safetensors.torch import load_file

    from decoders.core.sampling import Sampling
    from decoders.methods.autoregressive import autoregressive_decode
    from decoders.methods.eagle import Eagle
    from decoders.methods.eagle_draft import load_draft
    from decoders.methods.published import Eagle3Draft
    from helpers import tiny_lm

    common = ["--layout", "eagle3", "--chunks", "6", "--epochs", "2", "--generated-repeats", "1", "--unroll", "2",
              "--seq-len", "32", "--batch", "2", "--draft-vocab", "40", "--depth", "3", "--gsm8k-questions", "2",
              "--answer-tokens", "8", "--function-requests", "3", "--general-requests", "3", "--device", "cpu",
              "model=tiny-random", "model.num_layers=8", "device=cpu", f"cache_dir={tmp_path}",
              *SESSION_TOKENIZER]
    whole = run_script("train_eagle.py", *common, "--out", str(tmp_path / "whole"), timeout=900)
    assert whole.returncode == 0, whole.stderr[-2000:]
    assert "depth 3: top-1" in whole.stdout and (tmp_path / "whole.png").is_file()
    assert sorted(p.name for p in (tmp_path / "whole").iterdir()) == ["config.json", "model.safetensors"]

    lm = tiny_lm(seed=0, vocab=49152, name="tiny-random", layers=8)  # the model it was trained for
    draft = load_draft(lm, tmp_path / "whole")
    assert isinstance(draft, Eagle3Draft) and draft.info["layout"] == "eagle3" and draft.reads == (2, 4, 5)
    assert len(draft.vocab) == 40 and len(draft.accuracy()) == 3 and draft.info["unroll"] == 2
    start = lm.model.get_output_embeddings().weight[draft.vocab].half().float()  # where lm_head started
    assert not torch.equal(draft.lm_head.weight, start)
    reference = autoregressive_decode(lm, [5, 6, 7], 8, Sampling(), set()).tokens
    for tree in ("dynamic", "static"):
        dec = Eagle(draft_weights=str(tmp_path / "whole"), tree=tree, tree_size=6, depth=3, top_k=3)
        assert dec.generate(lm, [5, 6, 7], 8, Sampling(), set()).tokens == reference

    parts = ["--out", str(tmp_path / "parts")]
    first = run_script("train_eagle.py", *common, *parts, "--stop-after-steps", "2")
    assert first.returncode == 75 and "stopped at step 2 of" in first.stdout, first.stderr[-2000:]
    assert not (tmp_path / "parts").exists()
    second = run_script("train_eagle.py", *common, *parts)
    assert second.returncode == 0 and "resuming from" in second.stdout, second.stderr[-2000:]
    a, b = (load_file(tmp_path / name / "model.safetensors") for name in ("whole", "parts"))
    assert a.keys() == b.keys() and {"fc.weight", "d2t", "t2d", "lm_head.weight"} <= a.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    evaluated = run_script("train_eagle.py", *common, "--evaluate", str(tmp_path / "whole"), str(tmp_path / "parts"))
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    assert f"{tmp_path / 'whole'}: held-out top-1 by depth (1..3)\n  all " in evaluated.stdout, evaluated.stdout
    assert f"| depth | {tmp_path / 'whole'} | {tmp_path / 'parts'} |" in evaluated.stdout, evaluated.stdout


@pytest.mark.slow
def test_batch_speedup_on_tiny_random(tmp_path):
    """scripts/batch_speedup.py end to end: every row equals its batch-1 output, the table and plot are written."""
    import pandas as pd

    out = run_script("batch_speedup.py", "--prompts", "3", "--max-new-tokens", "6", "--batch-sizes", "1", "2",
                     "--decoders", "autoregressive", "lookahead", "--widths", "1", "2", "--out", str(tmp_path),
                     "model=tiny-random", "device=cpu", "dataset=gsm8k")
    assert out.returncode == 0, out.stderr[-2000:]
    table = pd.read_csv(tmp_path / "batch_speedup.csv")
    assert set(table.decoder) == {"autoregressive", "lookahead", "hf_generate"} and set(table.batch_size) == {1, 2}
    assert (table.rows_equal_batch1 == table.rows).all()
    assert (tmp_path / "batch_speedup.png").stat().st_size > 0 and (tmp_path / "cost_curve.csv").is_file()
    la = table[table.decoder == "lookahead"]
    assert ((la.tokens_fed_per_row_step > 1).all() and (la.draft_s_per_row_step > 0).all()
            and la.predicted_speedup.notna().all())
    assert (table[table.decoder == "autoregressive"].predicted_speedup == 1).all()


def test_batch_speedup_prediction_reads_the_cost_curve():
    """predicted = tokens per step x cost(B x 1) / (cost(B x fed tokens) + B x drafting), the curve
    interpolated in tokens per row and extended along its last segment."""
    import pandas as pd

    predicted_speedup = script_module("scripts/batch_speedup.py").predicted_speedup

    curve = pd.DataFrame({"batch_size": [2, 2, 2], "tokens_per_row": [1, 2, 4], "seconds": [1.0, 2.0, 3.0]})
    table = pd.DataFrame({"batch_size": [2, 2, 2, 2], "decoder": ["autoregressive", "a", "b", "hf_generate"],
                          "tokens_fed_per_row_step": [1.0, 3.0, 8.0, float("nan")],
                          "tokens_per_step_per_row": [1.0, 2.0, 3.0, float("nan")],
                          "draft_s_per_row_step": [0.0, 0.25, 0.0, float("nan")]})
    got = predicted_speedup(table, curve).tolist()
    assert got[:3] == [1.0, 2 * 1.0 / (2.5 + 2 * 0.25), 3 * 1.0 / (3.0 + 4 * 0.5)] and pd.isna(got[3])


@pytest.mark.slow
def test_repetition_by_position_counts_ngrams_seen_earlier_in_the_output(tmp_path):
    script = script_module("results/reference/long_outputs/repetition_by_position.py")
    repeated, repetition_table = script.repeated, script.repetition_table

    # 1 2 3 1 2 3 1: the 2-grams (3, 1) and (1, 2) ... recur from the fifth token on
    assert repeated([1, 2, 3, 1, 2, 3, 1], 2) == [False, False, False, False, True, True, True]
    assert repeated([5, 5, 5], 1) == [False, True, True] and repeated([1, 2], 3) == [False, False]
    ok = {"status": "ok", "tokens": [1, 2, 3, 1, 2, 3, 1, 2]}
    table = repetition_table([ok, {"status": "skipped"}], 2, 4)
    assert table.to_dict("records") == [{"position": 0, "tokens": 4, "repeated_share": 0.0},
                                        {"position": 4, "tokens": 4, "repeated_share": 1.0}]
    out = run_python(REPO / "results/reference/long_outputs/repetition_by_position.py", str(tmp_path / "nowhere"))
    assert out.returncode == 2 and out.stderr.strip() == f"error: no records.jsonl in {tmp_path / 'nowhere'}"


@pytest.mark.slow
def test_step_overhead_splits_the_step_by_region(tmp_path):
    """scripts/step_overhead.py: per decoder, ms per step by region; the regions it
    wraps must be the ones the loop calls (were it to stop calling them, they would read zero)."""
    import pandas as pd

    out = run_script("step_overhead.py", "--prompts", "1", "--max-new-tokens", "8", "--decoders",
                     "prompt_lookup,lookahead", "--out", str(tmp_path), "model=tiny-random", "dataset=gsm8k",
                     "device=cpu")
    assert out.returncode == 0, out.stderr[-2000:]
    table = pd.read_csv(tmp_path / "step_overhead.csv").set_index("decoder")
    assert list(table.index) == ["prompt_lookup", "lookahead"]
    lookahead = table.loc["lookahead"]
    for region in ("target: model", "overhead: feed", "overhead: verify", "overhead: cache"):
        assert lookahead[region] > 0, region
    assert lookahead["overhead: rest"] >= 0 and lookahead["target: model"] > lookahead["target: harness"]
    bad = run_script("step_overhead.py", "--decoders", "hf_generate")
    assert bad.returncode == 2 and "unknown decoders hf_generate" in bad.stderr
    assert "syncs per step: not counted" in out.stdout and not (tmp_path / "syncs.csv").exists()


def test_sync_counter_counts_the_device_waits_by_line(monkeypatch):
    """transfer.sync_counter, which the GPU kit reads for one wait per step: every synchronising operation's
    warning counted at the line that made it, other warnings not, and the debug mode set for the block only.
    (On a CPU no operation warns: the warnings are made here.)"""
    import warnings

    from decoders.core.transfer import sync_counter

    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    with sync_counter(REPO) as sites:
        for _ in range(3):
            warnings.warn("called a synchronizing CUDA operation")  # one line, three waits
        warnings.warn("called a synchronizing CUDA operation")
        warnings.warn("an unrelated warning")
    assert modes == ["warn", "default"]
    assert sorted(sites.values()) == [1, 3]
    assert all(site.startswith("tests/test_scripts.py:") for site in sites)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["measure_acceptance.py", "batch_speedup.py", "profile_device.py"])
@pytest.mark.parametrize("arg, message", [("--frob", "--frob: neither an option of"),
                                          ("/nonexistent", "/nonexistent: neither an option of"),
                                          ("nokey=1", "nokey=1: Could not override 'nokey'")])
def test_a_script_names_an_argument_it_cannot_take(script, arg, message):
    """What is neither a script's option nor a Hydra override, or an override the config has no key
    for, is one line naming it and exit 2, before any model loads (Hydra's OverrideParseException
    before)."""
    out = run_python(REPO / "scripts" / script, "model=tiny-random", arg, timeout=300)
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert out.returncode == 2 and len(lines) == 1 and message in lines[0], out.stderr[-2000:]
