"""Sequoia's inputs measured on a model: the acceptance vector (how often the draft's k-th child is
the one the target accepts), its file format and cache, and the target's and draft's latencies.
The tree they feed is computed in sequoia_tree.py.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..core.lm import LM
from ..core.sampling import Sampling, probs
from ..core.tree import TokenTree
from ..core.verify import verify_sampling
from .profile import forward_latency, step_cost
from .sequoia_tree import check_acceptance, cumulative

ACCEPTANCE_FORMAT = "sequoia-acceptance-v1"


# ---- acceptance vectors on disk ---------------------------------------------------------
def save_acceptance(path: str | os.PathLike, acceptance: Sequence[float], info: dict) -> None:
    """JSON: the vector, its cumulative sums (P(some child among the first k is accepted)) and provenance."""
    p = check_acceptance(acceptance)
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"format": ACCEPTANCE_FORMAT, "acceptance": p, "cumulative": cumulative(p), "info": info}
    tmp = path.with_suffix(f".tmp{os.getpid()}")  # per process: two writers of one entry must not share it
    tmp.write_text(json.dumps(body, indent=1, default=str))
    tmp.replace(path)


def load_acceptance(path: str | os.PathLike) -> list[float]:
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"no acceptance vector at {path}; measure one with scripts/measure_acceptance.py")
    try:
        body = json.loads(path.read_bytes())
    except ValueError as e:  # not JSON, or not UTF-8
        raise ValueError(f"{path} is not an acceptance vector: not JSON ({str(e).split(':')[0]}); measure one with "
                         "scripts/measure_acceptance.py") from None
    if not isinstance(body, dict) or body.get("format") != ACCEPTANCE_FORMAT or "acceptance" not in body:
        raise ValueError(f"{path} is not an acceptance vector (format {ACCEPTANCE_FORMAT!r} expected)")
    return check_acceptance(body["acceptance"])


def profile_latency(profile: dict) -> Callable[[int], float]:
    """Seconds of a forward of n tokens from a decoders.tuning.profile latency profile (extrapolated past its end)."""
    return lambda n: step_cost(profile, n) * profile["autoregressive_s"]


def device_latency(lm: LM, draft: LM, cache_dir=None, max_tokens: int = 64) -> tuple[Callable, Callable, float]:
    """(target latency, draft latency, one autoregressive target step in seconds) on this
    device, from the cached profiles of both LMs (measured on first use)."""
    target = forward_latency(lm, cache_dir, max_tokens=max_tokens)
    drafter = forward_latency(draft, cache_dir, max_tokens=max_tokens)
    return profile_latency(target), profile_latency(drafter), float(target["autoregressive_s"])


# ---- measuring the acceptance vector ----------------------------------------------------
def _greedy_rank(target_logits: torch.Tensor, draft_logits: torch.Tensor, K: int) -> tuple[int, int]:
    """(rank 1..K of the target's argmax among the draft's top K, 0 if absent; next token)."""
    token = int(torch.argmax(target_logits))
    top = torch.topk(draft_logits, K).indices.tolist()
    first = int(torch.argmax(draft_logits))  # the rank-1 child is the draft's argmax, as a chain drafts it
    if top[0] != first:  # topk may order exact ties differently from argmax
        if first in top:
            top.remove(first)
        else:
            top.pop()
        top.insert(0, first)
    return (top.index(token) + 1 if token in top else 0), token


def _sampled_rank(target_p: torch.Tensor, draft_q: torch.Tensor, K: int, generator) -> tuple[int, int]:
    """K draft tokens drawn without replacement, verified as one tree level by Sequoia's
    sequential rejection. Returns (the accepted child's rank, 0 if none; the committed token,
    which is distributed as the target's)."""
    n = min(K, int((draft_q > 0).sum()))
    drafts = torch.multinomial(draft_q, n, replacement=False, generator=generator).tolist()
    tree = TokenTree([0, *drafts], [-1] + [0] * n)
    path, bonus = verify_sampling(tree, target_p.expand(len(tree), -1), draft_q.expand(len(tree), -1),
                                  generator, without_replacement=True)
    if len(path) > 1:
        return path[1], tree.tokens[path[1]]
    return 0, bonus


def acceptance_counts(lm: LM, draft: LM, prompt_ids_list: Sequence[Sequence[int]], K: int,
                      sampling: Sampling | None, max_new_tokens: int) -> tuple[list[int], int]:
    """How often each rank 1..K was the accepted child, over every generated position, and the
    number of positions. The target generates (greedy, or sampling through the verification
    itself); target and draft each take one cached forward per position."""
    if not (isinstance(K, int) and 1 <= K <= min(lm.vocab_size, draft.vocab_size)):
        raise ValueError(f"K (children per node) must be an integer in [1, vocab size], got {K!r}")
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    sampling = sampling or Sampling()
    warpers = sampling.warpers()
    generator = sampling.generator(lm.output_device)
    counts, positions = [0] * (K + 1), 0  # counts[0]: no child accepted
    for prompt in prompt_ids_list:
        prompt = list(prompt)
        room = max_new_tokens if lm.max_context is None else min(max_new_tokens, lm.max_context - len(prompt))
        if room < 1:
            continue
        cache, draft_cache = lm.new_cache(), draft.new_cache()
        t_logits = lm.forward(prompt, cache, last_only=True)[-1]
        d_logits = draft.forward(prompt, draft_cache, last_only=True)[-1].to(t_logits.device)
        for i in range(room):
            if sampling.greedy:
                rank, token = _greedy_rank(t_logits, d_logits, K)
            else:
                p = probs(t_logits[None], sampling, warpers)[0]
                q = probs(d_logits[None], sampling, warpers)[0]
                rank, token = _sampled_rank(p, q, K, generator)
            counts[rank] += 1
            positions += 1
            if token in lm.stop_ids or i == room - 1:
                break
            t_logits = lm.forward([token], cache, last_only=True)[-1]
            d_logits = draft.forward([token], draft_cache, last_only=True)[-1].to(t_logits.device)
    return counts[1:], positions


def measure_acceptance(lm: LM, draft: LM, prompt_ids_list: Sequence[Sequence[int]], K: int,
                       sampling: Sampling | None, max_new_tokens: int) -> list[float]:
    """p_k, k = 1..K: the share of generated positions where the draft's k-th child is the accepted one."""
    counts, positions = acceptance_counts(lm, draft, prompt_ids_list, K, sampling, max_new_tokens)
    if not positions:
        raise ValueError("no position measured: every prompt fills the model's context")
    return [c / positions for c in counts]


def model_fingerprint(lm: LM, shared_with: LM | None = None) -> str:
    """Name, config, dtype, and a checksum of the weights not shared with `shared_with` (a
    self-draft's exit adapter; all of a separate draft's)."""
    if not hasattr(lm, "model"):  # llama.cpp: no torch weights; its file's hash says which
        own = [getattr(lm, "weights_id", None)]
    else:
        shared = {p.data_ptr() for p in getattr(shared_with, "model", torch.nn.Module()).parameters()}
        own = [(n, tuple(p.shape), round(float(p.detach().double().sum()), 6))
               for n, p in lm.model.named_parameters() if p.data_ptr() not in shared]
    config = json.dumps(lm.config.to_dict(), sort_keys=True, default=str)
    raw = json.dumps([lm.name, config, str(lm.dtype), own if shared_with is not None else []], default=str)
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


def cached_acceptance(lm: LM, draft: LM, prompt_ids_list: Sequence[Sequence[int]], K: int,
                      sampling: Sampling | None, max_new_tokens: int, *, cache_dir=None, info: dict | None = None
                      ) -> list[float]:
    """measure_acceptance, cached under cache_dir/acceptance/ keyed by target, draft, the
    calibration prompts' hash, temperature/top_p/top_k (and seed when sampling), K and length."""
    sampling = sampling or Sampling()
    prompts = [list(map(int, p)) for p in prompt_ids_list]
    key = {"target": model_fingerprint(lm), "draft": model_fingerprint(draft, shared_with=lm),
           "prompts": hashlib.sha1(json.dumps(prompts).encode()).hexdigest()[:16],
           "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
           "seed": None if sampling.greedy else sampling.seed, "K": K, "max_new_tokens": max_new_tokens}
    path = None
    if cache_dir:
        digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        path = Path(cache_dir).expanduser() / "acceptance" / f"sequoia-{digest}.json"
        if path.exists():
            return load_acceptance(path)
    counts, positions = acceptance_counts(lm, draft, prompts, K, sampling, max_new_tokens)
    if not positions:
        raise ValueError("no position measured: every calibration prompt fills the model's context")
    acceptance = [c / positions for c in counts]
    if path is not None:
        save_acceptance(path, acceptance, {**(info or {}), **key, "target_name": lm.name, "draft_name": draft.name,
                                           "prompts_count": len(prompts), "positions": positions})
    return acceptance
