"""Train a block draft on a frozen target (self-distillation), for decoder=dflash.

    python scripts/train_block_draft.py [--block-size 8] [--intermediate-size 512] [--chunks 600] [--epochs 1]
        [--anchors 16] [--vocab adapters/smollm2-135m-vocab.json] [--out adapters/smollm2-135m-dflash.safetensors]
        [same data options as train_eagle.py] [model=...]

The draft (decoders/methods/block_draft.py) reads the inputs of the target's low, mid and high layers
(EAGLE-3's), fused into one context row per committed token, and drafts a block of B positions (the
last committed token, then B - 1 mask rows) in one forward. Data, the target's features and the teacher
are scripts/train_eagle.py's (the same corpus, chunks and feature pass; features computed once, bf16,
reused every epoch). A training step runs, per chunk of L tokens, its L context rows and `--anchors`
blocks at random anchors a (the root is token a, the context the rows before it) in ONE draft forward,
masked as drafting masks it (context causal; each block sees the context before its anchor and its own
rows); block row i (position a + i) is trained towards the target's next-token distribution at a + i - 1
over the draft vocabulary (KL, as train_eagle.py's), weighed 0.8^(i - 1).

Start (--start): target, the draft's layer a copy of the target's last layer (its MLP's first
--intermediate-size channels) and the fuse passing the high layer's input through; or random, torch's
initialisation (DFlash's). The mask embedding starts small and random.

Held out (the self-distilled answers every 10th): acc[i][r], how often the draft's rank-r token at block
position i + 1 is the target's greedy token there, over every anchor (each position's prediction sees
only the context, never the drafts before it), and the chain's mean accepted drafts (leading top-1
hits). Both are printed and stored in the file's `info` (decoder.tree_size=auto forecasts its trees from
acc), with a loss curve PNG.
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
from bench.training.corpus import corpus, frozen_target, split_answers
from bench.training.features import RANKS, features, split_features, target_features, teacher, training_chunks
from bench.training.loss_curve import save_loss_curve
from bench.usage import Parser
from bench.training.target import add_target_args, grad_scaler, optimizer_step, precision, target_overrides
from decoders.core.weights_file import load_vocab
from decoders.methods.block_draft import block_reads, new_block_draft, save_block_draft

REPO = Path(__file__).resolve().parent.parent
DECAY = 0.8  # weight of block position i + 1 relative to position i


def anchored(length: int, anchors: list[int], block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask (q, q) and positions (q,) of one training forward over a chunk of `length` tokens: its context
    rows (causal), then a block of `block` rows per anchor a at positions a..a + block - 1, each seeing the
    context rows before a and its own block's rows; q = length + len(anchors) * block."""
    q = length + len(anchors) * block
    mask = torch.zeros(q, q, dtype=torch.bool)
    mask[:length, :length] = torch.ones(length, length, dtype=torch.bool).tril()
    positions = [torch.arange(length)]
    for j, a in enumerate(anchors):
        rows = slice(length + j * block, length + (j + 1) * block)
        mask[rows, :a] = True
        mask[rows, rows] = True
        positions.append(torch.arange(a, a + block))
    return mask, torch.cat(positions)


def block_logits(draft, reads: torch.Tensor, tokens: torch.Tensor, anchors: list[int], block: int) -> torch.Tensor:
    """reads (S, L, F): the target's fused features; tokens (S, L). The draft's logits (S, A, block - 1, V')
    at every anchor's positions a + 1 .. a + block - 1, from one forward."""
    length = reads.shape[1]
    x = draft.block_inputs(reads, tokens[:, anchors], block)  # (S, L + A * block, d)
    mask, positions = anchored(length, anchors, block)
    h = draft.run(x, positions, mask)[:, length:]  # (S, A * block, d)
    h = h.unflatten(1, (len(anchors), block))[:, :, 1:]  # (S, A, block - 1, d): the drafted positions
    return draft.logits(h)


def loss(lm, draft, feats: torch.Tensor, tokens: torch.Tensor, anchors: list[int], block: int) -> tuple:
    """The weighted KL of every anchor's drafted positions, and each position's mean KL."""
    reads, _ = split_features(draft, feats)
    target = teacher(lm, draft, feats)  # (S, L, V'): the target's next-token log-probabilities
    logp = torch.log_softmax(block_logits(draft, reads, tokens, anchors, block).float(), -1)  # (S, A, B - 1, V')
    at = torch.tensor(anchors)[:, None] + torch.arange(block - 1)  # (A, B - 1): the position before each token
    kl = F.kl_div(logp, target[:, at], log_target=True, reduction="none").sum(-1).mean((0, 1))  # (B - 1,)
    weights = DECAY ** torch.arange(block - 1, dtype=kl.dtype)
    return (kl * weights).sum() / weights.sum(), kl.detach().tolist()


