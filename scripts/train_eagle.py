"""Train an EAGLE feature draft on a frozen target (self-distillation), for decoder=eagle.

    python scripts/train_eagle.py [--chunks 1200] [--epochs 2] [--unroll 3] [--draft-vocab 8192]
        [--out adapters/smollm2-135m-eagle.safetensors] [--device auto] [--dtype auto] [model=...]

The draft (decoders/methods/eagle.py) reads the target's features at t and the embedding of token
t+1 and predicts the features at t+1. The target's features are computed once per chunk
(frozen, bf16 autocast) and reused every epoch. Losses, per level of unrolling:
- the target's next-token distribution (its head on its own features, over the draft vocabulary)
  against the draft's: KL, what verification accepts;
- smooth L1 between predicted and real features, in units of the features' RMS (EAGLE's regression).
Level 0 reads the real features; level j reads level j-1's predictions, attending to the real
positions before it and to its own earlier levels, as drafting at depth j + 1 does (EAGLE-3's
training-time test). Level j weighs 0.8^j.

The draft vocabulary is the `--draft-vocab` most frequent tokens of the training text (the model's
own answers counted 10x): the readout shrinks from the whole vocabulary to these rows.

Data (scripts/training_corpus.py), disjoint from the benchmark test sets: the model's own greedy
answers to requests written for the script (every 10th held out), stdlib source, GSM8K's train
split. On the held-out answers the script measures acc[j][r], how often the draft's rank-r token at
depth j + 1 (drafting along the true continuation) is the target's greedy token; it is stored in
the file (decoder.tree=static builds EAGLE-1's tree from it) and printed, with a loss curve PNG.
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
from transformers import DynamicCache

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from loss_curve import save_loss_curve  # noqa: E402
from decoders.core.kv_cache import KVCache  # noqa: E402
from decoders.methods.eagle import new_draft, save_draft  # noqa: E402
from training_corpus import corpus, draft_vocabulary, fixed_chunks, frozen_target, split_answers  # noqa: E402
from training_target import add_target_args, grad_scaler, optimizer_step, precision, target_overrides  # noqa: E402

RANKS = 10


@torch.no_grad()
def features(lm, ids: torch.Tensor, bf16: bool) -> torch.Tensor:
    """(B, L, d): the target's last layer's output before the final norm (what the draft reads)."""
    captured = {}
    handle = lm.final_norm.register_forward_pre_hook(lambda m, a: captured.update(f=a[0]))
    try:
        with precision(lm, bf16):
            lm.model(input_ids=ids.to(lm.device), use_cache=False, logits_to_keep=1)
    finally:
        handle.remove()
    return captured["f"].to(lm.output_device)  # the last layer's device, where the draft sits


def target_features(lm, chunks: list[list[int]], batch: int, bf16: bool) -> torch.Tensor:
    """Every chunk's features, computed once (bf16 to save memory) and reused every epoch."""
    return torch.cat([features(lm, torch.tensor(chunks[i:i + batch]), bf16).to(torch.bfloat16)
                      for i in tqdm(range(0, len(chunks), batch), desc="target features", unit="batch")])


def unrolled_levels(draft, feats: torch.Tensor, tokens: torch.Tensor, levels: int):
    """Level j's predictions (B, L-1, d): row t reads (level j-1's row t, or the real features at t
    for j = 0) and token t+1+j, at position t+j, seeing real rows <= t and its own earlier levels;
    it predicts the features at t+1+j. Rows whose token would fall past the chunk are padding."""
    length = feats.shape[1]
    n = length - 1
    cache = KVCache(DynamicCache())
    tril = torch.ones(n, n, dtype=torch.bool).tril()
    eye = torch.eye(n, dtype=torch.bool)
    inputs, out = feats[:, :-1], []
    for j in range(levels):
        idx = torch.arange(n) + 1 + j
        tok = tokens[:, idx.clamp(max=length - 1)]
        mask = torch.cat([tril] + [eye] * j, dim=1)
        g = draft(inputs, tok, torch.arange(n) + j, mask, cache)
        out.append(g)
        inputs = g
    return out


