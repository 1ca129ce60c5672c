"""EAGLE's draft (Li et al. 2024) and its file: a one-layer draft over the target's own features.

The draft reads the target's features at position t (its last layer's output, before the final
norm) and the embedding of token t+1, fuses them (a 2d -> d linear), runs one decoder layer of the
target's own architecture (transformers' class, a fresh copy) and predicts the features at t+1;
the target's own final norm and output head read the next token from them. The proposer
(eagle.py) drafts with it autoregressively in feature space.

The readout may be limited to a draft vocabulary (the file's `vocab`: the tokens the target
emits most, as in FR-Spec and EAGLE-3): a full 49k-row head costs this 135M target about a fifth
of its own step, paid again at every depth. A token outside it is never drafted.

`load_draft` also reads a published EAGLE-1/2 or EAGLE-3 checkpoint (published.py): the proposer
reads any draft through the same few members (`reads`, `from_target`, forward, `logits`, `vocab`,
`flops`).
"""
from __future__ import annotations

import copy
import json
import statistics
import time
from functools import cached_property
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from transformers import DynamicCache

from ..core.kv_cache import KVCache, cache_kwarg, causal_mask
from ..core.layer_types import full_attention_config, rotary_embeddings
from ..core.lm import LM, DraftCost, TargetParts
from ..core.weights_file import addon_path, is_checkpoint_dir, load_checked, load_state, meta_json, save_weights

EAGLE_FORMAT = "eagle-draft-v1"


def draft_layer_config(lm: LM, layers: int = 1, intermediate_size: int | None = None):
    """`layers` decoder layers of the target's class that attend to everything the draft holds: the draft's
    masks are its own, whatever window the target's layers have. `intermediate_size`: a narrower MLP than
    the target's (a smaller draft file; None: the target's)."""
    cfg = copy.deepcopy(lm.config.get_text_config())
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = (cfg.layer_types * layers)[:layers]
    if intermediate_size is not None:
        cfg.intermediate_size = intermediate_size
    return full_attention_config(cfg)


def init_unset_parameters(lm: LM, layers: nn.Module) -> None:
    """Initialise, by the target family's own rule (its _init_weights), what a decoder layer's constructor
    leaves unset: a mixture of experts' expert and router weights and gpt-oss's attention sinks are
    torch.empty (memory as it was: NaN in a random draft's logits). Linear, embedding and norm modules keep
    their constructor's values (a dense layer's initialisation, and the draws it takes, are unchanged)."""
    for module in layers.modules():
        if (isinstance(module, (nn.Linear, nn.Embedding)) or "Norm" in type(module).__name__
                or not any(True for _ in module.parameters(recurse=False))):
            continue
        with torch.no_grad():
            lm.model._init_weights(module)


def vocab_readout(lm: LM, vocab: Sequence[int] | None) -> tuple[torch.Tensor, nn.Linear]:
    """(the draft vocabulary's token ids (V',), a readout over them): the target's head itself for the
    whole vocabulary, else a copy of its rows; frozen, never saved (the ids go in the file's metadata)."""
    head = lm.model.get_output_embeddings()
    d, full = head.weight.shape[1], head.weight.shape[0]
    ids = torch.as_tensor(list(vocab) if vocab is not None else range(full), dtype=torch.long)
    if len(ids) == 0 or int(ids.min()) < 0 or int(ids.max()) >= full:
        raise ValueError(f"a draft vocabulary holds token ids in [0, {full}), got {len(ids)} ids")
    readout = nn.Linear(d, len(ids), bias=head.bias is not None)
    with torch.no_grad():
        readout.weight = head.weight if vocab is None else nn.Parameter(head.weight[ids].clone())
        if head.bias is not None:
            readout.bias = nn.Parameter(head.bias[ids].clone())
    readout.requires_grad_(False)
    return ids, readout


