"""A block draft and its file: one draft forward proposes a whole block of tokens (DFlash's drafting,
P-EAGLE's one pass), where an EAGLE draft runs one forward per depth.

The draft reads the target's features of the committed tokens as EAGLE-3 does (the inputs of a low, a
middle and a high layer, concatenated: LM.forward's features=(i, j, k)) and fuses them by a (3d -> d)
linear into one row per committed token; those rows go through its decoder layers (of the target's
class, full attention) like tokens, so its own KV cache holds the committed context as the target saw
it (DFlash injects the target's context into the draft's keys and values the same way). After them, a
block of B rows: the last committed token's embedding (the root, whose features the target has not
computed yet), then B - 1 copies of a learned mask embedding, at the next B positions. The context rows
are causal among themselves; the block's rows see the whole context and each other (bidirectional
inside the block). Rows 1..B-1 of the block, read out over a draft vocabulary as our EAGLE draft reads
out (the target's final norm and its head's rows: neither trained nor stored), are the distributions of
the B - 1 tokens after the root, all from the one forward: each is independent of what is drafted
before it in the block, as DFlash's are.

Stored: the fuse, the mask embedding and the layers (float16, weights_file.save_weights), with the
layers' shape, the target layers read, the block size trained, the draft vocabulary's ids and what the
training measured (`info`: held-out accuracy by block position and rank) in the metadata.
"""
from __future__ import annotations

import json
import statistics
import time
from functools import cached_property
from pathlib import Path
from typing import Sequence

import torch
from torch import nn
from transformers import DynamicCache

from ..core.kv_cache import KVCache
from ..core.lm import LM, DraftCost, TargetParts
from ..core.weights_file import addon_path, load_checked, load_state, meta_int, meta_json, save_weights
from .eagle_draft import draft_layer_config, init_unset_parameters, read_out, ready_draft, run_layers, vocab_readout
from .published import eagle3_reads

BLOCK_FORMAT = "block-draft-v1"
DEFAULT_BLOCK = 8  # an untrained draft's block size


def block_reads(lm: LM) -> tuple[int, int, int]:
    """The target layers whose inputs a block draft fuses: EAGLE-3's low, mid and high (2, L/2, L-3) where
    the target has the 7 layers they need; on a shallower one (the tests' tiny models) its first, middle
    and last layers' inputs."""
    try:
        return eagle3_reads(lm)
    except ValueError:
        layers = lm.config.get_text_config().num_hidden_layers
        return 0, layers // 2, layers - 1


def block_mask(context: int, cached: int, block: int) -> torch.Tensor:
    """bool (context + block, cached + context + block): `context` new rows after `cached` ones, causal
    among themselves; then `block` rows that see every context row and each other."""
    rows = context + block
    mask = torch.ones(rows, cached + rows, dtype=torch.bool)
    mask[:context, cached:] = torch.ones(context, rows, dtype=torch.bool).tril()  # causal, no block
    return mask


