"""The runner's per-prompt checks, exercised with deliberately wrong decoders."""
from dataclasses import dataclass

import pytest
import torch
from omegaconf import OmegaConf

from bench.datasets import Prompt
from bench.runner import RunContext, run_unit
from decoders.methods.autoregressive import autoregressive_decode
from decoders.core.sampling import Sampling
from decoders.core.trace import Generation, Step
from helpers import tiny_lm


class CharTokenizer:
    """Enough of a tokenizer for run_unit on a vocabulary of 64: one id per character."""

    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) % 64 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(48 + i % 64) for i in ids)


@dataclass
class FlipToken:
    """Autoregressive, but token `at` replaced: a lossy decoder the lossless check must catch."""

    at: int
    name: str = "flip"
    lossless: bool = True  # it claims to be: the check must catch it

    def generate(self, lm, prompt_ids, max_new_tokens, sampling, stop_ids):
        gen = autoregressive_decode(lm, prompt_ids, max_new_tokens, sampling, stop_ids)
        gen.tokens[self.at] = (gen.tokens[self.at] + 1) % 64
        return gen


@dataclass
class Broken:
    """Breaks the Generation contract in a chosen way."""

    how: str
    name: str = "broken"
    lossless: bool = True

    def generate(self, lm, prompt_ids, max_new_tokens, sampling, stop_ids):
        tokens = [5] * (max_new_tokens + 1 if self.how == "too_long" else 3)
        if self.how == "after_eos":
            tokens = [7, 1, 5]
        steps = [Step(committed=1, forward_tokens=1, context_tokens=0) for _ in tokens]
        if self.how == "miscounted":
            steps = steps[:-1]
        return Generation(tokens=tokens, steps=steps, ttft=0.0, stop_reason="length")


class NoQuality:
    quality_metric = None

    def score(self, *args):
        return None


def config(**over):
    cfg = {"decoder": {"name": "x"}, "model": {"name": "tiny"}, "dataset": {"name": "d"},
           "gen": {"max_new_tokens": 12}, "check_lossless": True, "quality": True}
    cfg.update(over)
    return OmegaConf.create(cfg)


@pytest.fixture
def lm():
    lm = tiny_lm(seed=3, eos=1)
    lm.tokenizer = CharTokenizer()
    lm.stop_ids = frozenset()
    return lm


PROMPT = Prompt(id="p", turns=["hello world"], raw_turns=["hello world"])


def test_lossless_check_reports_first_divergence_and_logit_gap(lm):
    record = run_unit(RunContext(lm, FlipToken(at=4), NoQuality(), "raw", config(), Sampling()), PROMPT, 0, [])
    assert record["lossless"] is False and record["first_divergence"] == 4
    ids = CharTokenizer()("hello world")["input_ids"]
    reference = autoregressive_decode(lm, ids, 12, Sampling(), set())
    top2 = lm.forward(ids + reference.tokens[:4], lm.new_cache())[-1].float().topk(2).values
    assert record["divergence_logit_gap"] == pytest.approx(float(top2[0] - top2[1]), rel=1e-4)
    assert record["divergence_logit_gap"] > 0
    assert record["divergence_tie"] is False and record["divergence_ulps"] > 1e3  # a flipped token: a real divergence
    assert record["reference"]["new_tokens"] == 12


def test_lossless_reference_is_timed_without_the_gap_bookkeeping(lm, monkeypatch):
    """The reference's latency is the speedup's denominator: the logit-gap forward runs after the clock."""
    import time

    import bench.runner

    def slow_gap(lm, ids, tokens):
        time.sleep(0.5)
        return iter([torch.zeros(64)] * len(tokens))

    monkeypatch.setattr(bench.runner, "step_logits", slow_gap)
    record = run_unit(RunContext(lm, FlipToken(at=4), NoQuality(), "raw", config(), Sampling()), PROMPT, 0, [])
    assert record["divergence_logit_gap"] == 0.0
    assert record["reference"]["latency_s"] < 0.5


def test_identical_output_is_lossless(lm):
    record = run_unit(RunContext(lm, FlipToken(at=-1), NoQuality(), "raw", config(), Sampling()), PROMPT, 0, [])
    assert record["lossless"] is False and record["first_divergence"] == 11
    from decoders.methods.autoregressive import Autoregressive

    record = run_unit(RunContext(lm, Autoregressive(), NoQuality(), "raw", config(), Sampling()), PROMPT, 0, [])
    assert record["lossless"] is True and record["first_divergence"] is None
    assert record["divergence_logit_gap"] is None


@pytest.mark.parametrize("how,message", [("too_long", "13 tokens for max_new_tokens=12"),
                                         ("after_eos", "tokens after a stop token"),
                                         ("miscounted", "steps commit 2 tokens, output has 3")])
def test_generation_contract_is_enforced(lm, how, message):
    lm.stop_ids = frozenset({1})
    with pytest.raises(RuntimeError, match=message):
        run_unit(RunContext(lm, Broken(how), NoQuality(), "raw", config(check_lossless=False), Sampling()),
                 PROMPT, 0, [])


