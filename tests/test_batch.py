"""Batched decoding (gen.batch_size > 1): every row's output is its batch-1 output.

Greedy equality per row against the same decoder on the prompt alone (tokens and step counts),
over methods, batch sizes 2, 3 and 8, mixed prompt lengths and rows that stop early; on tiny
random models and on real SmolLM2 prompts of all three datasets. Sampling: each row draws from
its own seeded stream, so its sampled output is its batch-1 one too, and its distribution is
checked against the target's exact one.
"""
import json
import random

import pytest
import torch

from bench.prompts import render
from decoders.core.batch import decode_batch, latencies
from decoders.core.sampling import Sampling
from decoders.methods.autoregressive import Autoregressive, autoregressive_decode, logit_gap
from decoders.methods.bpd import BPD
from decoders.methods.draft_model import SelfDraft
from decoders.methods.dflash import DFlash
from decoders.methods.eagle import Eagle
from decoders.methods.jacobi import Jacobi
from decoders.methods.lookahead import Lookahead
from decoders.methods.medusa import Medusa
from decoders.methods.prompt_lookup import PromptLookupDecoding
from decoders.methods.recycling import Recycling
from decoders.methods.sequoia import Sequoia
from decoders.methods.spec_chain import SpecChain
from decoders.methods.specinfer import SpecInfer
from decoders.methods.suffix import Suffix
from helpers import chi2_pvalue, first_quick, greedy_reference, run_cli, tiny_lm
from test_heads import tiny_ngram  # noqa: F401  (fixture)

GREEDY = Sampling()

BATCHED = {
    "autoregressive": Autoregressive(),
    "spec_chain-4": SpecChain(draft=SelfDraft(layers=1), depth=4),
    "spec_chain-1": SpecChain(draft=SelfDraft(layers=1), depth=1),
    "medusa-auto-16": Medusa(tree_size=16),
    "medusa-list-seed2": Medusa(choices=[[0], [1], [0, 0], [2], [0, 1], [0, 0, 0]], num_heads=3, heads_seed=2),
    "lookahead-5-4-5": Lookahead(window=5, ngram=4, guess_set_size=5),
    "lookahead-2-3-2": Lookahead(window=2, ngram=3, guess_set_size=2),
    "eagle-dynamic-10-3-4-seed1": Eagle(draft_weights=None, draft_seed=1, tree_size=10, depth=3, top_k=4),
    "eagle-static-16-4-4-seed4": Eagle(draft_weights=None, draft_seed=4, tree="static", tree_size=16, depth=4, top_k=4),
    "dflash-tree-6-8-3-seed2": DFlash(draft_weights=None, draft_seed=2, block_size=6, tree_size=8, top_k=3),
    "dflash-chain-4-seed1": DFlash(draft_weights=None, draft_seed=1, tree="chain", block_size=4),
    "prompt_lookup-10-2": PromptLookupDecoding(num_tokens=10, max_ngram=2),
    "jacobi-4": Jacobi(block_size=4),
    "recycling-cold-16-4-4": Recycling(tree_size=16, depth=4, successors=4, hot_start=False),
    "suffix-request-only": Suffix(use_global=False),  # the global trie makes a row's drafts depend on the batch
    "specinfer-2x3": SpecInfer(draft=SelfDraft(layers=1), num_drafts=2, depth=3),
    "sequoia-8-3": Sequoia(draft=SelfDraft(layers=1), budget=8, depth=3, auto_tokens=16),
    "bpd-3-seed1": BPD(num_heads=3, heads_seed=1),
    "bpd-p3-seed1": BPD(num_heads=3, heads_seed=1, paths=3, ranks_per_head=3),
    "bpd-neural-p2-seed1": BPD(num_heads=3, heads_seed=1, rescore="neural", draft=SelfDraft(layers=1), paths=2,
                               ranks_per_head=3),
}