def read_out(target: TargetParts, features: torch.Tensor) -> torch.Tensor:
    """A draft's logits over its vocabulary: the target's final norm (in its dtype), then the readout (a
    draft_dtype draft casts there) and the target's logit soft-cap."""
    readout = target.readout
    return target.lm.cap_logits(readout(target.lm.final_norm(features).to(readout.weight.dtype)))


def run_layers(target: TargetParts, layers: Sequence[nn.Module], x: torch.Tensor, positions: torch.Tensor,
               mask: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
    """x (..., q, d) at `positions` (q,) through decoder layers of the target's class, each row seeing the
    keys `mask` (q, len(cache) + q) allows, with the full-attention rotary table; rows are appended to
    `cache` when given."""
    pos = positions.reshape(1, -1).to(x.device)
    mask4 = target.lm.mask_4d(mask).to(x.device)
    rope = rotary_embeddings(target.rotary, x, pos, "full_attention")
    for layer in layers:
        out = layer(x, attention_mask=mask4, position_ids=pos,
                    **{cache_kwarg(layer): cache.hf if cache is not None else None},
                    use_cache=cache is not None, position_embeddings=rope)
        x = out[0] if isinstance(out, tuple) else out
    return x


class FeatureDraft(nn.Module):
    """fuse(features_t, embedding(token_t+1)) -> one decoder layer -> features_t+1. Only `fuse`
    and `layer` are trained and saved; the embedding, final norm and head are the target's."""

    def __init__(self, lm: LM, vocab: Sequence[int] | None = None):
        super().__init__()
        base = lm.model.base_model
        cfg = draft_layer_config(lm)
        d = cfg.hidden_size
        self.fuse = nn.Linear(2 * d, d)
        self.layer = type(base.layers[0])(cfg, layer_idx=0)
        init_unset_parameters(lm, self.layer)
        # Identity start: features_t+1 := features_t (the fuse passes the features through, the layer's
        # residual branches output zero), a stable point to train from.
        with torch.no_grad():
            self.fuse.weight.zero_()
            self.fuse.weight[:, :d] = torch.eye(d)
            self.fuse.bias.zero_()
            for name, module in self.layer.named_modules():
                if name.endswith(("o_proj", "down_proj")) and isinstance(module, nn.Linear):
                    module.weight.zero_()
        self.vocab, readout = vocab_readout(lm, vocab)
        # The readout (a slice of the target's head) and the rotary table: target parts, neither trained nor saved.
        # The table sits where the draft runs: transformers copies it to the input's device at every call
        # (on a GPU a wait for the host each draft forward: 5 a step for eagle on an H200).
        rotary = type(base.rotary_emb)(config=cfg).to(lm.output_device)
        self.target = TargetParts(lm, readout=readout, rotary=rotary)
        self.info: dict = {}
        self.dense_params = sum(m.weight.numel() for m in (self.fuse, *self.layer.modules())
                                if isinstance(m, nn.Linear))

    # What the proposer asks of a draft (the published layouts in published.py answer the same):
    reads = True  # the target's features it reads (LM.forward's `features`): the last layer's output, pre-norm

    def from_target(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features -> the draft's input features (here the same)."""
        return features

    @property
    def dtype(self) -> torch.dtype:
        return self.fuse.weight.dtype

    @property
    def readout(self) -> nn.Linear:
        return self.target.readout

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                cache: KVCache | None = None) -> torch.Tensor:
        """features (..., q, d) and tokens (..., q) at `positions` (q,), each row seeing the keys
        `mask` (q, len(cache) + q) allows -> predicted next features (..., q, d). Rows are appended
        to `cache` when given."""
        lm = self.target.lm
        batched = features.dim() == 3
        if not batched:
            features, tokens = features[None], tokens[None]
        # The embedding sits at the model's input (lm.device), the features at its output (lm.output_device).
        x = self.fuse(torch.cat([features, lm.model.get_input_embeddings()(tokens.to(lm.device)).to(features)], -1))
        out = run_layers(self.target, [self.layer], x, positions, mask, cache)
        return out if batched else out[0]

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Over the draft vocabulary (column j is token self.vocab[j])."""
        return read_out(self.target, features)

    @cached_property
    def flops(self) -> DraftCost:
        """flops(rows, context, logit_rows): one forward's FLOPs (DraftCost)."""
        return DraftCost.of(self.dense_params, self.layer.self_attn.o_proj.weight.shape[1], self.readout.weight.numel())

    def accuracy(self) -> list[list[float]] | None:
        """acc[j][r]: how often rank r at depth j + 1 was the target's greedy token, on held-out text."""
        return self.info.get("accuracy")


DEPTH_AFTER = ("target", "draft")  # what precedes a timed depth: verification (a step's first), or a depth


@torch.inference_mode()
def depth_timer(lm: LM, draft: nn.Module, top_k: int, context: int) -> Callable[[int, str], float]:
    """time_depth(k, after): seconds of one drafting depth of k rows after `context` cached positions
    (the rows through the draft, then its readout, log-softmax and top-k, as FeatureDraftProposer
    does at every depth), timed after an untimed `after`:
    - "target": a one-token target forward, as a step's first depth follows verification (it takes
      the draft out of the caches: timed back to back, a depth cost two thirds of its in-run time on
      a CPU);
    - "draft": another depth of as many rows, as every later depth of a step follows the one before.
    The draft's cache is filled once from the target's own features of a random prompt, as at a prefill."""
    prompt = torch.randint(0, lm.vocab_size, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = lm.new_cache()
    _, feats = lm.forward(prompt, cache, features=draft.reads)
    dcache = KVCache(DynamicCache())  # the draft's own cache, as FeatureDraftProposer keeps it
    dtype = draft.dtype
    g = draft(draft.from_target(feats.to(dtype)).to(dtype), torch.tensor(prompt, device=feats.device),
              torch.arange(context), causal_mask(context, 0), dcache)  # (context, d): predicted features
    vocab = draft.vocab.to(g.device)
    step = torch.tensor([prompt[-1]])

    inputs: dict[int, tuple] = {}  # k -> a depth's inputs, made once, outside the timing

    def depth(k: int) -> None:
        if k not in inputs:
            inputs[k] = (g[-1:].expand(k, -1).contiguous(),  # (k, d): a depth's parents' features
                         vocab[torch.arange(k) % len(vocab)], torch.full((k,), context, device=g.device),
                         torch.cat([torch.ones(k, context, dtype=torch.bool, device=g.device),
                                    torch.eye(k, dtype=torch.bool, device=g.device)], 1))  # mask (k, context + k)
        out = draft(*inputs[k], dcache)
        torch.log_softmax(draft.logits(out).float(), dim=-1).topk(min(top_k, len(vocab)), dim=-1)

    @torch.inference_mode()
    def time_depth(k: int, after: str) -> float:
        if k not in inputs:  # before what precedes the timed call: making them runs the draft
            depth(k)
            dcache.crop(context)
        if after == "target":
            lm.forward(step, cache)
            cache.crop(context)
        elif after == "draft":
            depth(k)
            dcache.crop(context)
        else:
            raise ValueError(f"after={after!r}: one of {', '.join(DEPTH_AFTER)}")
        lm.sync()
        start = time.perf_counter()
        depth(k)
        lm.sync()
        seconds = time.perf_counter() - start
        dcache.crop(context)
        return seconds

    return time_depth


def depth_seconds(lm: LM, draft: nn.Module, top_k: int, context: int, rows: Sequence[int], repeats: int) -> list[float]:
    """Seconds of a step's first drafting depth (depth_timer, after the target's forward) for each
    count in `rows`: the median of `repeats` calls, after one untimed warm-up."""
    time_depth = depth_timer(lm, draft, top_k, context)
    return [statistics.median([time_depth(k, "target") for _ in range(repeats + 1)][1:]) for k in rows]


def new_draft(lm: LM, vocab: Sequence[int] | None = None, seed: int | None = None) -> FeatureDraft:
    """An untrained draft (it predicts that features stay as they are); `seed` perturbs it randomly,
    for exactness tests that need drafts that disagree. The layer's own initialisation draws from a
    generator seeded here too, so one seed is one draft (it drew from the global one, which the
    perturbation then exposed: two drafts of one seed differed)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0 if seed is None else seed)
        draft = FeatureDraft(lm, vocab)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in draft.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    draft.requires_grad_(False)  # trained only by scripts/train_eagle.py, which turns this back on
    # Beside its input (the last layer's features), the final norm and the head: lm.output_device.
    return draft.to(device=lm.output_device, dtype=lm.dtype).eval()


def save_draft(draft: FeatureDraft, path: str | Path, info: dict) -> None:
    full = draft.target.lm.vocab_size
    vocab = (None if len(draft.vocab) == full and bool((draft.vocab == torch.arange(full)).all())
             else draft.vocab.tolist())
    save_weights(draft, path, EAGLE_FORMAT, {"hidden_size": str(draft.fuse.weight.shape[0]), "vocab_size": str(full),
                                             "vocab": json.dumps(vocab), "info": json.dumps(info)})


def load_draft(lm: LM, path: str | Path, check_base: bool = True, dtype: str | None = None):
    """Our draft file, or a published EAGLE-1/2 or EAGLE-3 checkpoint (a directory or a hub id); its
    own weights in `dtype` (decoder.draft_dtype; None: the target's)."""
    if is_checkpoint_dir(path):
        from .published import load_eagle

        draft = load_eagle(lm, path, check_base)
    else:
        meta, state, info = load_checked(
            lm, path, EAGLE_FORMAT, "decoder.draft_weights", "EAGLE draft file",
            "train one with scripts/train_eagle.py or set decoder.draft_weights=null for an untrained draft",
            check_base=check_base)
        where = addon_path(path)
        vocab = meta_json(meta, "vocab", "decoder.draft_weights", where, "null")
        if vocab is not None and not (isinstance(vocab, list) and all(isinstance(t, int) for t in vocab)):
            raise ValueError(f"decoder.draft_weights: {where} has metadata vocab that is not a list of token ids; "
                             "replace the file")
        draft = new_draft(lm, vocab)
        load_state(draft, {k: v.to(draft.fuse.weight.dtype) for k, v in state.items()}, "decoder.draft_weights",
                   where, "an EAGLE draft of this target's shape")
        draft.info = info
    return ready_draft(lm, draft, dtype)


def draft_for(lm: LM, path: str | None, seed: int | None, check_base: bool = True, dtype: str | None = None):
    """The draft at `path` (our file or a published checkpoint), or an untrained (seed: random) draft
    without one; its own weights in `dtype` (decoder.draft_dtype; None: the target's)."""
    return load_draft(lm, path, check_base, dtype) if path else ready_draft(lm, new_draft(lm, seed=seed), dtype)


def ready_draft(lm: LM, draft: nn.Module, dtype: str | None) -> nn.Module:
    """In its dtype, then on the target's fast path."""
    if dtype is not None and DRAFT_DTYPES[dtype] != draft.dtype:
        draft_in_dtype(draft, DRAFT_DTYPES[dtype])
    lm.accelerate(draft.readout)
    return lm.accelerate(draft)


DRAFT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def draft_in_dtype(draft: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The draft's own weights in `dtype`, its reduced readout (a copy of the head's rows) included;
    what it reads from the target (the embedding, the final norm, a whole-vocabulary head it shares)
    stays in the target's dtype, and the draft casts at those seams. Every layer it runs reads half
    the bytes in bfloat16: on a CPU the draft's cost is the time to read its weights."""
    draft.to(dtype=dtype)
    readout, head = draft.readout, draft.target.lm.model.get_output_embeddings()
    if readout is not head and readout.weight is not head.weight:
        readout.to(dtype=dtype)
    return draft
