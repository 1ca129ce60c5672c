"""EAGLE-1's time per step outside the models: ours against its authors' own code.

    python results/reference/eagle_authors_overhead/eagle_authors_overhead.py [--prompts 8]
        [--max-new-tokens 128] [--prompt-len 32] [--noise 0.05] [--threads 2] [--fast-path none] [--split]
        [--out DIR]

The authors' `EaModel.eagenerate` (PyPI's eagle-llm 1.2.1: EAGLE-1 with its static mc_sim_7b_63
tree) and ours (decoder=eagle with tree=mc_sim_7b_63, built from conf/decoder/eagle.yaml and called
as a run builds and calls it) decode the same prompts with the same target weights and the same
draft weights: greedy, float32, on the CPU, in one process, interleaved (authors, ours, authors,
ours ...) after a warm-up each.

The target is a one-layer random Llama (hidden size 64, vocabulary 256, seed 0) whose forward is
nearly free, so that what is left is each method's own cost. Its embedding rows are scaled to unit
RMS, which makes its layer's input norm the identity, so a one-layer EAGLE-1 draft (no input norm,
fc over [embedding, features]) can copy it: the draft is that copy, fc passing the token's
embedding, with relative noise (--noise) so that it agrees with the target often but not always
(at 0.05 about 2.3 of at most 5 drafted tokens are accepted per step; even at 0 the copy is not
exact, since the draft never sees the prompt's first token). The draft is built with the
authors' module (decoders/methods/eagle1_layout.py) and both sides load the same file. Prompts are random
token ids (seeded).

Per method and prompt, milliseconds per verification step (the whole generate call, prefill
included, over the steps after the prefill):
  wall      the call
  target    the target's forward: authors, their LlamaModel and lm_head over its output;
            ours, the transformers model's forward (head included)
  draft     the draft's forward and readout: authors, cnets.Model and the lm_head calls inside
            topK_genrate; ours, the draft's forward, from_target (the final norm) and logits
  overhead  wall - target - draft, split into
    drafting  the rest of drafting: authors, topK_genrate; ours, the loop's draft region
              (propose and commit): tree building, top-k, masks, the draft cache
    rest      everything else: the tree's layout, verification, the target cache, bookkeeping
Printed and written as medians over the prompts (overhead and wall also with their minimum and
maximum), with the steps, the accepted draft tokens per step and whether every output equals the
target's own greedy output (autoregressive_decode), token for token. Writes
DIR/eagle_authors_overhead.csv and DIR/provenance.json. CPU only. --split also times each side's
step function by function (split_regions; DIR/eagle_authors_overhead_split.csv), to find where
one side spends more; its wrappers add to the overhead, so the headline comes from a run without.

The authors' code targets transformers 4; under transformers 5 it needs, for loading only (applied
here by patching at run time, never in site-packages; see authors_patches and load_authors):
  - a stub for the base model's tokenizer (EaModel reads only its eos_token_id; these prompts are ids);
  - the default rope_scaling read as None (transformers 5 always fills it, and the authors' code
    takes any value as a scaling to apply);
  - the target's rotary tables rebuilt after from_pretrained (their inv_freq buffer is not in a
    transformers checkpoint, and transformers 5 leaves it, and the cos / sin built from it,
    uninitialised).
Stubs for the Qwen or Mixtral modules that other eagle-llm versions import are not needed: 1.2.1
imports no Qwen module, and its modeling_mixtral_kv imports under transformers 5.24.
"""
from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pandas as pd
import torch
from omegaconf import OmegaConf

from bench import provenance
from bench.errors import BenchError, fail
from bench.models import TinyRandomModel
from bench.runner import build, load_addons
from decoders.core.lm import LM
from decoders.core.sampling import Sampling
from decoders.methods.autoregressive import autoregressive_decode
from decoders.methods.eagle1_layout import eagle1_reference_module, save_eagle1

REPO = Path(__file__).resolve().parents[3]

TREE = "mc_sim_7b_63"
VOCAB, HIDDEN, SEED = 256, 64, 0
CONTEXT = 2048  # the authors' target cache holds max_position_embeddings positions
COLUMNS = ["wall", "target", "draft", "overhead", "drafting", "rest"]  # ms per step


class Parser(argparse.ArgumentParser):
    def error(self, message):  # bad input ends in one line, exit 2, as everywhere in the harness
        fail(f"{self.prog}: {message}")


