"""Train the n-gram LM over token ids that decoder=bpd rescore=ngram uses.

    python scripts/train_ngram.py [--order 4] [--min-count 2] [--max-train-tokens N]
        [--out adapters/<model>-ngram4.json.gz] [model=...]

Same corpus as the heads (bench/training/corpus.py: stdlib source, GSM8K's train split, the
model's own answers; nothing from the benchmark test sets). Reports the held-out top-1 next-token
accuracy of the n-gram LM against the target's greedy token on the held-out self-distilled answers.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from bench.__main__ import script_args
from bench.training.corpus import corpus, split_answers
from bench.usage import Parser
from decoders.methods.ngram_lm import NgramLM

REPO = Path(__file__).resolve().parent.parent


def first_tokens(seqs: list[list[int]], n: int) -> list[list[int]]:
    """The sequences' first n tokens in all, the last one cut short."""
    kept = []
    for seq in seqs:
        if n <= 0:
            break
        kept.append(seq[:n])
        n -= len(kept[-1])
    return kept


def main() -> None:
    parser = Parser(__doc__, prog="python scripts/train_ngram.py", overrides=True)
    parser.add_argument("--order", type=int, default=4)
    parser.add_argument("--min-count", type=int, default=2, help="drop rarer n-grams of order >= 3")
    parser.add_argument("--gsm8k-questions", type=int, default=48)
    parser.add_argument("--answer-tokens", type=int, default=192)
    parser.add_argument("--max-train-tokens", type=int, default=None,
                        help="count n-grams over the corpus's first N tokens only (a quick run; default: all)")
    parser.add_argument("--out", default=None)
    args, overrides = script_args(parser)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    lm = instantiate(cfg.model, compile="none").load()
    out = Path(args.out or REPO / "adapters" / f"{cfg.model.name}-ngram{args.order}.json.gz")
    start = time.perf_counter()
    data = corpus(lm, cfg.model.name, cfg.data_dir, cfg.cache_dir, n_gsm8k=args.gsm8k_questions,
                  answer_tokens=args.answer_tokens)
    answers, heldout = split_answers(data)
    train = data["stdlib"] + data["gsm8k"] + answers
    if args.max_train_tokens is not None:
        train = first_tokens(train, args.max_train_tokens)
    ngram = NgramLM.train(train, args.order, lm.vocab_size, args.min_count)
    hits = total = 0
    for seq in heldout:  # next token of the model's own text, ranked by the n-gram LM among its seen continuations
        for i in range(1, len(seq)):
            ctx = seq[max(0, i - args.order + 1):i]
            best = None
            for m in range(len(ctx), -1, -1):
                seen = ngram.counts[m].get(tuple(ctx[len(ctx) - m:]))
                if seen:
                    best = max(seen, key=seen.get)
                    break
            hits += best == seq[i]
            total += 1
    seconds = time.perf_counter() - start
    info = {"model": cfg.model.name, "order": args.order, "min_count": args.min_count,
            "train_tokens": sum(map(len, train)), "ngrams": ngram.size(), "heldout_top1": round(hits / total, 4),
            "seconds": round(seconds, 1), "data": "as the heads: stdlib, GSM8K train, self-distilled answers",
            "command": " ".join(["python", "scripts/train_ngram.py", *sys.argv[1:]])}
    ngram.save(out, info)
    print(f"{info['train_tokens']} tokens, {info['ngrams']} n-grams kept; held-out top-1 {info['heldout_top1']:.3f}; "
          f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB) in {seconds:.0f} s")


if __name__ == "__main__":
    main()
