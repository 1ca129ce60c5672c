"""decoder=oracle (decoders/methods/oracle.py): drafts the target's own greedy continuation, each first
child right with probability `acceptance`. Its steps commit what the acceptance says they should
(every draft at 1, none at 0, 1 + sum p^i on average), repeatably; its pre-pass is outside the timed
run; sampling is refused. Tiny-random only."""
import dataclasses
import math

import pytest

from bench.errors import BenchError
from bench.runner import RunContext, check_config, run_unit
from decoders.core.sampling import Sampling
from decoders.core.tree import published_trees
from decoders.methods import oracle as oracle_module
from decoders.methods.autoregressive import autoregressive_decode
from decoders.methods.oracle import Oracle
from helpers import run_cli, tiny_lm
from test_runner import PROMPT, CharTokenizer, NoQuality, config

GREEDY = Sampling()
PROMPTS = [[5, 9, 2, 31], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]


def decode(decoder: Oracle, lm, prompt, max_new_tokens: int = 40, *, check_reference: bool = True):
    """The oracle's Generation, checked against autoregressive greedy's tokens (decoded again unless
    check_reference=False) and the continuation it foresaw (steps' info: off_reference)."""
    out = decoder.generate(lm, prompt, max_new_tokens, GREEDY, set())
    if check_reference:
        assert out.tokens == autoregressive_decode(lm, prompt, max_new_tokens, GREEDY, set()).tokens
    assert not any(s.info for s in out.steps), "the output left the foreseen continuation"
    return out


@pytest.mark.parametrize("k", [1, 3, 6])
def test_every_draft_right_commits_k_plus_one_a_step(k):
    """acceptance=1, chain of k: after the prefill (one token, nothing drafted) every step commits
    k + 1 tokens but the last, which commits what is left of max_new_tokens."""
    lm = tiny_lm(seed=1)
    for prompt in PROMPTS:
        steps = decode(Oracle(acceptance=1.0, depth=k), lm, prompt).steps
        assert steps[0].committed == 1 and steps[0].draft_tokens == 0
        assert [s.committed for s in steps[1:-1]] == [k + 1] * (len(steps) - 2)
        assert [s.accepted_draft_tokens for s in steps[1:-1]] == [k] * (len(steps) - 2)
        assert 1 <= steps[-1].committed <= k + 1 and sum(s.committed for s in steps) == 40


def test_no_draft_right_commits_one_token_a_step():
    """The negative control: acceptance=0 drafts k tokens a step (the width is paid) and every
    step commits one token, the target's own."""
    lm = tiny_lm(seed=1)
    for prompt in PROMPTS:
        steps = decode(Oracle(acceptance=0.0, depth=4), lm, prompt).steps
        assert [s.committed for s in steps] == [1] * 40
        assert all(s.accepted_draft_tokens == 0 for s in steps)
        assert [s.draft_tokens for s in steps[1:]] == [min(4, 40 - i - 1) for i in range(1, 40)]


def truncated_geometric(p: float, k: int) -> tuple[float, float]:
    """Mean and variance of the drafts accepted in a step of a chain of k, each right with probability
    p independently: P(accepted >= i) = p^i, so E = sum_i p^i and E[A^2] = sum_i (2i - 1) p^i."""
    mean = sum(p ** i for i in range(1, k + 1))
    return mean, sum((2 * i - 1) * p ** i for i in range(1, k + 1)) - mean ** 2


def test_mean_accepted_length_matches_the_acceptance():
    """p = 0.5, chain of 4: over ~1600 full steps (prefill and the steps cut short by the budget left
    out) the mean tokens a step commits is 1 + sum_{i=1..4} 0.5^i = 1.9375, within 4 standard errors
    of the truncated geometric's (sd 1.20: +-0.12 here); an acceptance off by 0.1 (1.65, 2.31 for
    p = 0.4, 0.6) lies outside. One foreseen continuation (the output equals it: no off_reference),
    decoded under several seeds."""
    lm = tiny_lm(seed=2, layers=1, hidden=32)
    prompt, p, k = [3, 14, 15, 9, 26], 0.5, 4
    base = Oracle(acceptance=p, depth=k)
    committed = []
    for seed in range(4):  # dataclasses.replace keeps the foreseen continuation (_truth) and changes the draws
        steps = decode(dataclasses.replace(base, seed=seed), lm, prompt, 800, check_reference=False).steps
        committed += [s.committed for s in steps[1:] if s.draft_tokens == k]
    mean, var = truncated_geometric(p, k)
    assert base.tuning["expected_tokens"] == 1 + mean == 1.9375
    tolerance = 4 * math.sqrt(var / len(committed))
    assert len(committed) >= 1500 and tolerance < 0.15
    measured = sum(committed) / len(committed)
    assert abs(measured - (1 + mean)) < tolerance, f"{measured:.3f} tokens a step over {len(committed)} steps"


