"""Train the self-draft's exit adapter: self-distillation with the backbone frozen.

    python scripts/train_exit_adapter.py [--steps 300] [--seq-len 128] [--batch 4] [--lr 1e-3]
        [--generated 16] [--out adapters/<model>-self<k>.safetensors] [--bf16] [--device auto] [--dtype auto]
        [model=... draft.layers=4]

The draft is the target's first k layers + its final norm and head; the adapter
(RMSNorm + a d x d residual projection, decoders/methods/draft_model.py) sits between layer k and the final
norm. Loss: KL(target's next-token distribution || draft's) at every position. One frozen
forward of the full model per batch gives both the teacher's logits and layer k's hidden
state, so only the adapter, the final norm and the head run forward and backward.

Training text shares nothing with the benchmark test sets: Python standard-library source
(this interpreter's own) and the target's greedy answers to instructions written for this
script (self-distillation). Held out: a different set of standard-library modules. Prints
top-1 agreement (draft argmax == target argmax) on the held-out text before and after, saves
the adapter (a few MB) with how it was made, and a loss curve PNG next to it.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from tqdm.auto import tqdm

from bench.__main__ import script_args
from bench.plotting import setup_of
from bench.training.corpus import INSTRUCTIONS, generated_chunks, stdlib_files, text_chunks
from bench.training.loss_curve import save_loss_curve
from bench.training.target import add_target_args, grad_scaler, load_target, optimizer_step, precision, target_overrides
from bench.usage import Parser
from decoders.methods.draft_model import new_exit_adapter, save_adapter

REPO = Path(__file__).resolve().parent.parent

def teacher(lm, batch: torch.Tensor, layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full model's logits and layer k's hidden state (pre-norm), in one frozen forward."""
    with torch.no_grad():
        out = lm.model(input_ids=batch, output_hidden_states=True, use_cache=False)
    return out.logits.float(), out.hidden_states[layers]


def draft_logits(lm, adapter, hidden: torch.Tensor) -> torch.Tensor:
    base = lm.model.base_model
    return lm.model.get_output_embeddings()(base.norm(adapter(hidden) if adapter is not None else hidden)).float()


def agreement(lm, adapter, data: list[list[int]], layers: int, batch: int, bf16: bool = False) -> float:
    hits = total = 0
    for i in range(0, len(data), batch):
        ids = torch.tensor(data[i:i + batch], device=lm.device)
        with torch.no_grad(), precision(lm, bf16):
            target, hidden = teacher(lm, ids, layers)
            draft = draft_logits(lm, adapter, hidden)
        hits += int((draft.argmax(-1) == target.argmax(-1)).sum())
        total += target.shape[0] * target.shape[1]
    return hits / total


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    """This script's options and the Hydra overrides after them."""
    parser = Parser(__doc__, prog="python scripts/train_exit_adapter.py", overrides=True)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--generated", type=int, default=len(INSTRUCTIONS), help="self-distillation answers")
    parser.add_argument("--heldout", type=int, default=16, help="held-out chunks")
    parser.add_argument("--out", default=None, help="default: adapters/<model>-self<k>.safetensors")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=False,
                        help="bfloat16 autocast for a float32 target's matmuls (a large vocabulary's two readouts "
                             "per step are most of the cost); a half-precision target runs in its own dtype")
    add_target_args(parser)
    return script_args(parser)


def target_and_exit_layer(args: argparse.Namespace, overrides: list[str]):
    """(config, LM, k): the run's config (threads set, torch and random seeded), the target loaded with
    every parameter frozen, and draft.layers checked against its depth."""
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=target_overrides(args, overrides))
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    layers = int(cfg.draft.layers)
    lm = load_target(cfg.model)
    for p in lm.model.parameters():
        p.requires_grad_(False)
    total_layers = len(lm.model.base_model.layers)
    if not 1 <= layers < total_layers:
        raise SystemExit(f"error: draft.layers must be in [1, {total_layers - 1}], got {layers}")
    return cfg, lm, layers


def training_text(lm, args: argparse.Namespace) -> tuple[list[list[int]], list[list[int]]]:
    """(train, held out) chunks of --seq-len tokens: stdlib modules and the target's own answers;
    --heldout chunks of other stdlib modules."""
    train = text_chunks(lm.tokenizer, stdlib_files("train"), args.seq_len, limit=10**9)
    train += generated_chunks(lm, args.generated, args.seq_len)
    heldout = text_chunks(lm.tokenizer, stdlib_files("heldout"), args.seq_len, limit=args.heldout)
    print(f"train chunks: {len(train)} x {args.seq_len} tokens (stdlib + {args.generated} self-distilled answers); "
          f"held-out: {len(heldout)} chunks of other stdlib modules", flush=True)
    return train, heldout


def train(lm, layers: int, data: list[list[int]], args: argparse.Namespace):
    """(adapter, each step's KL): a new adapter on layer `layers`, trained --steps steps on --batch
    chunks drawn from `data`; left in eval mode."""
    adapter = new_exit_adapter(lm.model, layers).float()  # float32 master weights; forwards run under precision()
    for p in adapter.parameters():  # its norm is a copy of the (frozen) final norm: train it too
        p.requires_grad_(True)
    adapter.train()
    optimizer = torch.optim.Adam(adapter.parameters(), lr=args.lr)
    scaler = grad_scaler(lm)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.steps)
    losses = []
    bar = tqdm(range(args.steps), desc=f"exit adapter, layer {layers}")
    for _ in bar:
        batch = torch.tensor(random.sample(data, args.batch), device=lm.device)
        with precision(lm, args.bf16):
            target, hidden = teacher(lm, batch, layers)
            logits = draft_logits(lm, adapter, hidden)
            loss = F.kl_div(F.log_softmax(logits, -1).flatten(0, 1), F.log_softmax(target, -1).flatten(0, 1),
                            log_target=True, reduction="batchmean")
        optimizer_step(scaler, optimizer, loss)
        schedule.step()
        losses.append(float(loss.detach()))
        bar.set_postfix(kl=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
    adapter.eval()
    return adapter, losses


def main() -> None:
    args, overrides = parse_args()
    cfg, lm, layers = target_and_exit_layer(args, overrides)
    out = Path(args.out or REPO / "adapters" / f"{cfg.model.name}-self{layers}.safetensors")

    start = time.perf_counter()
    data, heldout = training_text(lm, args)
    before = agreement(lm, None, heldout, layers, args.batch, args.bf16)
    adapter, losses = train(lm, layers, data, args)
    after = agreement(lm, adapter, heldout, layers, args.batch, args.bf16)
    seconds = time.perf_counter() - start
    print(f"held-out top-1 agreement with the full model: {before:.3f} without the adapter, {after:.3f} with it "
          f"({seconds / 60:.1f} min in all)", flush=True)

    info = {"model": cfg.model.name, "layers": layers, "steps": args.steps, "batch": args.batch,
            "seq_len": args.seq_len, "lr": args.lr, "bf16": args.bf16, "train_chunks": len(data),
            "data": "Python stdlib source (train split) + self-distilled answers",
            "seconds": round(seconds, 1), "final_kl": round(sum(losses[-20:]) / len(losses[-20:]), 4),
            "heldout_agreement_before": round(before, 4), "heldout_agreement_after": round(after, 4),
            "command": " ".join(["python", "scripts/train_exit_adapter.py", *sys.argv[1:]])}
    save_adapter(adapter, out, layers, info)
    save_loss_curve(out, {"loss": losses}, "KL(target || draft)", f"{cfg.model.name}: exit adapter on layer {layers}",
                    setup_of(lm))

if __name__ == "__main__":
    main()