# ---- the target and the draft ------------------------------------------------------------------
def tiny_target(fast_path: str, save_to: Path) -> LM:
    """The one-layer target, its transformers checkpoint saved at `save_to` (what the authors load)."""
    spec = TinyRandomModel(num_layers=1, hidden_size=HIDDEN, num_heads=4, num_kv_heads=2,
                           intermediate_size=2 * HIDDEN, seed=SEED, device="cpu", dtype="float32")
    model = spec.build(VOCAB)  # no eos: neither side stops before max_new_tokens
    with torch.no_grad():  # unit-RMS rows: the layer's input norm leaves the embedding as it is
        emb = model.get_input_embeddings().weight
        emb.div_(emb.pow(2).mean(-1, keepdim=True).sqrt())
    model.save_pretrained(save_to)  # before the fast path, which may repack the linear layers
    return LM(model, name=f"tiny-random-{HIDDEN}x1", fast_path=fast_path)


def copying_draft(lm: LM, noise: float, save_to: Path) -> None:
    """An EAGLE-1 draft, in the authors' module and layout, that copies the target's layer: fc passes
    the token's embedding (the target's layer input, its norm being the identity) and the layer is the
    target's; then every tensor but the embedding gets Gaussian noise of `noise` times its own std."""
    model, config = eagle1_reference_module(lm, seed=1)
    d = config["hidden_size"]
    layer = lm.model.base_model.layers[0].state_dict()
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        model.fc.weight.copy_(torch.cat([torch.eye(d), torch.zeros(d, d)], 1))  # fc([embedding, features])
        model.fc.bias.zero_()
        for name, p in model.layers[0].named_parameters():  # no input_layernorm in the authors' layer 0
            p.copy_(layer[name])
        for name, p in model.named_parameters():
            if name != "embed_tokens.weight":
                p.add_(torch.randn(p.shape, generator=gen) * noise * p.std())
    save_eagle1(save_to, model, config)


# ---- the authors' code under transformers 5 -------------------------------------------------------
class NoTokenizer:
    """EaModel.__init__ loads the base model's tokenizer, and eagenerate reads only its eos_token_id
    (to stop): token-id prompts need none, and None stops at no token, as ours runs without stop ids."""

    eos_token_id = None

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        return cls()


def _default_rope_as_none(config):
    """transformers 5 always fills rope_scaling (as rope_parameters {'rope_type': 'default', ...});
    the authors' `_init_rope` (their target's attention, and cnets through EConfig) takes anything but
    None as a scaling and reads its 'type' (KeyError). The default one reads as None again."""
    rope = config.rope_parameters
    return None if not rope or rope.get("rope_type", "default") == "default" else rope


