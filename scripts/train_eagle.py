"""Train an EAGLE feature draft on a frozen target (self-distillation), for decoder=eagle.

    python scripts/train_eagle.py [--layout eagle1] [--chunks 1200] [--epochs 2] [--unroll 3] [--draft-vocab 8192]
        [--gsm8k-questions 48] [--function-requests 0] [--general-requests 0]
        [--out adapters/smollm2-135m-eagle.safetensors] [--device auto] [--dtype auto] [model=...]
    python scripts/train_eagle.py --evaluate DRAFT [DRAFT ...] [same data options]   # held-out accuracy only

--layout eagle1 (the default): our draft (decoders/methods/eagle_draft.py) reads the target's
features at t (its last layer's output) and the embedding of token t+1 and predicts the features
at t+1; the target's own norm and head read the next token. --layout eagle3: EAGLE-3's draft
(decoders/methods/published.py, Eagle3Draft) reads the inputs of three target layers (low, mid,
high) fused by fc (3d -> d) and the embedding of token t+1; its own norm and head read the next
token; written in the authors' layout (a directory: config.json + model.safetensors), which
decoder.draft_weights loads as it loads theirs. The target's features are computed once per chunk
(frozen, bf16 autocast, stored in bfloat16) and reused every epoch. Losses, per level of unrolling:
- the target's next-token distribution (its head on its own last layer's output, over the draft
  vocabulary) against the draft's: KL, what verification accepts;
- eagle1 only: smooth L1 between predicted and real features, in units of the features' RMS
  (EAGLE's regression; EAGLE-3 has none, see level_losses).
Level 0 reads the real features; level j reads level j-1's predictions, attending to the real
positions before it and to its own earlier levels, as drafting at depth j + 1 does (EAGLE-3's
training-time test). Level j weighs 0.8^j.

The draft vocabulary is the `--draft-vocab` most frequent tokens of the training text (the model's
own answers counted 10x): the readout shrinks from the whole vocabulary to these rows.

Data (bench/training/corpus.py), disjoint from the benchmark test sets: the model's own greedy
answers to requests written for the script (every 10th held out), stdlib source, GSM8K's train
split. On the held-out answers the script measures acc[j][r], how often the draft's rank-r token at
depth j + 1 (drafting along the true continuation) is the target's greedy token; it is stored in
the file (decoder.tree=static builds EAGLE-1's tree from it) and printed, with a loss curve PNG, and
top-1 by depth per request family (code, instructions, gsm8k, functions, general). --evaluate with
several drafts (either layout) prints their tables side by side, on the same held-out answers.

A long run survives its session: every --checkpoint-minutes (and on SIGTERM, as SLURM sends before a
time limit) the draft, optimizer, schedule, data order and losses are saved under
cache_dir/train_eagle/; the same command resumes from there and ends with the draft an uninterrupted
run would make, bit for bit on a CPU. --stop-after-minutes / --stop-after-steps save and exit with code 75
(run it again); a finished run deletes its state.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import DynamicCache

from bench.__main__ import script_args
from bench.plotting import setup_of
from bench.training.corpus import corpus, draft_vocabulary, frozen_target, split_answers
from bench.training.features import RANKS, features, split_features, target_features, teacher, training_chunks
from bench.training.loss_curve import save_loss_curve
from bench.training.target import add_target_args, grad_scaler, optimizer_step, precision, target_overrides
from bench.usage import Parser
from decoders.core.kv_cache import KVCache
from decoders.methods.eagle_draft import load_draft, new_draft, save_draft
from decoders.methods.published import eagle3_reads, new_eagle3, save_eagle3

REPO = Path(__file__).resolve().parent.parent

LAYOUTS = ("eagle1", "eagle3")  # --layout: our EAGLE-1-style FeatureDraft, or EAGLE-3's draft


def unrolled_levels(draft, feats: torch.Tensor, tokens: torch.Tensor, levels: int):
    """Level j's predictions (B, L-1, d): row t reads (level j-1's row t, or the real features at t,
    as the draft takes them from the target (`from_target`), for j = 0) and token t+1+j, at
    position t+j, seeing real rows <= t and its own earlier levels; it predicts the features at
    t+1+j. Rows whose token would fall past the chunk are padding."""
    length = feats.shape[1]
    n = length - 1
    cache = KVCache(DynamicCache())
    tril = torch.ones(n, n, dtype=torch.bool).tril()
    eye = torch.eye(n, dtype=torch.bool)
    inputs, out = draft.from_target(feats[:, :-1]), []
    for j in range(levels):
        idx = torch.arange(n) + 1 + j
        tok = tokens[:, idx.clamp(max=length - 1)].to(inputs.device)  # where the draft runs (and embeds, EAGLE-3)
        mask = torch.cat([tril] + [eye] * j, dim=1)
        g = draft(inputs, tok, torch.arange(n) + j, mask, cache)
        out.append(g)
        inputs = g
    return out


def level_losses(draft, feats, tokens, teacher_logp, scale: float, levels: int):
    """Per level: (KL over the draft vocabulary, the feature regression: smooth L1 in RMS units, 0 for EAGLE-3)."""
    inputs, last = split_features(draft, feats)
    n = feats.shape[1] - 1
    parts = []
    for j, g in enumerate(unrolled_levels(draft, inputs.float(), tokens, levels)):
        rows = n - j  # row t predicts features at t+1+j <= L-1
        if rows <= 0:
            break
        g = g[:, :rows]
        logp = torch.log_softmax(draft.logits(g).float(), -1)
        kl = F.kl_div(logp.flatten(0, 1), teacher_logp[:, 1 + j:1 + j + rows].flatten(0, 1), log_target=True,
                      reduction="batchmean")
        if draft.reads is True:  # EAGLE-1: g predicts the target's features at t+1+j
            reg = F.smooth_l1_loss(g / scale, last[:, 1 + j:1 + j + rows].float() / scale)
        else:
            # EAGLE-3 (Li et al. 2025) drops the feature regression and trains with the token loss
            # only (the authors' traineagle3/cnets.py: cross-entropy against the target's distribution
            # over the draft vocabulary, the KL above up to the target's entropy; levels weighed
            # 0.8^j): its output is no target layer's output (it reads three layers fused, and level
            # j > 0 reads its own previous output), so there is no real feature to regress it onto.
            reg = kl.new_zeros(())
        parts.append((kl, reg))
    return parts


@torch.no_grad()
def depth_accuracy(lm, draft, sequences: list[list[int]], depth: int, bf16: bool,
                   families: list[str] | None = None) -> tuple[list[list[float]], float, dict[str, list[float]]]:
    """acc[j][r] on held-out sequences, the share of the target's greedy tokens in the draft vocabulary,
    and top-1 by depth per family (`families[i]` names sequence i's; {} without them)."""
    families = families or [""] * len(sequences)
    hits = {name: torch.zeros(depth, RANKS) for name in dict.fromkeys(families)}
    total = {name: torch.zeros(depth) for name in hits}
    covered = counted = 0
    in_vocab = torch.zeros(lm.vocab_size, dtype=torch.bool)
    in_vocab[draft.vocab] = True
    for seq, name in zip(sequences, families):
        inputs, last = split_features(draft, features(lm, torch.tensor([seq]), bf16, draft.reads).float())
        with precision(lm):
            full = lm.model.get_output_embeddings()(lm.final_norm(last))  # (1, L, V)
        greedy = full[0].argmax(-1).cpu()  # greedy[t]: the target's token after position t
        covered += int(in_vocab[greedy].sum())
        counted += len(greedy)
        ids = torch.tensor([seq])
        with precision(lm):
            levels = unrolled_levels(draft, inputs, ids, depth)
        for j, g in enumerate(levels):
            rows = len(seq) - 1 - j - 1  # row t predicts the token after position t+1+j, which must exist
            if rows <= 0:
                break
            with precision(lm):
                top = draft.vocab[draft.logits(g[0, :rows]).topk(RANKS, -1).indices.cpu()]
            hits[name][j] += (top == greedy[1 + j:1 + j + rows, None]).float().sum(0)
            total[name][j] += rows
    acc = (sum(hits.values()) / sum(total.values()).clamp(min=1)[:, None]).tolist()
    by_family = {name: [round(float(h[j, 0] / max(float(total[name][j]), 1)), 4) for j in range(depth)]
                 for name, h in hits.items() if name}
    return acc, covered / max(counted, 1), by_family


STOPPED = 75  # exit code of a run that stopped early with its checkpoint saved (EX_TEMPFAIL: run it again)
RESTART_KEYS = ("restart", "checkpoint_minutes", "stop_after_minutes", "stop_after_steps", "evaluate")


def checkpoint_path(cache_dir: str, out: Path, args: argparse.Namespace, overrides: list[str]) -> Path:
    """Where an unfinished run keeps its state: one file per output and per set of settings, so the
    same command resumes it and a changed one starts afresh."""
    settings = {k: v for k, v in sorted(vars(args).items()) if k not in RESTART_KEYS}
    if settings.get("layout") == "eagle1":
        del settings["layout"]  # the key a run had before --layout existed: its saved state still resumes
    key = hashlib.sha1(json.dumps([str(out), settings, overrides]).encode()).hexdigest()[:12]
    return Path(cache_dir).expanduser() / "train_eagle" / f"{out.stem}-{key}.pt"


def save_checkpoint(path: Path, state: dict) -> None:
    """Written whole to a temporary file, then renamed: a kill leaves the previous checkpoint intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def print_accuracy(label: str, by_family: dict[str, list[float]], counts: dict[str, int]) -> None:
    print(f"{label}: held-out top-1 by depth (1..{len(next(iter(by_family.values())))})", flush=True)
    for name, row in by_family.items():
        print(f"  {name:<13} ({counts[name]:>3} answers) " + " ".join(f"{a:.3f}" for a in row), flush=True)


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    """This script's options, checked, and the Hydra overrides after them."""
    parser = Parser(__doc__, prog="python scripts/train_eagle.py", overrides=True)
    parser.add_argument("--layout", choices=LAYOUTS, default="eagle1",
                        help="eagle1: our FeatureDraft (a .safetensors file); eagle3: EAGLE-3's draft in the "
                             "authors' layout (a directory: config.json + model.safetensors)")
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
    parser.add_argument("--function-requests", type=int, default=0,
                        help="'complete this function' requests from the standard library answered by the model")
    parser.add_argument("--general-requests", type=int, default=0,
                        help="general requests (templates x topics) answered by the model")
    parser.add_argument("--answer-tokens", type=int, default=192)
    parser.add_argument("--out", default=None,
                        help="default: adapters/<model>-eagle.safetensors (eagle3: the directory "
                             "adapters/<model>-eagle3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                        help="bfloat16 autocast for a float32 target's forward "
                             "(a half-precision one runs in its own dtype)")
    parser.add_argument("--checkpoint-minutes", type=float, default=10.0,
                        help="save the run's state this often (under cache_dir); the same command resumes it")
    parser.add_argument("--stop-after-minutes", type=float, default=None,
                        help="save the state and exit with code 75 after this much training in this process")
    parser.add_argument("--stop-after-steps", type=int, default=None,
                        help="save the state and exit with code 75 after this many steps in this process")
    parser.add_argument("--restart", action="store_true", help="ignore a saved state of this run and start afresh")
    parser.add_argument("--evaluate", nargs="+", default=None, metavar="DRAFT",
                        help="train nothing: print each DRAFT's held-out accuracy by depth and request family "
                             "(our file or an EAGLE-1/2/3 directory), then their top-1 by depth side by side")
    add_target_args(parser)
    args, overrides = script_args(parser)
    for key in ("chunks", "epochs", "unroll", "batch", "depth"):
        if getattr(args, key) < 1:
            raise SystemExit(f"error: --{key} must be >= 1, got {getattr(args, key)}")
    for key in ("function_requests", "general_requests"):
        if getattr(args, key) < 0:
            raise SystemExit(f"error: --{key.replace('_', '-')} must be >= 0, got {getattr(args, key)}")
    return args, overrides


@dataclass
class HeldOut:
    """The held-out self-distilled answers (every 10th) and each one's request family."""
    sequences: list[list[int]]
    families: list[str]

    @property
    def counts(self) -> dict[str, int]:
        return {name: self.families.count(name) for name in dict.fromkeys(self.families)}

    def accuracy(self, lm, draft, args: argparse.Namespace):
        """depth_accuracy at --depth: (acc[j][r], vocabulary coverage, top-1 by depth per family)."""
        return depth_accuracy(lm, draft, self.sequences, args.depth, args.bf16, self.families)


def evaluate(lm, paths: list[str], held: HeldOut, args: argparse.Namespace) -> dict[str, list[list[float]]]:
    """--evaluate: each trained draft's held-out top-1 by depth, in all and per family, and its
    vocabulary's coverage; with several, their top-1 / top-5 by depth side by side (a markdown table)
    on the same held-out answers. Returns acc[j][r] by draft."""
    measured = {}
    for path in paths:
        acc, coverage, by_family = held.accuracy(lm, load_draft(lm, path), args)
        print_accuracy(path, {"all": [round(row[0], 4) for row in acc], **by_family},
                       {"all": len(held.sequences), **held.counts})
        print(f"held-out greedy tokens inside its draft vocabulary: {coverage:.3f}", flush=True)
        measured[path] = acc
    if len(paths) > 1:
        print(f"\nheld-out top-1 / top-5 by depth ({len(held.sequences)} answers)\n\n| depth | "
              + " | ".join(paths) + " |\n|:--|" + ":--|" * len(paths), flush=True)
        for j in range(args.depth):
            print(f"| {j + 1} | " + " | ".join(f"{acc[j][0]:.3f} / {sum(acc[j][:5]):.3f}" for acc in measured.values())
                  + " |", flush=True)
    return measured


@dataclass
class TrainingSet:
    """The training chunks as tokens and as the target's features (computed once, reused every epoch)."""
    tokens: torch.Tensor
    feats: torch.Tensor
    scale: float  # the features' RMS: the unit of the regression loss
    order: list[int]  # one epoch's chunks before shuffling: each self-distilled one --generated-repeats times
    steps: int  # of the whole run


def training_set(lm, own: list[list[int]], other: list[list[int]], args: argparse.Namespace,
                 reads: bool | tuple[int, ...] = True) -> TrainingSet:
    """`reads`: the features the draft reads (draft.reads), stored beside the last layer's output."""
    chunks = own + other
    feats = target_features(lm, chunks, args.batch, args.bf16, reads)
    d = lm.config.get_text_config().hidden_size
    scale = float(feats[:64, :, -d:].float().pow(2).mean().sqrt())  # of the last layer's output (eagle1's regression)
    order = list(range(len(own))) * args.generated_repeats + list(range(len(own), len(chunks)))
    return TrainingSet(torch.tensor(chunks), feats, scale, order, args.epochs * (len(order) // args.batch))


@dataclass
class Trainer:
    """The draft in training and what a checkpoint saves with it: optimizer, schedule, loss scaler and
    the generator that orders the data."""
    lm: object
    draft: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    rng: random.Random

    def step(self, feats: torch.Tensor, tokens: torch.Tensor, scale: float, unroll: int) -> list[float]:
        """One optimizer step on a batch; each level's KL."""
        with precision(self.lm):
            parts = level_losses(self.draft, feats, tokens, teacher(self.lm, self.draft, feats), scale, unroll)
            loss = sum(0.8 ** j * (kl + reg) for j, (kl, reg) in enumerate(parts))
        optimizer_step(self.scaler, self.optimizer, loss, clip=1.0)
        self.schedule.step()
        return [float(kl.detach()) for kl, _ in parts]

    def save(self, path: Path, state: dict) -> None:
        state.update(draft=self.draft.state_dict(), optimizer=self.optimizer.state_dict(),
                     schedule=self.schedule.state_dict(), scaler=self.scaler.state_dict(), rng=self.rng.getstate())
        save_checkpoint(path, state)

    def restore(self, state: dict) -> None:
        self.draft.load_state_dict(state["draft"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        self.scaler.load_state_dict(state["scaler"])
        self.rng.setstate(state["rng"])


def new_trainer(lm, vocab: list[int] | None, args: argparse.Namespace, steps: int, rng: random.Random) -> Trainer:
    torch.manual_seed(args.seed)  # the same draft whether the answers were generated now or read from the cache
    draft = (new_eagle3 if args.layout == "eagle3" else new_draft)(lm, vocab).float()  # float32 master weights;
    # forwards run under precision()
    optimizer = torch.optim.AdamW(draft.parameters(), lr=args.lr, weight_decay=0.0)
    scaler = grad_scaler(lm)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, total_steps=steps, pct_start=0.05)
    return Trainer(lm, draft, optimizer, schedule, scaler, rng)


def resumed_state(ckpt: Path, trainer: Trainer, vocab: list[int] | None, steps: int) -> dict:
    """The saved run's progress, its draft, optimizer, schedule, scaler and generator restored into `trainer`."""
    state = torch.load(ckpt, weights_only=True)  # tensors and plain containers only: nothing executes
    if state["vocab"] != (list(vocab) if vocab else None):
        raise SystemExit(f"error: {ckpt} was made from other training text (its draft vocabulary differs); "
                         "pass --restart to start afresh")
    trainer.restore(state)
    print(f"resuming from {ckpt}: step {state['step']} of {steps}", flush=True)
    return state


def fresh_state(lm, draft, held: HeldOut, args: argparse.Namespace, vocab: list[int] | None) -> dict:
    """A new run's progress: nothing trained, and the untrained draft's held-out accuracy (the report's "before")."""
    before, _, before_by_family = held.accuracy(lm, draft, args)
    return {"step": 0, "epoch": 0, "pos": 0, "order": None, "losses": [], "before": before,
            "before_by_family": before_by_family, "train_seconds": 0.0, "vocab": list(vocab) if vocab else None}


def train(trainer: Trainer, data: TrainingSet, state: dict, ckpt: Path, args: argparse.Namespace) -> None:
    """The epochs left from `state`, checkpointed every --checkpoint-minutes; told to stop (SIGTERM,
    --stop-after-*) with steps left, it checkpoints and exits with STOPPED."""
    trainer.draft.requires_grad_(True)
    trainer.draft.train()
    stop = {"term": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(term=True))  # a preempted job checkpoints, then exits
    losses = state["losses"]
    session_start = saved_at = time.perf_counter()
    session_steps = 0
    bar = tqdm(total=data.steps, initial=state["step"], desc=f"EAGLE draft, {args.unroll} levels")
    order = data.order
    while state["epoch"] < args.epochs:
        if state["order"] is None:
            trainer.rng.shuffle(order)
            state["order"], state["pos"] = list(order), 0
        order = state["order"]
        for i in range(state["pos"], len(order) - args.batch + 1, args.batch):
            idx = torch.tensor(order[i:i + args.batch])
            losses.append(trainer.step(data.feats[idx].float(), data.tokens[idx], data.scale, args.unroll))
            state["step"], state["pos"] = state["step"] + 1, i + args.batch
            session_steps += 1
            recent = losses[-20:]
            bar.update()
            bar.set_postfix(kl=" ".join(f"{sum(p[j] for p in recent) / len(recent):.2f}"
                                        for j in range(len(losses[-1]))))
            now = time.perf_counter()
            stopping = stop["term"] or (args.stop_after_steps is not None and session_steps >= args.stop_after_steps) \
                or (args.stop_after_minutes is not None and now - session_start >= 60 * args.stop_after_minutes)
            if stopping or now - saved_at >= 60 * args.checkpoint_minutes:
                state["train_seconds"] += now - saved_at
                saved_at = now
                trainer.save(ckpt, state)
            if stopping and state["step"] < data.steps:
                bar.close()
                print(f"stopped at step {state['step']} of {data.steps}; the state is in {ckpt}: run the same "
                      "command to go on", flush=True)
                sys.exit(STOPPED)
        state["epoch"], state["order"], state["pos"] = state["epoch"] + 1, None, 0
    bar.close()
    state["train_seconds"] += time.perf_counter() - saved_at


def final_report(lm, draft, held: HeldOut, state: dict, args: argparse.Namespace, start: float):
    """The trained draft's held-out accuracy (returned as HeldOut.accuracy's), printed beside the
    untrained one's, with the time spent."""
    draft.eval()
    draft.requires_grad_(False)
    after, coverage, after_by_family = held.accuracy(lm, draft, args)
    before = state["before"]
    for j in range(args.depth):
        print(f"depth {j + 1}: top-1 {before[j][0]:.3f} -> {after[j][0]:.3f}, "
              f"top-5 {sum(before[j][:5]):.3f} -> {sum(after[j][:5]):.3f}", flush=True)
    print_accuracy("untrained", state["before_by_family"], held.counts)
    print_accuracy("trained", after_by_family, held.counts)
    print(f"held-out greedy tokens inside the draft vocabulary: {coverage:.3f}; "
          f"{state['train_seconds'] / 60:.1f} min of training, {(time.perf_counter() - start) / 60:.1f} min "
          "in this process", flush=True)
    return after, coverage, after_by_family


def draft_info(model: str, args: argparse.Namespace, *, steps: int, draft_vocab: int, chunks: tuple[int, int],
               families: list[str], state: dict, held: HeldOut, measured) -> dict:
    """What the draft file records of its making: settings, data (`chunks`: self-distilled and other
    chunks; `families`: every request's), time, held-out accuracy (`measured`: final_report's) and final KL."""
    after, coverage, after_by_family = measured
    losses = state["losses"]
    return {"model": model, "layout": args.layout, "epochs": args.epochs, "unroll": args.unroll, "batch": args.batch,
            "seq_len": args.seq_len, "lr": args.lr, "steps": steps,
            "draft_vocab": draft_vocab, "vocab_coverage": round(coverage, 4),
            "chunks": {"self_distilled": chunks[0], "self_distilled_repeats": args.generated_repeats,
                       "stdlib_gsm8k": chunks[1]},
            "requests": {name: families.count(name) for name in dict.fromkeys(families)},
            "data": "the model's own greedy answers to requests written for bench/training/corpus.py (every 10th "
                    "held out), Python stdlib source (train split), GSM8K train split",
            "seconds": round(state["train_seconds"], 1), "accuracy": [[round(a, 4) for a in row] for row in after],
            "accuracy_untrained": [[round(a, 4) for a in row] for row in state["before"]],
            "heldout_top1_by_family": after_by_family, "heldout_answers_by_family": held.counts,
            "final_kl": [round(sum(p[j] for p in losses[-20:]) / len(losses[-20:]), 4) for j in range(len(losses[-1]))],
            "command": " ".join(["python", "scripts/train_eagle.py", *sys.argv[1:]])}


def save_trained(draft, out: Path, info: dict, losses: list[list[float]], where: str) -> None:
    """The draft file (eagle3: the authors' directory) and its loss curve beside it (`where`: the target's
    setup, plotting.setup_of)."""
    if info["layout"] == "eagle3":
        save_eagle3(draft, out, info, info["model"])
    else:
        save_draft(draft, out, info)
    title = f"{info['model']}: EAGLE{'-3' if info['layout'] == 'eagle3' else ''} draft"
    save_loss_curve(out, {f"level {j} (depth {j + 1})": [p[j] if j < len(p) else float("nan") for p in losses]
                          for j in range(len(losses[-1]))}, "KL(target || draft)", title, where)


def main() -> None:
    args, overrides = parse_args()
    cfg, lm = frozen_target(target_overrides(args, overrides), args.seed)
    lm.set_fast_path("none")  # training needs autograd through the draft's linears
    rng = random.Random(args.seed)
    default = f"{cfg.model.name}-eagle3" if args.layout == "eagle3" else f"{cfg.model.name}-eagle.safetensors"
    out = Path(args.out or REPO / "adapters" / default)
    reads = True
    if args.layout == "eagle3" and not args.evaluate:
        try:
            reads = eagle3_reads(lm)
        except ValueError as e:
            raise SystemExit(f"error: --layout eagle3: {e}") from None

    start = time.perf_counter()
    data = corpus(lm, cfg.model.name, cfg.data_dir, cfg.cache_dir, n_gsm8k=args.gsm8k_questions,
                  answer_tokens=args.answer_tokens, n_functions=args.function_requests, n_general=args.general_requests)
    generated, heldout = split_answers(data)
    held = HeldOut(heldout, data["family"][::10])
    if args.evaluate:
        evaluate(lm, args.evaluate, held, args)
        return
    own, other = training_chunks(data, generated, args, rng)
    vocab = None
    if args.draft_vocab and args.draft_vocab < lm.vocab_size:
        vocab = draft_vocabulary(own, other, args.draft_vocab)
    print(f"{args.layout} draft; train chunks of {args.seq_len} tokens: self-distilled {len(own)} "
          f"(x{args.generated_repeats}), stdlib + GSM8K {len(other)}; held out: {len(heldout)} self-distilled "
          f"answers; draft vocabulary {len(vocab) if vocab else lm.vocab_size}", flush=True)

    train_set = training_set(lm, own, other, args, reads)
    trainer = new_trainer(lm, vocab, args, train_set.steps, rng)
    ckpt = checkpoint_path(cfg.cache_dir, out, args, overrides)
    if ckpt.is_file() and not args.restart:
        state = resumed_state(ckpt, trainer, vocab, train_set.steps)
    else:
        state = fresh_state(lm, trainer.draft, held, args, vocab)
    train(trainer, train_set, state, ckpt, args)
    measured = final_report(lm, trainer.draft, held, state, args, start)
    info = draft_info(cfg.model.name, args, steps=train_set.steps, draft_vocab=len(vocab) if vocab else lm.vocab_size,
                      chunks=(len(own), len(other)), families=data["family"], state=state, held=held,
                      measured=measured)
    save_trained(trainer.draft, out, info, state["losses"], setup_of(lm))
    ckpt.unlink(missing_ok=True)  # finished: the same command trains afresh


if __name__ == "__main__":
    main()
