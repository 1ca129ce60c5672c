"""Train Medusa-style heads on a frozen target (self-distillation), for decoder=medusa and decoder=bpd.

    python scripts/train_heads.py [--heads 4] [--steps 400] [--seq-len 128] [--batch 4] [--lr 1e-3]
        [--readout-vocab full] [--out adapters/<model>-heads4.safetensors] [--device auto] [--dtype auto] [model=...]

Head i (decoders/methods/heads.py) reads the hidden state at position t and predicts the token at
t + i + 2. Loss: KL(target's distribution for that token || head's), where the target's
distribution is its own next-token prediction at position t + i + 1 (so the heads learn what
the model would say, which is what verification accepts), weighted 0.8^i as in Medusa. One
frozen forward per batch gives both the hidden states and the teacher's logits; only the
heads' residual blocks train (the output projection is the model's own, tied and frozen).
With --readout-vocab (auto: adapters/<model>-vocab.json, as decoder.readout_vocab=auto reads it) the
heads train and are measured over those tokens only, as they then decode: both distributions are
renormalised over its rows (a 262k-token vocabulary's four readouts per position cost more than
the target's forward).

Data (bench/training/corpus.py): stdlib source, GSM8K's train split and the target's own
answers to requests written for the script; none of it is from the benchmark test sets.
Every 10th self-distilled answer is held out: the script reports each head's top-r accuracy
there (rank r's token == the target's greedy token), stores it in the file (decoder.choices=auto
builds Medusa's tree from it), and writes a loss-curve PNG next to the heads.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from bench.__main__ import script_args
from bench.plotting import setup_of
from bench.training.corpus import corpus, fixed_chunks, frozen_target, split_answers
from bench.training.loss_curve import save_loss_curve
from bench.training.target import add_target_args, grad_scaler, optimizer_step, precision, target_overrides
from bench.usage import Parser
from decoders.core.lm import soft_cap
from decoders.core.weights_file import load_vocab
from decoders.methods.heads import new_heads, restrict_readout, save_heads

REPO = Path(__file__).resolve().parent.parent

RANKS = 10  # top-r accuracy recorded per head
MIX = {"generated": 0.5, "stdlib": 0.25, "gsm8k": 0.25}  # what decoding sees most: the model's own answers


def teacher(lm, batch: torch.Tensor, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Frozen forward: the teacher's log-probabilities (B, L, V), over `rows` of the vocabulary when
    given, and last hidden states (B, L, d)."""
    with torch.no_grad():
        out = lm.model(input_ids=batch, output_hidden_states=True, use_cache=False)
    logits = out.logits if rows is None else out.logits[..., rows.to(out.logits.device)]
    return F.log_softmax(logits.float(), -1), out.hidden_states[-1]


def head_loss(heads, hidden: torch.Tensor, teacher_logp: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
    """sum_i 0.8^i KL(teacher at t+i+1 || head i at t), over positions t with a target; over the
    heads' readout vocabulary where it is restricted (teacher_logp then over the same rows)."""
    total, parts = 0.0, []
    length = hidden.shape[1]
    readout = heads.readout[0] if heads.readout else heads.lm_head[0]
    for i, block in enumerate(heads.blocks):
        span = length - i - 1
        if span <= 0:
            break
        logits = soft_cap(readout(block(hidden[:, :span])), heads.cap).float()
        kl = F.kl_div(F.log_softmax(logits, -1).flatten(0, 1), teacher_logp[:, i + 1:].flatten(0, 1),
                      log_target=True, reduction="batchmean")
        total = total + 0.8 ** i * kl
        parts.append(float(kl.detach()))
    return total, parts


@torch.no_grad()
def accuracy(lm, heads, sequences: list[list[int]], ranks: int = RANKS) -> list[list[float]]:
    """acc[i][r]: how often head i's rank-r token is the target's greedy token at t + i + 2."""
    hits = torch.zeros(heads.k, ranks)
    total = torch.zeros(heads.k)
    for seq in sequences:
        ids = torch.tensor([seq], device=lm.device)
        with precision(lm):
            logp, hidden = teacher(lm, ids)
            greedy = logp[0].argmax(-1).cpu()  # greedy[t] = the target's token for position t + 1
            top = heads(hidden[0]).topk(ranks, dim=-1).indices.cpu()  # (K, L, ranks)
        for i in range(heads.k):
            span = len(seq) - i - 1
            if span <= 0:
                continue
            match = top[i, :span] == greedy[i + 1:i + 1 + span, None]
            hits[i] += match.float().sum(0)
            total[i] += span
    return (hits / total.clamp(min=1)[:, None]).tolist()


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    """This script's options, checked, and the Hydra overrides after them."""
    parser = Parser(__doc__, prog="python scripts/train_heads.py", overrides=True)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--gsm8k-questions", type=int, default=48, help="GSM8K train questions answered by the model")
    parser.add_argument("--answer-tokens", type=int, default=192)
    parser.add_argument("--readout-vocab", default="full",
                        help="full, auto (adapters/<model>-vocab.json) or a scripts/draft_vocab.py file: the tokens "
                             "the heads are trained and measured over (decoder.readout_vocab's)")
    parser.add_argument("--out", default=None, help="default: adapters/<model>-heads<K>.safetensors")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                        help="bfloat16 autocast for the matmuls of a float32 target (about 2x faster on CPUs with "
                             "AVX-512 BF16); a half-precision target runs in its own dtype")
    add_target_args(parser)
    args, overrides = script_args(parser)
    if args.heads < 1 or args.steps < 1:
        raise SystemExit(f"error: --heads and --steps must be >= 1, got {args.heads} and {args.steps}")
    return args, overrides