@torch.no_grad()
def heldout_accuracy(lm, draft, sequences: list[list[int]], block: int, bf16: bool) -> tuple[list[list[float]], float]:
    """acc[i][r] over every anchor of the held-out sequences, and the chain's mean accepted drafts
    (how many leading positions' top-1 is the target's greedy token)."""
    hits, total, accepted, anchors_seen = torch.zeros(block - 1, RANKS), 0, 0.0, 0
    for seq in sequences:
        if len(seq) <= block:
            continue
        feats = features(lm, torch.tensor([seq]), bf16, draft.reads).float()
        reads, last = split_features(draft, feats)
        with precision(lm):
            greedy = lm.model.get_output_embeddings()(lm.final_norm(last))[0].argmax(-1).cpu()  # (L,)
            anchors = list(range(1, len(seq) - block + 1))
            logits = block_logits(draft, reads, torch.tensor([seq]), anchors, block)[0]  # (A, B - 1, V')
            top = draft.vocab[logits.topk(RANKS, -1).indices.cpu()]  # (A, B - 1, RANKS)
        at = torch.tensor(anchors)[:, None] + torch.arange(block - 1)
        right = top == greedy[at][..., None]  # (A, B - 1, RANKS)
        hits += right.float().sum(0)
        total += len(anchors)
        accepted += float(right[..., 0].long().cumprod(-1).sum())
        anchors_seen += len(anchors)
    return (hits / max(total, 1)).tolist(), accepted / max(anchors_seen, 1)


def start_from_target(lm, draft) -> None:
    """The layer(s) as copies of the target's last layer (the MLP's first channels where it is narrower);
    the fuse passes the last (highest) layer read through."""
    last = lm.model.base_model.layers[-1].state_dict()
    for layer in draft.layers:
        own = layer.state_dict()
        for name, value in own.items():
            source = last[name]
            if name.endswith(("gate_proj.weight", "up_proj.weight")):
                source = source[:value.shape[0]]
            elif name.endswith("down_proj.weight"):
                source = source[:, :value.shape[1]]
            value.copy_(source.to(value))
    d = draft.fuse.weight.shape[0]
    with torch.no_grad():
        draft.fuse.weight.zero_()
        draft.fuse.weight[:, -d:] = torch.eye(d)


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    parser = Parser(__doc__, prog="python scripts/train_block_draft.py", overrides=True)
    parser.add_argument("--block-size", type=int, default=8, help="B: the root and B - 1 drafted positions")
    parser.add_argument("--layers", type=int, default=1, help="decoder layers of the target's class")
    parser.add_argument("--intermediate-size", type=int, default=None,
                        help="the layers' MLP width (default: the target's); narrower is a smaller file")
    parser.add_argument("--start", choices=("target", "random"), default="target",
                        help="target: the layer a copy of the target's last one, the fuse passing the high read "
                             "through; random: torch's initialisation (DFlash's)")
    parser.add_argument("--anchors", type=int, default=16, help="blocks trained per chunk and step")
    parser.add_argument("--chunks", type=int, default=600,
                        help="stdlib + GSM8K chunks (beside all self-distilled ones)")
    parser.add_argument("--generated-repeats", type=int, default=2, help="self-distilled chunks appear this often")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--vocab", default="auto",
                        help="the draft vocabulary: auto (adapters/<model>-vocab.json if there is one), full, "
                             "or a file")
    parser.add_argument("--gsm8k-questions", type=int, default=48)
    parser.add_argument("--function-requests", type=int, default=0)
    parser.add_argument("--general-requests", type=int, default=0)
    parser.add_argument("--answer-tokens", type=int, default=192)
    parser.add_argument("--out", default=None, help="default: adapters/<model>-dflash.safetensors")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                        help="bfloat16 autocast for a float32 target's feature pass")
    add_target_args(parser)
    args, overrides = script_args(parser)
    for key in ("block_size", "layers", "anchors", "chunks", "epochs", "batch"):
        if getattr(args, key) < (2 if key == "block_size" else 1):
            raise SystemExit(f"error: --{key.replace('_', '-')} must be >= {2 if key == 'block_size' else 1}")
    if args.anchors > args.seq_len - args.block_size:
        raise SystemExit(f"error: --anchors must be at most --seq-len - --block-size "
                         f"= {args.seq_len - args.block_size}")
    return args, overrides