def mixed_prompts(seed: int, count: int, vocab: int = 64) -> list[list[int]]:
    """Prompts of 1 to 24 tokens, with repeats (so n-gram and lookup drafts hit)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        motif = [rng.randrange(6, vocab) for _ in range(rng.randrange(1, 5))]
        body = [rng.choice([*motif, rng.randrange(6, vocab)]) for _ in range(rng.randrange(1, 25))]
        prompts.append(body)
    return prompts


@pytest.mark.parametrize("batch", [2, 3, pytest.param(8, marks=pytest.mark.slow)])  # the quick run: 2 and 3, seed 0
@pytest.mark.parametrize("seed", first_quick([0, 1]))
@pytest.mark.parametrize("name", list(BATCHED))
def test_batched_rows_equal_batch_1(name, seed, batch):
    assert_rows_equal_batch_1(BATCHED[name], seed, batch)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [2, 3, 8])
def test_batched_bpd_ngram_rows_equal_batch_1(tiny_ngram, batch):  # noqa: F811
    """BPD's last lossless variant, the n-gram rescored lattice (its LM file is a fixture)."""
    assert_rows_equal_batch_1(BPD(num_heads=3, heads_seed=1, rescore="ngram", ngram=tiny_ngram, paths=2,
                                  ranks_per_head=3), 1, batch)


def assert_rows_equal_batch_1(decoder, seed, batch):
    lm = tiny_lm(seed=seed)
    prompts = mixed_prompts(seed * 10 + batch, batch)
    alone = [decoder.generate(lm, p, 20, GREEDY, set()) for p in prompts]
    # Rows stop early: the stop set holds a token one row emits at step 3 and another at its 10th token.
    stop = {alone[0].tokens[3], alone[-1].tokens[min(9, len(alone[-1].tokens) - 1)]}
    alone = [decoder.generate(lm, p, 20, GREEDY, stop) for p in prompts]
    gens, stats = decode_batch(decoder, lm, prompts, 20, [GREEDY] * batch, stop)
    assert any(len(g.tokens) < 20 for g in alone)
    for row, (gen, ref) in enumerate(zip(gens, alone)):
        assert gen.tokens == ref.tokens, (row, gen.tokens, ref.tokens)
        assert [s.committed for s in gen.steps] == [s.committed for s in ref.steps], row
        assert [s.forward_tokens for s in gen.steps] == [s.forward_tokens for s in ref.steps], row
        assert [s.context_tokens for s in gen.steps] == [s.context_tokens for s in ref.steps], row
    assert stats.steps == max(len(g.steps) for g in gens)
    assert stats.rows_per_step[0] == batch and stats.rows_per_step == sorted(stats.rows_per_step, reverse=True)
    assert 0 <= stats.padding_waste < 1
    # A row's latency is the wall time to its last token: no row outlasts the batch.
    assert max(latencies(gens)) <= stats.wall_s + 1e-6 and all(0 < g.ttft <= stats.wall_s for g in gens)


@pytest.mark.parametrize("name", ["autoregressive", "lookahead-5-4-5", "eagle-dynamic-10-3-4-seed1", "medusa-auto-16"])
def test_batched_rows_equal_batch_1_eager_attention(name):
    decoder = BATCHED[name]
    lm = tiny_lm(seed=2, attn="eager")
    prompts = mixed_prompts(7, 3)
    gens, _ = decode_batch(decoder, lm, prompts, 16, [GREEDY] * 3, set())
    assert [g.tokens for g in gens] == [decoder.generate(lm, p, 16, GREEDY, set()).tokens for p in prompts]


def test_batch_cache_keeps_each_rows_committed_slots():
    """keep_tail moves each row's kept slots to the front of the tail and hides the rest; row removal
    and compaction keep every row's valid keys, in order."""
    lm = tiny_lm(seed=0)
    cache = lm.new_batch_cache(3)
    feeds = [[7, 8, 9, 10], [11, 12], [13, 14, 15]]
    lm.forward_batch(feeds, cache, [range(len(f)) for f in feeds], [None] * 3, [[len(f) - 1] for f in feeds])
    keys = cache.hf.layers[0].keys.clone()  # (3, heads, 4, d): rows right-aligned
    cache.keep_tail(0, [[0, 2], [2, 3], [1, 3]])
    assert cache.lengths() == [2, 2, 2] and len(cache) == 2
    layer = cache.hf.layers[0]
    assert torch.equal(layer.keys[0], keys[0][:, [0, 2]]) and torch.equal(layer.keys[1], keys[1][:, [2, 3]])
    cache.select_rows([0, 2])
    assert torch.equal(cache.hf.layers[0].keys[1], keys[2][:, [1, 3]]) and cache.lengths() == [2, 2]
    # Next forward: row 0 feeds 3 tokens, row 1 one; row 1 keeps nothing new but its root.
    lm.forward_batch([[1, 2, 3], [4]], cache, [range(2, 5), range(2, 3)], [None] * 2, [[2], [0]])
    cache.keep_tail(2, [[0, 1, 2], [2]])
    assert cache.lengths() == [5, 3] and cache.valid[1].tolist() == [True, True, True, False, False]