def level_losses(draft, feats, tokens, teacher_logp, scale: float, levels: int):
    """Per level: (KL over the draft vocabulary, smooth L1 in RMS units)."""
    n = feats.shape[1] - 1
    parts = []
    for j, g in enumerate(unrolled_levels(draft, feats.float(), tokens, levels)):
        rows = n - j  # row t predicts features at t+1+j <= L-1
        if rows <= 0:
            break
        g = g[:, :rows]
        real = feats[:, 1 + j:1 + j + rows].float()
        logp = torch.log_softmax(draft.logits(g).float(), -1)
        kl = F.kl_div(logp.flatten(0, 1), teacher_logp[:, 1 + j:1 + j + rows].flatten(0, 1), log_target=True,
                      reduction="batchmean")
        reg = F.smooth_l1_loss(g / scale, real / scale)
        parts.append((kl, reg))
    return parts


@torch.no_grad()
def teacher(draft, feats: torch.Tensor) -> torch.Tensor:
    """The target's log-probabilities over the draft vocabulary at every position (its head on its features)."""
    return torch.log_softmax(draft.logits(feats.float()).float(), -1)


@torch.no_grad()
def depth_accuracy(lm, draft, sequences: list[list[int]], depth: int, bf16: bool) -> tuple[list[list[float]], float]:
    """acc[j][r] on held-out sequences, and the share of the target's greedy tokens in the draft vocabulary."""
    hits = torch.zeros(depth, RANKS)
    total = torch.zeros(depth)
    covered = counted = 0
    in_vocab = torch.zeros(lm.vocab_size, dtype=torch.bool)
    in_vocab[draft.vocab] = True
    for seq in sequences:
        feats = features(lm, torch.tensor([seq]), bf16).float()
        with precision(lm):
            full = lm.model.get_output_embeddings()(lm.final_norm(feats))  # (1, L, V)
        greedy = full[0].argmax(-1).cpu()  # greedy[t]: the target's token after position t
        covered += int(in_vocab[greedy].sum())
        counted += len(greedy)
        ids = torch.tensor([seq])
        with precision(lm):
            levels = unrolled_levels(draft, feats, ids, depth)
        for j, g in enumerate(levels):
            rows = len(seq) - 1 - j - 1  # row t predicts the token after position t+1+j, which must exist
            if rows <= 0:
                break
            with precision(lm):
                top = draft.vocab[draft.logits(g[0, :rows]).topk(RANKS, -1).indices.cpu()]
            hits[j] += (top == greedy[1 + j:1 + j + rows, None]).float().sum(0)
            total[j] += rows
    return (hits / total.clamp(min=1)[:, None]).tolist(), covered / max(counted, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=1200,
                        help="stdlib + GSM8K chunks (beside all self-distilled ones)")
    parser.add_argument("--generated-repeats", type=int, default=3,
                        help="self-distilled chunks appear this often per epoch")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--unroll", type=int, default=3,
                        help="levels of drafting trained on (1 = EAGLE-1's teacher forcing)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--draft-vocab", type=int, default=8192, help="0: the whole vocabulary")
    parser.add_argument("--depth", type=int, default=6, help="depths measured on held-out text")
    parser.add_argument("--gsm8k-questions", type=int, default=48, help="GSM8K train questions answered by the model")
    parser.add_argument("--answer-tokens", type=int, default=192)
    parser.add_argument("--out", default=None, help="default: adapters/<model>-eagle.safetensors")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                        help="bfloat16 autocast for a float32 target's forward "
                             "(a half-precision one runs in its own dtype)")
    add_target_args(parser)
    args, overrides = parser.parse_known_args()
    for key in ("chunks", "epochs", "unroll", "batch", "depth"):
        if getattr(args, key) < 1:
            raise SystemExit(f"error: --{key} must be >= 1, got {getattr(args, key)}")
    cfg, lm = frozen_target(target_overrides(args, overrides), args.seed)
    lm.set_fast_path("none")  # training needs autograd through the draft's linears
    rng = random.Random(args.seed)
    out = Path(args.out or REPO / "adapters" / f"{cfg.model.name}-eagle.safetensors")

    start = time.perf_counter()
    data = corpus(lm, cfg.model.name, cfg.data_dir, cfg.cache_dir, args.gsm8k_questions, args.answer_tokens)
    generated, heldout = split_answers(data)
    own = fixed_chunks([[t for s in generated for t in s]], args.seq_len)
    other = fixed_chunks(data["stdlib"], args.seq_len) + fixed_chunks(data["gsm8k"], args.seq_len)
    rng.shuffle(other)
    other = other[:args.chunks]
    vocab = None
    if args.draft_vocab and args.draft_vocab < lm.vocab_size:
        vocab = draft_vocabulary(own, other, args.draft_vocab)
    print(f"train chunks of {args.seq_len} tokens: self-distilled {len(own)} (x{args.generated_repeats}), "
          f"stdlib + GSM8K {len(other)}; held out: {len(heldout)} self-distilled answers; draft vocabulary "
          f"{len(vocab) if vocab else lm.vocab_size}", flush=True)

    chunks = own + other
    feats = target_features(lm, chunks, args.batch, args.bf16)
    tokens = torch.tensor(chunks)
    scale = float(feats[:64].float().pow(2).mean().sqrt())
    draft = new_draft(lm, vocab).float()  # float32 master weights; forwards run under precision()
    before, coverage = depth_accuracy(lm, draft, heldout, args.depth, args.bf16)
    draft.requires_grad_(True)
    draft.train()
    order = list(range(len(own))) * args.generated_repeats + list(range(len(own), len(chunks)))
    steps = args.epochs * (len(order) // args.batch)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=args.lr, weight_decay=0.0)
    scaler = grad_scaler(lm)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, total_steps=steps, pct_start=0.05)
    losses = []
    bar = tqdm(total=steps, desc=f"EAGLE draft, {args.unroll} levels")
    for _ in range(args.epochs):
        rng.shuffle(order)
        for i in range(0, len(order) - args.batch + 1, args.batch):
            idx = torch.tensor(order[i:i + args.batch])
            f, x = feats[idx].float(), tokens[idx]
            with precision(lm):
                parts = level_losses(draft, f, x, teacher(draft, f), scale, args.unroll)
                loss = sum(0.8 ** j * (kl + reg) for j, (kl, reg) in enumerate(parts))
            optimizer_step(scaler, optimizer, loss, clip=1.0)
            schedule.step()
            losses.append([float(kl.detach()) for kl, _ in parts])
            recent = losses[-20:]
            bar.update()
            bar.set_postfix(kl=" ".join(f"{sum(p[j] for p in recent) / len(recent):.2f}" for j in range(len(parts))))
    bar.close()
    draft.eval()
    draft.requires_grad_(False)
    after, _ = depth_accuracy(lm, draft, heldout, args.depth, args.bf16)
    seconds = time.perf_counter() - start
    for j in range(args.depth):
        print(f"depth {j + 1}: top-1 {before[j][0]:.3f} -> {after[j][0]:.3f}, "
              f"top-5 {sum(before[j][:5]):.3f} -> {sum(after[j][:5]):.3f}", flush=True)
    print(f"held-out greedy tokens inside the draft vocabulary: {coverage:.3f}; {seconds / 60:.1f} min in all",
          flush=True)

    info = {"model": cfg.model.name, "epochs": args.epochs, "unroll": args.unroll, "batch": args.batch,
            "seq_len": args.seq_len, "lr": args.lr, "steps": steps,
            "draft_vocab": len(vocab) if vocab else lm.vocab_size, "vocab_coverage": round(coverage, 4),
            "chunks": {"self_distilled": len(own), "self_distilled_repeats": args.generated_repeats,
                       "stdlib_gsm8k": len(other)},
            "data": "the model's own greedy answers to requests written for scripts/training_corpus.py (every 10th "
                    "held out), Python stdlib source (train split), GSM8K train split",
            "seconds": round(seconds, 1), "accuracy": [[round(a, 4) for a in row] for row in after],
            "accuracy_untrained": [[round(a, 4) for a in row] for row in before],
            "final_kl": [round(sum(p[j] for p in losses[-20:]) / len(losses[-20:]), 4) for j in range(len(losses[-1]))],
            "command": " ".join(["python", "scripts/train_eagle.py", *sys.argv[1:]])}
    save_draft(draft, out, info)
    save_loss_curve(out, {f"level {j} (depth {j + 1})": [p[j] if j < len(p) else float("nan") for p in losses]
                          for j in range(len(losses[-1]))}, "KL(target || draft)", f"{cfg.model.name}: EAGLE draft")

if __name__ == "__main__":
    main()
