"""What the feature drafts' trainers share (scripts/train_eagle.py, scripts/train_block_draft.py): the
target's features of the training chunks, computed once, and the teacher's distribution over a draft's
vocabulary."""
from __future__ import annotations

import argparse
import random

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .corpus import fixed_chunks
from .target import precision

RANKS = 10  # ranks whose held-out accuracy a trainer reports


@torch.no_grad()
def features(lm, ids: torch.Tensor, bf16: bool, reads: bool | tuple[int, ...] = True) -> torch.Tensor:
    """(B, L, d): the target's last layer's output before the final norm (what an eagle1 draft reads,
    and the target's head reads). With `reads` an EAGLE-3 draft's layers: (B, L, 3d + d), the inputs
    of those layers (what LM.forward's features=reads returns, what the draft reads at decoding),
    then the last layer's output (what the teacher reads): split_features parts them."""
    captured = {}
    handles = [lm.final_norm.register_forward_pre_hook(lambda m, a: captured.update(last=a[0]))]
    if reads is not True:
        layers = lm.model.base_model.layers
        handles += [layers[i].register_forward_pre_hook(
            lambda m, a, kw, i=i: captured.update({i: a[0] if a else kw["hidden_states"]}), with_kwargs=True)
            for i in sorted(set(reads))]
    try:
        with precision(lm, bf16):
            lm.model(input_ids=ids.to(lm.device), use_cache=False, logits_to_keep=1)
    finally:
        for handle in handles:
            handle.remove()
    parts = [] if reads is True else [captured[i].to(lm.output_device) for i in reads]
    return torch.cat([*parts, captured["last"].to(lm.output_device)], -1)  # on the last layer's device, the draft's


def split_features(draft, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """features()'s output as (what `draft` reads, the target's last layer's output)."""
    if draft.reads is True:
        return feats, feats
    d = feats.shape[-1] // (len(draft.reads) + 1)
    return feats[..., :-d], feats[..., -d:]


def target_features(lm, chunks: list[list[int]], batch: int, bf16: bool,
                    reads: bool | tuple[int, ...] = True) -> torch.Tensor:
    """Every chunk's features (features()'s), computed once, stored in bfloat16 to save memory (filled
    in place: no second copy while they are gathered) and reused every epoch."""
    out = None
    for i in tqdm(range(0, len(chunks), batch), desc="target features", unit="batch"):
        f = features(lm, torch.tensor(chunks[i:i + batch]), bf16, reads)
        if out is None:
            out = torch.empty((len(chunks), *f.shape[1:]), dtype=torch.bfloat16, device=f.device)
        out[i:i + len(f)] = f
    return out


@torch.no_grad()
def teacher(lm, draft, feats: torch.Tensor) -> torch.Tensor:
    """The target's log-probabilities over the draft vocabulary at every position: its final norm
    and head (the head's rows over draft.vocab) on its last layer's output."""
    _, last = split_features(draft, feats)
    head = lm.model.get_output_embeddings()
    rows = draft.vocab.to(head.weight.device)
    whole = len(rows) == head.weight.shape[0] and bool((rows == torch.arange(len(rows), device=rows.device)).all())
    weight, bias = (head.weight, head.bias) if whole else (head.weight[rows], head.bias)  # no copy of a whole head
    bias = bias[rows] if bias is not None and not whole else bias
    logits = F.linear(lm.final_norm(last.float()).to(weight.dtype), weight, bias)
    return torch.log_softmax(logits.float(), -1)


def training_chunks(data: dict, generated: list[list[int]], args: argparse.Namespace,
                    rng: random.Random) -> tuple[list[list[int]], list[list[int]]]:
    """(own, other): the self-distilled answers as one stream cut in chunks, and --chunks of the
    stdlib + GSM8K chunks, drawn in an order from `rng`."""
    own = fixed_chunks([[t for s in generated for t in s]], args.seq_len)
    other = fixed_chunks(data["stdlib"], args.seq_len) + fixed_chunks(data["gsm8k"], args.seq_len)
    rng.shuffle(other)
    return own, other[:args.chunks]