def test_rows_that_stop_at_once_and_a_single_row():
    lm = tiny_lm(seed=3)
    prompts = mixed_prompts(3, 4)
    gens, stats = decode_batch(Autoregressive(), lm, prompts, 1, [GREEDY] * 4, set())
    assert [len(g.tokens) for g in gens] == [1] * 4 and stats.steps == 1
    gens, _ = decode_batch(SpecChain(draft=SelfDraft(layers=1), depth=3), lm, prompts[:1], 12, [GREEDY], set())
    assert gens[0].tokens == autoregressive_decode(lm, prompts[0], 12, GREEDY, set()).tokens


@pytest.mark.parametrize("name", ["autoregressive", "spec_chain-4", "lookahead-5-4-5", "eagle-dynamic-10-3-4-seed1"])
def test_each_row_stops_at_its_own_limit(name):
    """A row's max_new_tokens may be its own (a long prompt's is cut by the
    context); each row is then what the decoder gives its prompt alone at that limit."""
    lm, decoder = tiny_lm(seed=5), BATCHED[name]
    prompts, limits = mixed_prompts(5, 3), [3, 12, 7]
    gens, _ = decode_batch(decoder, lm, prompts, limits, [GREEDY] * 3, set())
    assert [len(g.tokens) for g in gens] == limits
    for prompt, limit, gen in zip(prompts, limits, gens):
        assert gen.tokens == decoder.generate(lm, prompt, limit, GREEDY, set()).tokens


@pytest.mark.parametrize("name", ["autoregressive", "spec_chain-4", "lookahead-5-4-5", "eagle-dynamic-10-3-4-seed1",
                                  "specinfer-2x3", "sequoia-8-3", "bpd-neural-p2-seed1"])
def test_sampled_rows_draw_their_own_streams(name):
    """At T > 0 a row's draws come from its own generator in its own order: the batched row is the
    row alone, draw for draw."""
    decoder = BATCHED[name]
    lm = tiny_lm(seed=1, init_std=0.05)
    prompts = mixed_prompts(5, 3)
    samplings = [Sampling(temperature=0.9, top_p=0.95, seed=s) for s in (11, 12, 13)]
    gens, _ = decode_batch(decoder, lm, prompts, 16, samplings, set())
    assert [g.tokens for g in gens] == [decoder.generate(lm, p, 16, s, set()).tokens
                                        for p, s in zip(prompts, samplings)]


@pytest.mark.slow
def test_sampled_batch_keeps_the_target_distribution_per_row():
    """Batched speculative sampling (spec_chain, depth 2): each row's first two tokens follow the
    target's exact joint distribution (enumerated over a 16-token vocabulary)."""
    lm = tiny_lm(seed=4, vocab=16, init_std=0.3)
    decoder = SpecChain(draft=SelfDraft(layers=1), depth=2)
    prompts = [[3, 4, 5], [9]]
    exact = []
    for p in prompts:
        first = torch.softmax(lm.forward(p, lm.new_cache(), last_only=True)[-1].double(), -1)
        joint = torch.stack([first[a]
                             * torch.softmax(lm.forward([*p, a], lm.new_cache(), last_only=True)[-1].double(), -1)
                             for a in range(16)])
        exact.append(joint)
    counts = [torch.zeros(16, 16) for _ in prompts]
    for seed in range(1500):
        gens, _ = decode_batch(decoder, lm, prompts, 2,
                               [Sampling(temperature=1.0, seed=seed * 2 + r) for r in range(2)], set())
        for r, g in enumerate(gens):
            counts[r][g.tokens[0], g.tokens[1]] += 1
    for r in range(2):
        assert chi2_pvalue(counts[r], exact[r]) > 1e-3, r
    # Negative control: the second token drawn from the first token's distribution instead is caught.
    wrong = torch.outer(exact[1].sum(1), exact[1].sum(1))
    assert chi2_pvalue(counts[1], wrong / wrong.sum()) < 1e-3


SMOLLM_DECODERS = ["autoregressive", "spec_chain", "medusa", "lookahead", "eagle", "specinfer", "bpd"]
# Medusa at a fixed size: its default, tree_size=auto, would first time SmolLM2's forwards of 1..65 tokens on
# this device (90 s on a Zen 3, once per machine and fast path); auto is tested on tiny-random (test_heads.py).
SMOLLM_OVERRIDES = {"medusa": ["decoder.tree_size=32"]}