def test_a_tree_accepts_along_its_first_children():
    """A published tree: every node is drafted (the width is paid) and, at acceptance 1, a step commits
    the first children's path and the bonus; the tree cut by depth drafts only its shallower paths."""
    lm = tiny_lm(seed=1)
    whole = Oracle(acceptance=1.0, tree="eagle/mc_sim_7b_63", depth=5)
    cut = Oracle(acceptance=1.0, tree="medusa/mc_sim_7b_63", depth=2)
    assert (whole.tuning["draft_nodes"], whole.tuning["expected_tokens"]) == (25, 6)
    medusa_two = [p for p in published_trees()["medusa"]["mc_sim_7b_63"] if len(p) <= 2]
    assert (cut.tuning["draft_nodes"], cut.tuning["expected_tokens"], cut.tuning["depth"]) == (len(medusa_two), 3, 2)
    for decoder, nodes, per_step in [(whole, 25, 6), (cut, len(medusa_two), 3)]:
        steps = decode(decoder, lm, PROMPTS[0], 40).steps
        full = steps[1:-1]
        assert [s.draft_tokens for s in full] == [nodes] * len(full)
        assert [s.committed for s in full] == [per_step] * len(full)


def test_the_seed_repeats_the_draws():
    lm = tiny_lm(seed=1)
    runs = [[s.committed for s in decode(Oracle(acceptance=0.5, seed=seed), lm, PROMPTS[0]).steps]
            for seed in (7, 7, 8)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_the_pre_pass_is_outside_the_timed_run(monkeypatch):
    """The runner foresees before the prompt's clock: a pre-pass made 0.5 s slower leaves latency_s
    under it, and the record says what the oracle was set to and what it should commit a step."""
    import time

    slow_calls = []

    def slow_pre_pass(*args):
        slow_calls.append(1)
        time.sleep(0.5)
        return autoregressive_decode(*args)

    monkeypatch.setattr(oracle_module, "autoregressive_decode", slow_pre_pass)
    lm = tiny_lm(seed=3, eos=1)
    lm.tokenizer, lm.stop_ids = CharTokenizer(), frozenset()
    decoder = Oracle(name="oracle", acceptance=1.0, depth=3)
    record = run_unit(RunContext(lm, decoder, NoQuality(), "raw", config(), GREEDY), PROMPT, 0, [])
    assert slow_calls == [1] and record["latency_s"] < 0.5
    assert record["lossless"] is True and record["tuned"]["expected_tokens"] == 4


def test_bad_settings_are_one_line():
    for kwargs, message in [(dict(acceptance=1.5), "decoder.acceptance must be a number from 0 to 1"),
                            (dict(acceptance="high"), "decoder.acceptance must be a number from 0 to 1"),
                            (dict(depth=0), "decoder.depth must be an integer >= 1"),
                            (dict(tree="eagle"), "decoder.tree must be chain or a published tree (eagle/mc_sim_7b_63"),
                            (dict(seed=-1), "decoder.seed must be an integer >= 0")]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            Oracle(**kwargs)


def test_sampling_is_refused_before_a_model_loads():
    from hydra import compose, initialize_config_dir

    from bench.registry import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["decoder=oracle", "model=tiny-random", "gen.temperature=0.7"])
    with pytest.raises(BenchError, match="decoder oracle decodes greedily only: gen.temperature must be 0, got 0.7"):
        check_config(cfg)
    with pytest.raises(ValueError, match="gen.temperature must be 0"):
        Oracle(name="oracle").generate(tiny_lm(), [1, 2], 4, Sampling(temperature=0.7), set())


@pytest.mark.slow
def test_sampling_is_refused_on_the_command_line(tmp_path):
    out = run_cli("decoder=oracle", "model=tiny-random", "gen.temperature=0.7", f"hydra.run.dir={tmp_path / 'run'}")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "gen.temperature must be 0, got 0.7" in lines[0] and not (tmp_path / "run").exists()


def test_batched_rows_decode_what_they_foresaw():
    """decode_batch (gen.batch_size > 1) builds each row's proposer from its foreseen continuation, as
    run_batch foresees them before the batch's clock; a row nobody foresaw is one clear error, not a
    pre-pass inside the timed batch."""
    from decoders.core.batch import decode_batch

    lm = tiny_lm(seed=1)
    decoder = Oracle(name="oracle", acceptance=0.5)
    for prompt in PROMPTS[:2]:
        decoder.foresee(lm, prompt, 12, set())
    gens, _ = decode_batch(decoder, lm, PROMPTS[:2], 12, [GREEDY] * 2, set())
    assert [g.tokens for g in gens] == [decoder.generate(lm, p, 12, GREEDY, set()).tokens for p in PROMPTS[:2]]
    with pytest.raises(ValueError, match="no continuation foreseen for this prompt"):
        decode_batch(decoder, lm, [PROMPTS[2]], 12, [GREEDY], set())


def test_it_is_no_default_leaderboard_entry():
    """Registered by its YAML (the greedy-equality and layout tests take it), but on a leaderboard only when named."""
    from bench.registry import decoder_configs, store_leaderboard_entries

    assert "oracle" in decoder_configs() and "oracle" not in store_leaderboard_entries()


@pytest.mark.slow
def test_a_batched_run_from_the_command_line(tmp_path):
    """python -m bench: foreseen per row before the batch, lossless, the records say what it was set to."""
    import json

    out = run_cli("decoder=oracle", "decoder.acceptance=1.0", "decoder.depth=3", "model=tiny-random", "dataset=gsm8k",
                  "dataset.limit=3", "gen.max_new_tokens=12", "gen.batch_size=2", "check_lossless=true",
                  "progress=false", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all(r["lossless"] and r["tuned"]["expected_tokens"] == 4 for r in records)
    assert all(set(r["trace"]["committed"][1:-1]) <= {4} for r in records)