class BlockDraft(nn.Module):
    """fuse(the target's fused features) -> context rows; [embedding(root), mask x (B - 1)] -> block rows;
    `layers` decoder layers over both; the block's rows read out over the draft vocabulary."""

    def __init__(self, lm: LM, reads: Sequence[int], layers: int = 1, intermediate_size: int | None = None,
                 vocab: Sequence[int] | None = None, block_size: int = DEFAULT_BLOCK):
        super().__init__()
        base = lm.model.base_model
        text = lm.config.get_text_config()
        self.reads = tuple(int(i) for i in reads)
        if not self.reads or min(self.reads) < 0 or max(self.reads) >= text.num_hidden_layers:
            raise ValueError(f"a block draft reads target layers in [0, {text.num_hidden_layers}), got {self.reads}")
        cfg = draft_layer_config(lm, layers, intermediate_size)
        d = cfg.hidden_size
        self.block_size = block_size
        self.intermediate_size = cfg.intermediate_size
        self.fuse = nn.Linear(len(self.reads) * d, d, bias=False)
        self.mask = nn.Parameter(torch.randn(d) * 0.02)  # the embedding of a position still to draft
        self.layers = nn.ModuleList(type(base.layers[0])(cfg, layer_idx=i) for i in range(layers))
        init_unset_parameters(lm, self.layers)
        self.vocab, readout = vocab_readout(lm, vocab)
        rotary = type(base.rotary_emb)(config=cfg).to(lm.output_device)  # where the draft runs: see FeatureDraft
        self.target = TargetParts(lm, readout=readout, rotary=rotary)
        self.info: dict = {}
        self.layer_params = sum(m.weight.numel() for m in self.layers.modules() if isinstance(m, nn.Linear))

    @property
    def dtype(self) -> torch.dtype:
        return self.fuse.weight.dtype

    @property
    def readout(self) -> nn.Linear:
        return self.target.readout

    def block_inputs(self, features: torch.Tensor, roots: torch.Tensor, block: int) -> torch.Tensor:
        """features (..., n, F) of committed tokens and roots (..., a) -> rows (..., n + a * block, d): the
        context rows, then per root its block (its embedding, then block - 1 mask rows)."""
        lm = self.target.lm
        context = self.fuse(features.to(self.dtype))
        root = lm.model.get_input_embeddings()(roots.to(lm.device)).to(context)  # (..., a, d)
        masks = self.mask.to(context).expand(*root.shape[:-1], block - 1, -1)  # (..., a, block - 1, d)
        blocks = torch.cat([root[..., None, :], masks], -2).flatten(-3, -2)  # (..., a * block, d)
        return torch.cat([context, blocks], -2)

    def run(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
            cache: KVCache | None = None) -> torch.Tensor:
        """Rows x (..., q, d) at `positions` (q,) through the layers, as `mask` (q, len(cache) + q) allows."""
        return run_layers(self.target, self.layers, x, positions, mask, cache)

    def forward(self, features: torch.Tensor, root: int, cache: KVCache, block: int | None = None) -> torch.Tensor:
        """One draft forward: the committed rows not yet in `cache` (features (n, F), the target's, at the
        positions after it) and the block after them, rooted at token `root` -> the block's outputs
        (block, d). Every row is appended to `cache`; the caller crops the block's."""
        block = block or self.block_size
        n, cached = features.shape[0], len(cache)
        roots = torch.tensor([root], device=features.device)
        x = self.block_inputs(features, roots, block)
        positions = torch.arange(cached, cached + n + block, device=features.device)
        return self.run(x[None], positions, block_mask(n, cached, block), cache)[0, n:]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Over the draft vocabulary (column j is token self.vocab[j])."""
        return read_out(self.target, hidden)

    @cached_property
    def flops(self) -> DraftCost:
        """flops(rows, context, logit_rows) through the layers and the readout (DraftCost); the fuse,
        charged per context row, is `fuse_flops`."""
        return DraftCost.of(self.layer_params, self.layers[0].self_attn.o_proj.weight.shape[1] * len(self.layers),
                            self.readout.weight.numel())

    @cached_property
    def fuse_flops(self) -> float:
        return 2.0 * self.fuse.weight.numel()

    def accuracy(self) -> list[list[float]] | None:
        """acc[i][r]: how often rank r at block position i + 1 was the target's greedy token, on held-out text."""
        return self.info.get("accuracy")