@pytest.fixture(scope="module")
def real_prompts(smollm, data_dir):
    from bench.datasets import GSM8K, HumanEval, MTBench
    from bench.prompts import rendering_for

    rendering = rendering_for(smollm.tokenizer, "auto")
    prompts = []
    for dataset in (MTBench(data_dir=str(data_dir), limit=2), HumanEval(limit=2),
                    GSM8K(data_dir=str(data_dir), limit=2)):
        prompts += [render(smollm.tokenizer, p, 0, [], rendering)[1] for p in dataset.load()]
    return prompts


@pytest.mark.parametrize("name", SMOLLM_DECODERS)
def test_smollm2_batched_rows_equal_autoregressive_greedy(name, smollm, real_prompts):
    """Six real prompts (MT-Bench, HumanEval, GSM8K; 2 each, lengths differ) in one batch: every row
    is autoregressive greedy's output for its prompt alone (other batch sizes: the tiny-random tests
    above). A departure must be a float near-tie (the batched GEMM sums in another order): its logit
    gap is reported."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from helpers import REPO
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        decoder = instantiate(compose("config", overrides=[f"decoder={name}", *SMOLLM_OVERRIDES.get(name, [])]).decoder,
                              _convert_="all")
    reference = [greedy_reference(smollm, p, 24, smollm.stop_ids).tokens for p in real_prompts]
    gens, _ = decode_batch(decoder, smollm, real_prompts, 24, [GREEDY] * len(real_prompts), smollm.stop_ids)
    for j, (gen, ref, ids) in enumerate(zip(gens, reference, real_prompts)):
        if gen.tokens != ref:
            at = next(k for k, (a, b) in enumerate(zip(gen.tokens, ref)) if a != b)
            gap = logit_gap(smollm, list(ids) + ref[:at])
            pytest.fail(f"{name} row {j} departs at token {at}; logit gap there {gap:.2e}")


BAD_BATCH = [("gen.batch_size=0", "gen.batch_size must be an integer >= 1, got 0"),
             ("gen.batch_size=-2", "gen.batch_size must be an integer >= 1, got -2"),
             ("gen.batch_size=2.5", "gen.batch_size must be an integer >= 1, got 2.5"),
             ("gen.batch_size=two", "gen.batch_size must be an integer >= 1, got 'two'")]


@pytest.mark.slow
@pytest.mark.parametrize("override,message", BAD_BATCH + [
    ("decoder=hf_generate gen.batch_size=2",
     "decoder hf_generate decodes one prompt at a time, so gen.batch_size must be 1")])
def test_bad_batch_size_is_one_line_and_exit_2(tmp_path, override, message):
    out = run_cli("model=tiny-random", *override.split(), f"hydra.run.dir={tmp_path}")
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1 and message in lines[0], out.stderr
    assert "Traceback" not in out.stderr + out.stdout


@pytest.mark.slow
def test_runner_batches_two_turn_conversations_and_resumes(tmp_path):
    """MT-Bench (two turns) at batch_size=2: first turns batched before second turns, every record
    lossless (checked against autoregressive alone), the batch's totals kept; resuming does nothing
    more; the tokens are batch_size=1's."""
    common = ["model=tiny-random", "dataset=mt_bench", "dataset.limit=3", "gen.max_new_tokens=12", "quality=false",
              "progress=false", "decoder=lookahead"]
    out = tmp_path / "b2"
    result = run_cli(*common, "gen.batch_size=2", "check_lossless=true", f"hydra.run.dir={out}")
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert [r["turn"] for r in records] == [0, 0, 0, 1, 1, 1]
    assert all(r["status"] == "ok" and r["lossless"] for r in records)
    assert records[0]["batch"]["id"] == records[1]["batch"]["id"] != records[2]["batch"]["id"]
    assert {r["batch"]["size"] for r in records} == {2} and records[2]["batch"]["rows"] == 1
    summary = (out / "summary.csv").read_text()
    assert "throughput_tokens_per_s" in summary and "padding_waste" in summary
    again = run_cli(*common, "gen.batch_size=2", "check_lossless=true", f"hydra.run.dir={out}", "resume=true")
    assert again.returncode == 0 and (out / "records.jsonl").read_text().count("\n") == 6
    single = tmp_path / "b1"
    assert run_cli(*common, f"hydra.run.dir={single}").returncode == 0
    alone = {json.loads(line)["key"]: json.loads(line)["tokens"]
             for line in (single / "records.jsonl").read_text().splitlines()}
    assert {r["key"]: r["tokens"] for r in records} == alone