def training_sources(data: dict, generated: list[list[int]], seq_len: int) -> dict[str, list[list[int]]]:
    """Each of MIX's sources cut in chunks of `seq_len` tokens (the self-distilled answers as one stream)."""
    stream = [t for s in generated for t in s]
    return {"generated": fixed_chunks([stream], seq_len), "stdlib": fixed_chunks(data["stdlib"], seq_len),
            "gsm8k": fixed_chunks(data["gsm8k"], seq_len)}


def train(lm, heads, sources: dict[str, list[list[int]]], args: argparse.Namespace,
          rng: random.Random) -> list[list[float]]:
    """--steps optimizer steps, each on --batch chunks drawn from the sources as MIX weighs them;
    each step's KL per head."""
    heads.requires_grad_(True)
    heads.train()
    optimizer = torch.optim.AdamW(heads.parameters(), lr=args.lr, weight_decay=0.0)
    scaler = grad_scaler(lm)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, total_steps=args.steps, pct_start=0.05)
    losses = []
    bar = tqdm(range(args.steps), desc=f"{args.heads} heads")
    for _ in bar:
        names = rng.choices(list(MIX), weights=list(MIX.values()), k=args.batch)
        batch = torch.tensor([rng.choice(sources[n]) for n in names], device=lm.device)
        with precision(lm, args.bf16):
            logp, hidden = teacher(lm, batch, heads.readout_ids)
            loss, parts = head_loss(heads, hidden.float(), logp)
        optimizer_step(scaler, optimizer, loss)
        schedule.step()
        losses.append(parts)
        recent = losses[-20:]
        bar.set_postfix(kl=" ".join(f"{sum(p[i] for p in recent) / len(recent):.2f}" for i in range(len(parts))))
    return losses


def print_gains(before: list[list[float]], after: list[list[float]]) -> None:
    """Each head's held-out top-1 and top-5 accuracy, untrained -> trained."""
    for i in range(len(after)):
        print(f"head {i} (token t+{i + 2}): top-1 {before[i][0]:.3f} -> {after[i][0]:.3f}, "
              f"top-5 {sum(before[i][:5]):.3f} -> {sum(after[i][:5]):.3f}", flush=True)


def heads_info(model: str, args: argparse.Namespace, sources: dict[str, list[list[int]]], losses: list[list[float]],
               *, seconds: float, before: list[list[float]], after: list[list[float]], readout: dict) -> dict:
    """What the heads file records of its making: settings, data, time, held-out accuracy (over the
    readout vocabulary `readout` names, load_vocab's) and final KL."""
    return {"model": model, "heads": args.heads, "steps": args.steps, "batch": args.batch,
            "readout_vocab": readout["readout_vocab"],
            "seq_len": args.seq_len, "lr": args.lr, "mix": MIX, "chunks": {k: len(v) for k, v in sources.items()},
            "data": "Python stdlib source (train split), GSM8K train split, the model's own greedy answers to "
                    "requests written for bench/training/corpus.py (every 10th held out)",
            "seconds": round(seconds, 1), "accuracy": [[round(a, 4) for a in row] for row in after],
            "accuracy_untrained": [[round(a, 4) for a in row] for row in before],
            "final_kl": [round(sum(p[i] for p in losses[-20:]) / len(losses[-20:]), 4) for i in range(args.heads)],
            "command": " ".join(["python", "scripts/train_heads.py", *sys.argv[1:]])}


def main() -> None:
    args, overrides = parse_args()
    cfg, lm = frozen_target(target_overrides(args, overrides), args.seed)
    rng = random.Random(args.seed)
    out = Path(args.out or REPO / "adapters" / f"{cfg.model.name}-heads{args.heads}.safetensors")

    start = time.perf_counter()
    data = corpus(lm, cfg.model.name, cfg.data_dir, cfg.cache_dir, n_gsm8k=args.gsm8k_questions,
                  answer_tokens=args.answer_tokens)
    generated, heldout = split_answers(data)
    sources = training_sources(data, generated, args.seq_len)
    print("train chunks of " + str(args.seq_len) + " tokens: " + ", ".join(f"{k} {len(v)}" for k, v in sources.items())
          + f"; held out: {len(heldout)} self-distilled answers", flush=True)

    heads = new_heads(lm, args.heads).float()  # float32 master weights; forwards run under precision()
    tokens, readout = load_vocab(lm, args.readout_vocab, "--readout-vocab")
    if tokens is not None:
        restrict_readout(lm, heads, tokens)
    before = accuracy(lm, heads, heldout)
    losses = train(lm, heads, sources, args, rng)
    heads.eval()
    after = accuracy(lm, heads, heldout)
    seconds = time.perf_counter() - start
    print_gains(before, after)
    print(f"{seconds / 60:.1f} min in all", flush=True)

    save_heads(heads, out, heads_info(cfg.model.name, args, sources, losses, seconds=seconds, before=before,
                                      after=after, readout=readout))
    save_loss_curve(out, {f"head {i} (t+{i + 2})": [p[i] for p in losses] for i in range(args.heads)},
                    "KL(target || head)", f"{cfg.model.name}: Medusa heads", setup_of(lm))

if __name__ == "__main__":
    main()
