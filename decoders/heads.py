"""Extra prediction heads on the target's last hidden state (Medusa; blockwise parallel decoding),
their file format, and the decode loop both methods share.

Head i maps the hidden state at position t to a distribution over the token at t + i + 2 (the
model's own head predicts t + 1). Each head is Medusa's residual block, h + SiLU(W h + b) with
W zero-initialised, followed by the model's own output projection (tied, so it is neither
trained nor stored): an untrained head repeats the model's next-token prediction. The K
blocks' outputs go through the shared projection as one (K, d) x (d, V) matmul, so the
vocabulary matrix is read once per step whatever K is.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from .lm import LM
from .sampling import Sampling, next_token, probs
from .trace import Generation, Tracer, truncate_at_stop
from .tree import TokenTree
from .verify import verify_greedy, verify_sampling
from .weights_file import load_weights, save_weights

HEADS_FORMAT = "medusa-heads-v1"
REPO = Path(__file__).resolve().parent.parent


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + nn.functional.silu(self.linear(h))


class Heads(nn.Module):
    """K residual blocks sharing the target's (frozen) output projection."""

    def __init__(self, lm_head: nn.Module, hidden_size: int, k: int):
        super().__init__()
        self.blocks = nn.ModuleList(ResBlock(hidden_size) for _ in range(k))
        self.lm_head = [lm_head]  # a list: not a submodule, so neither trained nor saved
        self.info: dict = {}

    @property
    def k(self) -> int:
        return len(self.blocks)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (..., d) -> logits (K, ..., V)."""
        stacked = torch.stack([block(hidden) for block in self.blocks])
        return self.lm_head[0](stacked)

    def flops(self) -> float:
        """FLOPs of one application (one hidden state): K blocks and K vocabulary projections."""
        d = self.blocks[0].linear.weight.shape[0]
        vocab = self.lm_head[0].weight.shape[0]
        return self.k * (2.0 * d * d + 2.0 * d * vocab)

    def accuracy(self) -> list[list[float]] | None:
        """Measured top-r accuracy per head (rows: heads; columns: rank r's hit rate), if recorded."""
        return self.info.get("accuracy")


def new_heads(lm: LM, k: int, seed: int | None = None) -> Heads:
    """Untrained heads (each repeats the model's next-token prediction until trained); `seed`
    perturbs them randomly instead, for exactness tests that need heads that disagree."""
    hidden = lm.config.get_text_config().hidden_size
    heads = Heads(lm.model.get_output_embeddings(), hidden, k)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        for p in heads.parameters():
            p.data = torch.randn(p.shape, generator=gen) * 0.5
    ref = lm.model.get_input_embeddings().weight
    heads.requires_grad_(False)  # trained only by scripts/train_heads.py, which turns this back on
    return heads.to(device=ref.device, dtype=ref.dtype).eval()


def resolve(path: str | Path) -> Path:
    """As given, or relative to the repository (the shipped heads/)."""
    p = Path(path).expanduser()
    return p if p.is_absolute() or p.exists() else REPO / p


def save_heads(heads: Heads, path: str | Path, info: dict) -> None:
    save_weights(heads, path, HEADS_FORMAT, {"k": str(heads.k), "hidden_size": str(heads.blocks[0].linear.weight.shape[0]),
                                             "info": json.dumps(info)})


def load_heads(lm: LM, path: str | Path) -> Heads:
    path = resolve(path)
    meta, state = load_weights(path, HEADS_FORMAT, "decoder.heads", "heads file",
                               "train one with scripts/train_heads.py or set decoder.heads=null for untrained heads")
    hidden = lm.config.get_text_config().hidden_size
    if int(meta["hidden_size"]) != hidden:
        raise ValueError(f"decoder.heads: {path} was trained for hidden size {meta['hidden_size']}; "
                         f"{lm.name} has {hidden}")
    heads = new_heads(lm, int(meta["k"]))
    heads.load_state_dict({k: v.to(heads.blocks[0].linear.weight.dtype) for k, v in state.items()})
    heads.info = json.loads(meta.get("info", "{}"))
    return lm.accelerate(heads)


class HeadsCache:
    """One loaded set of heads per target (decoders are built once and called per prompt)."""

    def __init__(self):
        self._key = None
        self._heads: Heads | None = None

    def get(self, lm: LM, path: str | None, k: int, seed: int | None) -> Heads:
        if self._key is not lm:
            self._heads = load_heads(lm, path) if path else new_heads(lm, k, seed)
            self._key = lm
        return self._heads


# A proposer turns the committed sequence (its last token is the root, not yet in the target's
# cache) and the heads' logits (K, V) into a tree to verify, plus drafting FLOPs beyond the
# heads (rescoring) and step info.
Proposer = Callable[[Sequence[int], torch.Tensor], tuple[TokenTree, float, dict]]


def heads_decode(lm: LM, heads: Heads, prompt_ids: Sequence[int], max_new_tokens: int, sampling: Sampling, stop_ids,
                 propose: Proposer, accept: Callable | None = None) -> Generation:
    """The loop Medusa and BPD share. Each target pass feeds the root (last committed token)
    and the proposed tree, and returns logits and hidden states for every node; the heads then
    run on the hidden state of the last accepted node, whose logits give the bonus token.

    Candidates are deterministic (top-k of the heads), so greedy verification is exact and
    sampling uses deterministic-candidate acceptance (exact in distribution). `accept`
    replaces verification (typical acceptance, lossy)."""
    tracer = Tracer(lm.sync)
    cache = lm.new_cache()
    warpers = sampling.warpers()
    generator = sampling.generator(lm.device)
    prompt = list(prompt_ids)
    head_flops = heads.flops()
    with tracer.target():  # the prefill commits the first token
        logits, hidden = lm.forward(prompt, cache, last_only=True, hidden=True)
    tokens = [next_token(logits[-1], sampling, generator, warpers)]
    state = hidden[-1]
    tracer.end_step(accepted=1, forward_tokens=len(prompt), context_tokens=0)
    while tokens[-1] not in stop_ids and len(tokens) < max_new_tokens:
        sequence = prompt + tokens
        context = len(cache)
        with tracer.draft(), torch.inference_mode():
            head_logits = heads(state).float()
            tree, rescore_flops, info = propose(sequence, head_logits)
        with tracer.target():
            logits, hidden = lm.forward(tree.tokens, cache, position_ids=tree.position_ids(context),
                                        mask=tree.attention_mask(context), hidden=True)
        if accept is not None:
            path, bonus = accept(tree, logits, generator)
        elif sampling.greedy:
            path, bonus = verify_greedy(tree, logits)
        else:
            path, bonus = verify_sampling(tree, probs(logits, sampling, warpers), None, generator)
        new = truncate_at_stop([tree.tokens[i] for i in path[1:]] + [bonus], stop_ids, max_new_tokens - len(tokens))
        tokens += new
        cache.keep(list(range(context)) + [context + i for i in path])
        state = hidden[path[-1]]
        tracer.end_step(accepted=len(new), forward_tokens=len(tree), context_tokens=context,
                        draft_tokens=len(tree) - 1, accepted_draft_tokens=min(len(path) - 1, len(new)),
                        draft_forward_tokens=1, draft_flops=head_flops + rescore_flops,
                        info={"draft_depth": max(tree.depths), "accepted_depth": len(path) - 1, "tree_size": len(tree),
                              "paths": len(tree.leaves()), "head_flops": head_flops, "rescore_flops": rescore_flops,
                              **info})
    return tracer.finish(tokens, stop_ids)


def check_hyper(owner: str, **values) -> None:
    for key, value in values.items():
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ValueError(f"{owner}.{key} must be an integer >= 1, got {value!r}")