def main() -> None:
    args, overrides = parse_args()
    cfg, lm = frozen_target(target_overrides(args, overrides), args.seed)
    lm.set_fast_path("none")  # training needs autograd through the draft's linears
    rng = random.Random(args.seed)
    out = Path(args.out or REPO / "adapters" / f"{cfg.model.name}-dflash.safetensors")
    start = time.perf_counter()
    data = corpus(lm, cfg.model.name, cfg.data_dir, cfg.cache_dir, n_gsm8k=args.gsm8k_questions,
                  answer_tokens=args.answer_tokens, n_functions=args.function_requests, n_general=args.general_requests)
    generated, heldout = split_answers(data)
    own, other = training_chunks(data, generated, args, rng)
    vocab, vocab_info = load_vocab(lm, args.vocab, key="--vocab")
    torch.manual_seed(args.seed)
    draft = new_block_draft(lm, block_reads(lm), args.layers, args.intermediate_size, vocab, args.block_size).float()
    if args.start == "target":
        start_from_target(lm, draft)
    block = args.block_size
    chunks = own + other
    order = list(range(len(own))) * args.generated_repeats + list(range(len(own), len(chunks)))  # one epoch's
    print(f"block draft (B={block}, {args.layers} layer(s), MLP {draft.intermediate_size}, reads {draft.reads}); "
          f"chunks of {args.seq_len} tokens: self-distilled {len(own)} (x{args.generated_repeats}), stdlib + GSM8K "
          f"{len(other)}; held out: {len(heldout)} answers; draft vocabulary {len(draft.vocab)}", flush=True)
    feats = target_features(lm, chunks, args.batch, args.bf16, draft.reads)
    tokens = torch.tensor(chunks)
    before = heldout_accuracy(lm, draft, heldout, block, args.bf16)
    steps = args.epochs * (len(order) // args.batch)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, total_steps=steps, pct_start=0.05)
    scaler = grad_scaler(lm)
    draft.requires_grad_(True)
    draft.train()
    losses, trained = [], time.perf_counter()
    bar = tqdm(total=steps, desc=f"block draft, B={block}")
    for _ in range(args.epochs):
        rng.shuffle(order)
        for i in range(0, len(order) - args.batch + 1, args.batch):
            idx = torch.tensor(order[i:i + args.batch])
            anchors = sorted(rng.sample(range(1, args.seq_len - block + 1), args.anchors))
            with precision(lm):
                value, per_position = loss(lm, draft, feats[idx].float(), tokens[idx], anchors, block)
            optimizer_step(scaler, optimizer, value, clip=1.0)
            schedule.step()
            losses.append(per_position)
            bar.update()
            recent = losses[-20:]
            bar.set_postfix(kl=" ".join(f"{sum(p[j] for p in recent) / len(recent):.2f}" for j in (0, block - 2)))
    bar.close()
    seconds = time.perf_counter() - trained
    draft.eval()
    draft.requires_grad_(False)
    after = heldout_accuracy(lm, draft, heldout, block, args.bf16)
    for i in range(block - 1):
        print(f"position {i + 1}: top-1 {before[0][i][0]:.3f} -> {after[0][i][0]:.3f}, "
              f"top-4 {sum(before[0][i][:4]):.3f} -> {sum(after[0][i][:4]):.3f}", flush=True)
    print(f"chain: mean accepted drafts {before[1]:.3f} -> {after[1]:.3f}; {seconds / 60:.1f} min of training, "
          f"{(time.perf_counter() - start) / 60:.1f} min in this process", flush=True)
    final = [round(sum(p[j] for p in losses[-20:]) / len(losses[-20:]), 4) for j in range(block - 1)]
    info = {"model": cfg.model.name, "block_size": block, "layers": args.layers, "start": args.start,
            "intermediate_size": draft.intermediate_size, "reads": list(draft.reads), "anchors": args.anchors,
            "epochs": args.epochs, "batch": args.batch, "seq_len": args.seq_len, "lr": args.lr, "steps": steps,
            "draft_vocab": len(draft.vocab), "vocab": vocab_info,
            "chunks": {"self_distilled": len(own), "self_distilled_repeats": args.generated_repeats,
                       "stdlib_gsm8k": len(other)},
            "heldout_answers": len(heldout), "seconds": round(seconds, 1),
            "accuracy": [[round(a, 4) for a in row] for row in after[0]],
            "accuracy_untrained": [[round(a, 4) for a in row] for row in before[0]],
            "chain_accepted": round(after[1], 4), "chain_accepted_untrained": round(before[1], 4), "final_kl": final,
            "data": "scripts/train_eagle.py's: the model's own greedy answers to bench/training/corpus.py's requests "
                    "(every 10th held out), Python stdlib source (train split), GSM8K train split",
            "command": " ".join(["python", "scripts/train_block_draft.py", *sys.argv[1:]])}
    save_block_draft(draft, out, info)
    save_loss_curve(out, {f"position {j + 1}": [p[j] for p in losses] for j in range(block - 1)},
                    "KL(target || draft)", f"{cfg.model.name}: block draft, B={block}", setup_of(lm))


if __name__ == "__main__":
    main()
