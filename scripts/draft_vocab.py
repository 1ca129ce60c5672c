"""A draft vocabulary for a target: the tokens Medusa / BPD heads may draft (decoder.readout_vocab).

    python scripts/draft_vocab.py [--size 8192] [--out adapters/smollm2-135m-vocab.json] [model=...]

The `--size` most frequent tokens of the training text (bench/training/corpus.py: the target's
own greedy answers, counted 10x, stdlib source and GSM8K's train split; nothing from the benchmark
test sets), as scripts/train_eagle.py chooses the EAGLE draft's. With them the heads' readout reads
those rows of the output layer instead of all of them; a token outside can never be drafted, so
the file records the coverage: the share of the target's greedy next tokens, at every position of
the held-out self-distilled answers, that the vocabulary holds (train_eagle.py's measure).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from bench.__main__ import script_args
from bench.training.corpus import OWN_WEIGHT, corpus, draft_vocabulary, fixed_chunks, frozen_target, split_answers
from bench.training.target import add_target_args, target_overrides
from bench.usage import Parser
from decoders.core.weights_file import VOCAB_FORMAT

REPO = Path(__file__).resolve().parent.parent


@torch.inference_mode()
def greedy_coverage(lm, vocab: list[int], sequences: list[list[int]]) -> float:
    """The share of the target's greedy next tokens, at every position of `sequences`, inside `vocab`."""
    inside = torch.zeros(lm.vocab_size, dtype=torch.bool)
    inside[vocab] = True
    covered = counted = 0
    for seq in sequences:
        greedy = lm.model(input_ids=torch.tensor([seq], device=lm.device), use_cache=False).logits[0].argmax(-1).cpu()
        covered += int(inside[greedy].sum())
        counted += len(greedy)
    return covered / max(counted, 1)


def main() -> None:
    parser = Parser(__doc__, prog="python scripts/draft_vocab.py", overrides=True)
    parser.add_argument("--size", type=int, default=8192, help="tokens kept (the EAGLE draft's is 8192)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--gsm8k-questions", type=int, default=48, help="GSM8K train questions answered by the model")
    parser.add_argument("--answer-tokens", type=int, default=192)
    parser.add_argument("--out", default=None,
                        help="default: adapters/<model>-vocab.json (what readout_vocab=auto reads)")
    add_target_args(parser)
    args, overrides = script_args(parser)
    if args.size < 1:
        raise SystemExit(f"error: --size must be >= 1, got {args.size}")
    cfg, lm = frozen_target(target_overrides(args, overrides), seed=0)
    start = time.perf_counter()
    data = corpus(lm, cfg.model.name, cfg.data_dir, cfg.cache_dir, n_gsm8k=args.gsm8k_questions,
                  answer_tokens=args.answer_tokens)
    generated, heldout = split_answers(data)
    own = fixed_chunks([[t for s in generated for t in s]], args.seq_len)
    other = fixed_chunks(data["stdlib"], args.seq_len) + fixed_chunks(data["gsm8k"], args.seq_len)
    vocab = draft_vocabulary(own, other, min(args.size, lm.vocab_size))
    coverage = greedy_coverage(lm, vocab, heldout)
    out = Path(args.out or REPO / "adapters" / f"{cfg.model.name}-vocab.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "format": VOCAB_FORMAT, "model": cfg.model.name, "vocab_size": lm.vocab_size, "size": len(vocab),
        "heldout_coverage": round(coverage, 4),
        "made_by": "scripts/draft_vocab.py " + " ".join(sys.argv[1:]),
        "data": {"self_distilled_chunks": len(own), "self_distilled_weight": OWN_WEIGHT,
                 "stdlib_gsm8k_chunks": len(other), "heldout_answers": len(heldout)},
        "tokens": vocab}) + "\n")
    print(f"{out}: {len(vocab)} of {lm.vocab_size} tokens; held-out greedy tokens inside: {coverage:.3f} "
          f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