@contextmanager
def quiet():
    """transformers' progress bars and warnings off: its load report (the rotary buffers it did not
    find, rebuilt by load_authors) and the deprecation warnings of the authors' transformers-4 calls."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        transformers.logging.enable_progress_bar()


@contextmanager
def authors_patches():
    """The run-time patches EaModel.from_pretrained needs under transformers 5, undone on leaving."""
    from eagle.model import ea_model
    from transformers.configuration_utils import PreTrainedConfig

    rope = PreTrainedConfig.rope_scaling  # a property; its setter (EConfig sets None) stays
    with mock.patch.object(ea_model, "AutoTokenizer", NoTokenizer), \
            mock.patch.object(PreTrainedConfig, "rope_scaling", rope.getter(_default_rope_as_none)):
        yield


def load_authors(target_dir: Path, draft_dir: Path):
    """The authors' EaModel, loaded their way (from_pretrained: their patched Llama for the target,
    cnets.Model for the draft), with the target's rotary tables rebuilt: transformers 5 builds the
    model on the meta device, then gives its tensors memory and fills those the checkpoint holds
    (and those the class's _init_weights knows), so their inv_freq buffer (persistent in their
    class, absent from a transformers checkpoint) and the cos / sin tables their __init__ computed
    from it are uninitialised memory. Each rotary module is built again by the authors' own class,
    outside that context."""
    from eagle.model.ea_model import EaModel

    with authors_patches():
        model = EaModel.from_pretrained(base_model_path=str(target_dir), ea_model_path=str(draft_dir),
                                        dtype=torch.float32)
    for layer in model.base_model.model.layers:
        old = layer.self_attn.rotary_emb
        if type(old).__name__ != "LlamaRotaryEmbedding":
            raise RuntimeError(f"expected the authors' unscaled rotary embedding, got {type(old).__name__}")
        layer.self_attn.rotary_emb = type(old)(old.dim, max_position_embeddings=old.max_position_embeddings,
                                               base=old.base)
    return model.eval()


# ---- timing ---------------------------------------------------------------------------------------
class Clock:
    """Seconds per region of the current generation, and calls per counter, from the wrappers below."""

    def __init__(self):
        self.spent, self.calls, self.drafting = defaultdict(float), defaultdict(int), False

    def reset(self):
        self.spent.clear()
        self.calls.clear()

    def timed(self, region: str, fn, *, drafting: bool = False, counter: str | None = None):
        """`fn`, its time added to `region` (and its calls to `counter`); drafting=True marks the calls
        made inside it as drafting (the authors' draft reads its tokens with the target's head)."""
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            was = self.drafting
            self.drafting = was or drafting
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[region] += time.perf_counter() - start
                self.drafting = was
                if counter:
                    self.calls[counter] += 1
        return wrapper


def instrument_authors(clock: Clock, ea) -> None:
    ea.base_model.model.forward = clock.timed("target", ea.base_model.model.forward, counter="forwards")
    head = ea.base_model.lm_head  # the target's head, which the draft reads its tokens with too
    as_target, as_draft = clock.timed("target", head.forward), clock.timed("draft", head.forward)
    head.forward = lambda x: (as_draft if clock.drafting else as_target)(x)
    ea.ea_layer.forward = clock.timed("draft", ea.ea_layer.forward)
    ea.ea_layer.topK_genrate = clock.timed("drafting", ea.ea_layer.topK_genrate, drafting=True)


def instrument_ours(clock: Clock, lm: LM, draft) -> None:
    lm.model.forward = clock.timed("target", lm.model.forward, counter="forwards")
    for name in ("forward", "from_target", "logits"):
        setattr(draft, name, clock.timed("draft", getattr(draft, name)))


def split_regions(clock: Clock, ea, draft) -> ExitStack:
    """--split: each side's step function by function, by more wrappers (inclusive times: a function's
    time holds its callees'; the wrappers add a little to every step's overhead). Undone on leaving."""
    from eagle.model import ea_model

    from decoders.core import loop
    from decoders.core.kv_cache import KVCache
    from decoders.methods import eagle

    stack = ExitStack()

    def wrap(owner, name, region):
        stack.enter_context(mock.patch.object(owner, name, clock.timed(region, getattr(owner, name))))
    for name in ("initialize_tree", "generate_candidates", "tree_decoding", "evaluate_posterior",
                 "update_inference_inputs"):  # eagenerate's calls, through ea_model's globals
        wrap(ea_model, name, f"authors: {name}")
    wrap(ea.ea_layer, "_prepare_decoder_attention_mask", "authors: the draft's masks (in its forward)")
    wrap(ea.base_model.model, "_prepare_decoder_attention_mask", "authors: the target's mask (in its forward)")
    wrap(ea.ea_layer, "repeat_hidden", "authors: topK_genrate's repeat_hidden")
    for name in ("feed", "score", "verify"):  # speculative_decode's calls, through loop's globals
        wrap(loop, name, f"ours: loop.{name}")
    for name in ("keep", "crop"):
        wrap(KVCache, name, f"ours: KVCache.{name} (the target's and the draft's)")
    for name in ("_draft", "_static", "_feed", "commit"):
        wrap(eagle.FeatureDraftProposer, name, f"ours: proposer.{name}")
    wrap(eagle, "static_plan", "ours: static_plan (once per prompt and depth)")
    wrap(draft, "flops", "ours: draft.flops")
    return stack


@dataclass
class Measured:
    tokens: list[int]
    steps: int  # verification forwards (the prefill's forward not counted)
    accepted: int  # draft tokens accepted over those steps
    ms: dict  # COLUMNS -> ms per step
    regions: dict  # every clock region -> ms per step (--split's among them)


def per_step(wall: float, spent: dict, drafting: float, steps: int) -> dict:
    s = {"wall": wall, "target": spent["target"], "draft": spent["draft"]}
    s["overhead"] = wall - s["target"] - s["draft"]
    s["drafting"] = drafting - s["draft"]
    s["rest"] = s["overhead"] - s["drafting"]
    return {k: 1e3 * v / max(steps, 1) for k, v in s.items()}


def per_step_regions(clock: Clock, steps: int) -> dict:
    return {k: 1e3 * v / max(steps, 1) for k, v in clock.spent.items()}


def run_authors(ea, clock: Clock, prompt: list[int], n: int) -> Measured:
    clock.reset()
    start = time.perf_counter()
    # eagenerate stops once more than max_new_tokens tokens follow the prompt, not counting the next
    # step's root (chosen, not yet appended), which ours counts among its n: with n - 2 both stop after
    # the same step, and the authors' output holds n - 1 tokens or a few more.
    out = ea.eagenerate(torch.tensor([prompt]), max_new_tokens=n - 2, max_length=CONTEXT - 16)
    wall = time.perf_counter() - start
    tokens = out[0, len(prompt):].tolist()
    steps = clock.calls["forwards"] - 1  # the prefill is the first forward
    # each step appends its root and the draft tokens it accepted: len(tokens) = steps + accepted
    return Measured(tokens, steps, len(tokens) - steps, per_step(wall, clock.spent, clock.spent["drafting"], steps),
                    per_step_regions(clock, steps))


def run_ours(decoder, lm: LM, clock: Clock, prompt: list[int], n: int) -> Measured:
    clock.reset()
    lm.sync()
    start = time.perf_counter()
    gen = decoder.generate(lm, prompt, n, Sampling(), lm.stop_ids)  # as bench.runner calls it
    wall = time.perf_counter() - start
    steps = gen.steps[1:]  # the first is the prefill
    if clock.calls["forwards"] != len(gen.steps):
        raise RuntimeError(f"{clock.calls['forwards']} target forwards for {len(gen.steps)} steps")
    return Measured(gen.tokens, len(steps), sum(s.accepted_draft_tokens for s in steps),
                    per_step(wall, clock.spent, sum(s.draft_time for s in gen.steps), len(steps)),
                    per_step_regions(clock, len(steps)))


# ---- the comparison -------------------------------------------------------------------------------
def check_args(args) -> None:
    for key in ("prompts", "prompt_len", "threads"):
        if getattr(args, key) < 1:
            raise BenchError(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.max_new_tokens < 2:
        raise BenchError(f"--max-new-tokens must be >= 2, got {args.max_new_tokens}")
    if args.prompt_len + args.max_new_tokens + 16 > CONTEXT:
        raise BenchError(f"--prompt-len + --max-new-tokens must stay under {CONTEXT - 16} (the authors' target "
                         f"cache holds {CONTEXT} positions), got {args.prompt_len + args.max_new_tokens}")
    if not 0 <= args.noise <= 10:
        raise BenchError(f"--noise must be between 0 and 10, got {args.noise}")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise BenchError(f"--out {args.out} exists and is not a directory")
    try:
        import eagle.model.ea_model  # noqa: F401
    except ImportError as e:
        raise BenchError(f"the authors' code is not importable ({e}): pip install --no-deps eagle-llm") from None


def summary(method: str, runs: list[Measured], lossless: list[bool]) -> dict:
    ms = {k: statistics.median(r.ms[k] for r in runs) for k in COLUMNS}
    row = {"method": method, "steps": statistics.median(r.steps for r in runs),
           "accepted_per_step": statistics.median(r.accepted / max(r.steps, 1) for r in runs),
           **{f"{k}_ms": v for k, v in ms.items()}}
    for k in ("wall", "overhead"):
        row[f"{k}_min_ms"] = min(r.ms[k] for r in runs)
        row[f"{k}_max_ms"] = max(r.ms[k] for r in runs)
    row["lossless"] = all(lossless)
    return row


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32, help="random token ids per prompt")
    parser.add_argument("--noise", type=float, default=0.05, help="the draft's noise, relative to each tensor's std")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--fast-path", choices=["none", "prepacked"], default="none",
                        help="our linear kernels (the authors' are torch's own, as none)")
    parser.add_argument("--split", action="store_true",
                        help="also time each side's step function by function (eagle_authors_overhead_split.csv)")
    parser.add_argument("--out", type=Path, help="directory for eagle_authors_overhead.csv and provenance.json")
    args = parser.parse_args(argv)
    check_args(args)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return compare(args)
    finally:
        torch.set_num_threads(threads)


def compare(args) -> pd.DataFrame:
    n = args.max_new_tokens
    gen = torch.Generator().manual_seed(SEED)
    prompts = [torch.randint(0, VOCAB, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts + 1)]
    warm, prompts = prompts[0], prompts[1:]
    with tempfile.TemporaryDirectory() as tmp, quiet():
        lm = tiny_target("none", Path(tmp) / "target")
        copying_draft(lm, args.noise, Path(tmp) / "draft")
        lm.set_fast_path(args.fast_path)
        ea = load_authors(Path(tmp) / "target", Path(tmp) / "draft")
        node = OmegaConf.merge(OmegaConf.load(REPO / "conf" / "decoder" / "eagle.yaml"),
                               {"draft_weights": str(Path(tmp) / "draft"), "tree": TREE, "cache_dir": None})
        decoder = build(node, "decoder")
        load_addons(decoder, lm)  # reads the draft file, as a run does before timing
        draft = decoder.load_addons(lm)
    # the target's own greedy output, longer than either side's (the authors' may pass n by a step)
    references = [autoregressive_decode(lm, p, n + 8, Sampling(), set()).tokens for p in prompts]
    info = provenance.collect(lm)  # before instrumenting: the commit, the CPU, threads, dtype
    info.update(eagle_llm=importlib.metadata.version("eagle-llm"),
                script_args={k: str(v) for k, v in vars(args).items()}, tree=TREE,
                target={"layers": 1, "hidden_size": HIDDEN, "vocab_size": VOCAB, "seed": SEED,
                        "embedding": "rows scaled to unit RMS"})
    where = (f"{lm.name} float32 on {info['device_name']}, {info['torch_threads']} threads, fast path {lm.fast_path}, "
             f"{len(prompts)} prompts of {args.prompt_len} ids x {n} tokens, draft noise {args.noise}")
    print(where, flush=True)
    clock = Clock()
    instrument_authors(clock, ea)
    instrument_ours(clock, lm, draft)
    sides = {"authors (eagle-llm eagenerate)": lambda p, k: run_authors(ea, clock, p, k),
             "ours (decoder=eagle)": lambda p, k: run_ours(decoder, lm, clock, p, k)}
    runs, lossless = defaultdict(list), defaultdict(list)
    with split_regions(clock, ea, draft) if args.split else ExitStack():
        with quiet():  # warm-up: first calls (the authors' cache and tree buffers, transformers' warnings)
            for run in sides.values():
                run(warm, min(n, 16))
        for i, (prompt, ref) in enumerate(zip(prompts, references)):
            for method, run in sides.items():  # interleaved: drift on a shared machine hits both alike
                m = run(prompt, n)
                runs[method].append(m)
                same = m.tokens == ref[:len(m.tokens)] and len(m.tokens) >= n - 1
                lossless[method].append(same)
                if not same:
                    at = next((j for j, (a, b) in enumerate(zip(m.tokens, ref)) if a != b), len(m.tokens))
                    print(f"NOT LOSSLESS: {method}, prompt {i}: {len(m.tokens)} tokens, the first differing at {at} "
                          f"({m.tokens[at:at + 3]} for the target's {ref[at:at + 3]})", file=sys.stderr, flush=True)
    table = pd.DataFrame([summary(method, runs[method], lossless[method]) for method in sides])
    shown = ["method", "steps", "accepted_per_step", *(f"{k}_ms" for k in COLUMNS), "overhead_min_ms",
             "overhead_max_ms", "lossless"]
    print("\nms per verification step, medians over prompts (overhead = wall - target - draft = drafting + rest)\n")
    print(table[shown].to_markdown(index=False, floatfmt=".3f"))
    ours, theirs = (table.set_index("method").iloc[i] for i in (1, 0))
    print(f"\noverhead, ours / authors: {ours['overhead_ms'] / theirs['overhead_ms']:.2f}; "
          f"wall: {ours['wall_ms'] / theirs['wall_ms']:.2f}")
    split = None
    if args.split:
        split = pd.DataFrame([{"region": region, "ms_per_step": statistics.median(m.regions[region] for m in ms)}
                              for ms in runs.values() for region in ms[0].regions if ": " in region])
        print("\n--split: ms per step inside each function (inclusive), medians over prompts\n")
        print(split.to_markdown(index=False, floatfmt=".3f"))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        table.assign(where=where).to_csv(args.out / "eagle_authors_overhead.csv", index=False)
        if split is not None:
            split.assign(where=where).to_csv(args.out / "eagle_authors_overhead_split.csv", index=False)
        (args.out / "provenance.json").write_text(json.dumps(info, indent=2) + "\n")
        print(f"\nwrote {args.out / 'eagle_authors_overhead.csv'}", file=sys.stderr)
    return table


if __name__ == "__main__":
    try:
        main()
    except BenchError as e:
        fail(e)