@pytest.mark.slow
def test_calibration_prompts_are_never_scored(tmp_path):
    """Self-tuning decoders calibrate on the dataset's prompts past dataset.limit, and the records say which."""
    import json

    from bench.datasets import JsonlPrompts
    from bench.runner import calibration_candidates
    from helpers import run_cli

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Count to {i}."}) + "\n" for i in range(6)))
    scored = JsonlPrompts(path=str(path), limit=2).load()
    rest, overlaps = calibration_candidates(JsonlPrompts(path=str(path), limit=2), scored)
    assert [p.id for p in rest] == ["p2", "p3", "p4", "p5"] and not overlaps
    _, overlaps = calibration_candidates(JsonlPrompts(path=str(path)), JsonlPrompts(path=str(path)).load())
    assert overlaps  # nothing left out: flagged, and the run warns

    out = tmp_path / "run"
    result = run_cli("model=tiny-random", "dataset=jsonl", f"dataset.path={path}", "dataset.limit=2",
                     "decoder=lookahead", "decoder.window=auto", "decoder.ngram=auto", "decoder.guess_set_size=auto",
                     "decoder.auto_prompts=2",
                     "decoder.auto_windows=[1,2]", "decoder.auto_ngrams=[2,3]", "gen.max_new_tokens=8", "quality=false",
                     f"hydra.run.dir={out}", "progress=false")
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert [r["prompt_id"] for r in records] == ["p0", "p1"]
    greedy = {"temperature": 0.0, "top_p": 1.0, "top_k": 0}
    assert all(r["calibration"] == {"prompt_ids": ["p2", "p3"], "overlaps_scored": False, "sampling": greedy}
               for r in records)


def _nan_from(lm, context: int) -> None:
    """lm's logits turn NaN once its cache holds `context` tokens (a dtype that overflows mid-answer)."""
    forward = lm.forward

    def poisoned(tokens, cache, *args, **kwargs):
        out = forward(tokens, cache, *args, **kwargs)
        if len(cache) < context:
            return out
        nan = float("nan")
        return (torch.full_like(out[0], nan), *out[1:]) if isinstance(out, tuple) else torch.full_like(out, nan)

    lm.forward = poisoned


@pytest.mark.parametrize("decoder", ["autoregressive", "prompt_lookup"])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logits_that_turn_non_finite_stop_the_run_naming_prompt_and_step(lm, decoder, temperature):
    """NaN logits were read as token 0 at every step, and the output judged lossless against a
    reference as broken. The run stops in one line naming the prompt and the first step whose logits
    are not finite: the reference's own, or, for a decoder's loop, autoregressive greedy's along the
    prompt. Greedy and sampled alike."""
    from bench.errors import BenchError
    from decoders.methods.autoregressive import Autoregressive
    from decoders.methods.prompt_lookup import PromptLookupDecoding

    ids = CharTokenizer()("hello world")["input_ids"]
    _nan_from(lm, len(ids) + 3)
    method = (Autoregressive(name="autoregressive") if decoder == "autoregressive"
              else PromptLookupDecoding(name=decoder))
    ctx = RunContext(lm, method, NoQuality(), "raw", config(check_lossless=temperature == 0),
                     Sampling(temperature=temperature, seed=1))
    with pytest.raises(BenchError) as e:
        run_unit(ctx, PROMPT, 0, [])
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"decoder {decoder} on prompt p#0: logits are not finite (nan)")
    assert "at step 3 (0: the prefill)" in message and "dtype=float32" in message, message


def test_the_lossless_check_never_judges_against_a_non_finite_reference(lm):
    """The output is finite and the reference breaks: no record says lossless, the run stops."""
    from bench.errors import BenchError
    import bench.runner

    ids = CharTokenizer()("hello world")["input_ids"]
    calls = []
    decode = bench.runner.autoregressive_decode

    def reference(lm_, *args, **kwargs):  # the decoder's generation is clean; the check's reference breaks
        calls.append(1)
        _nan_from(lm_, len(ids) + 1)
        return decode(lm_, *args, **kwargs)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(bench.runner, "autoregressive_decode", reference)
        with pytest.raises(BenchError, match="on prompt p#0: logits are not finite .* at step 1"):
            run_unit(RunContext(lm, FlipToken(at=-1), NoQuality(), "raw", config(), Sampling()), PROMPT, 0, [])
    assert calls


def test_nan_weights_are_refused_before_the_run_directory(tmp_path, monkeypatch):
    """A model whose weights hold NaN (here layers.0.mlp, as a damaged checkpoint would) decoded token 0
    at every step and passed as lossless: one forward once it loads refuses it, in one line, before
    anything is written."""
    from hydra import compose, initialize_config_dir

    from bench import runner
    from bench.errors import BenchError
    from bench.models import TinyRandomModel
    from bench.registry import CONF_DIR

    build = TinyRandomModel.build

    def damaged(self, *args, **kwargs):
        model = build(self, *args, **kwargs)
        with torch.no_grad():
            for p in model.model.layers[0].mlp.parameters():
                p.fill_(float("nan"))
        return model

    monkeypatch.setattr(TinyRandomModel, "build", damaged)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=["model=tiny-random", "dataset=gsm8k", "dataset.limit=1", "quality=false",
                                           "check_lossless=true", "gen.max_new_tokens=8", "progress=false",
                                           "device=cpu"])
    with pytest.raises(BenchError) as e:
        runner.run(cfg, tmp_path / "run")
    assert "\n" not in str(e.value) and str(e.value).startswith("model tiny-random, a forward of")
    assert "logits are not finite (nan)" in str(e.value)
    assert not (tmp_path / "run").exists()