def new_block_draft(lm: LM, reads: Sequence[int] | None = None, layers: int = 1, intermediate_size: int | None = None,
                    vocab: Sequence[int] | None = None, block_size: int = DEFAULT_BLOCK,
                    seed: int | None = None) -> BlockDraft:
    """An untrained block draft (torch's initialisation, from a generator seeded here, so one seed is one
    draft); `seed` perturbs it randomly too, for exactness tests that need drafts that disagree."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0 if seed is None else seed)
        draft = BlockDraft(lm, reads if reads is not None else block_reads(lm), layers, intermediate_size, vocab,
                           block_size)
        if seed is not None:
            with torch.no_grad():
                for p in draft.parameters():
                    p.add_(torch.randn(p.shape) * 0.3)
    draft.requires_grad_(False)  # trained only by scripts/train_block_draft.py, which turns this back on
    return draft.to(device=lm.output_device, dtype=lm.dtype).eval()


def save_block_draft(draft: BlockDraft, path: str | Path, info: dict) -> None:
    lm = draft.target.lm
    full = lm.vocab_size
    vocab = (None if len(draft.vocab) == full and bool((draft.vocab == torch.arange(full)).all())
             else draft.vocab.tolist())
    save_weights(draft, path, BLOCK_FORMAT, {
        "hidden_size": str(draft.fuse.weight.shape[0]), "vocab_size": str(full), "vocab": json.dumps(vocab),
        "reads": json.dumps(list(draft.reads)), "layers": str(len(draft.layers)),
        "intermediate_size": str(draft.intermediate_size), "block_size": str(draft.block_size),
        "info": json.dumps(info)})


def load_block_draft(lm: LM, path: str | Path, check_base: bool = True) -> BlockDraft:
    """Our block draft file, checked against `lm` (vocabulary, hidden size, base model, layers read)."""
    key = "decoder.draft_weights"
    meta, state, info = load_checked(
        lm, path, BLOCK_FORMAT, key, "block draft file",
        "train one with scripts/train_block_draft.py or set decoder.draft_weights=null for an untrained draft",
        check_base=check_base)
    where = addon_path(path)
    vocab = meta_json(meta, "vocab", key, where, "null")
    reads = meta_json(meta, "reads", key, where, "null")
    if vocab is not None and not (isinstance(vocab, list) and all(type(t) is int for t in vocab)):
        raise ValueError(f"{key}: {where} has metadata vocab that is not a list of token ids; replace the file")
    if not (isinstance(reads, list) and reads and all(type(i) is int for i in reads)):
        raise ValueError(f"{key}: {where} has metadata reads that is not a list of target layers; replace the file")
    try:
        draft = new_block_draft(lm, reads, meta_int(meta, "layers", key, where),
                                meta_int(meta, "intermediate_size", key, where), vocab,
                                meta_int(meta, "block_size", key, where))
    except ValueError as e:  # layers the target does not have, token ids outside its vocabulary
        raise ValueError(f"{key}: {where}: {e}") from None
    load_state(draft, {k: v.to(draft.dtype) for k, v in state.items()}, key, where, "a block draft of this shape")
    draft.info = info
    return draft


def block_draft_for(lm: LM, path: str | None, seed: int | None, check_base: bool = True,
                    dtype: str | None = None) -> BlockDraft:
    """The draft at `path`, or an untrained (seed: random) one without one; its own weights in `dtype`
    (None: the target's), on the target's fast path."""
    draft = load_block_draft(lm, path, check_base) if path else new_block_draft(lm, seed=seed)
    return ready_draft(lm, draft, dtype)


@torch.inference_mode()
def block_seconds(lm: LM, draft: BlockDraft, block: int, context: int = 64, repeats: int = 5) -> float:
    """Seconds of a step's drafting: one draft forward of a committed row and a block of `block` rows
    after `context` cached positions, read out and ranked (as BlockDraftProposer does), each timed after
    an untimed one-token target forward (as it follows verification in a step); the median of `repeats`,
    after one untimed warm-up."""
    prompt = torch.randint(0, lm.vocab_size, (context + 1,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = lm.new_cache()
    _, feats = lm.forward(prompt[:context], cache, features=draft.reads)
    dcache = KVCache(DynamicCache())
    draft(feats[:-1], prompt[context - 1], dcache, block)  # the draft's context, as after a prefill
    dcache.crop(context - 1)
    times = []
    for _ in range(repeats + 1):
        lm.forward(prompt[context:], cache)
        cache.crop(context)
        lm.sync()
        start = time.perf_counter()
        out = draft(feats[-1:], prompt[context], dcache, block)
        torch.log_softmax(draft.logits(out[1:]).float(), -1).topk(min(8, len(draft.vocab)), -1)
        lm.sync()
        times.append(time.perf_counter() - start)
        dcache.crop(context - 1)
    return statistics.median(times[1:])

