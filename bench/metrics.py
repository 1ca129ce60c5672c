"""Every metric the harness reports, defined once (DESIGN.md, Metrics).

- steps: target forward passes, prefill included (autoregressive: steps == new tokens).
- tokens per step (compression): new tokens / steps, summed over prompts before dividing.
- FLOPs of a forward: 2 x matmul parameters x tokens (Kaplan et al.'s 2N; the input
  embedding is a lookup and does not count, a tied output head is a matmul and does), plus
  attention 4 x layers x d_attn for every (query, key) pair where each new token attends to
  the cache and to the new tokens before it in the pass (exact for chains and prefill; for
  tree/window masks it is the lower-triangle work a dense masked kernel does).
- mean_accepted_tokens (Spec-Bench's "mean accepted tokens"): new tokens / steps with the
  prefill step left out of both (its one token would pull short generations toward 1); the
  bonus token a verification step emits counts. decode_flops_per_step: target + draft FLOPs
  per such step, leaving out the target's prefill and the draft's pass over the prompt
  (Step.draft_prefill_flops). The scaling law uses these two.
- accepted tokens by output position (`accepted_by_output_position`): mean_accepted_tokens over
  the decoding steps whose position in the output (trace.position: new tokens committed before
  the step) falls in each bin of positions; it shows whether a method's acceptance holds up as
  an answer grows long.
- acceptance_rate: accepted draft tokens / draft tokens proposed (`acceptance_rate`).
- acceptance as engines and papers define it (docs/acceptance.md gives each one's source; all count
  accepted drafts as committed, so a step cut at a stop token or the length limit counts what it kept):
  - vllm_mean_acceptance_length (vLLM's "mean acceptance length"): 1 + accepted draft tokens / the
    steps that verified drafts (a step without drafts is left out, the bonus counts once a step);
  - vllm_acceptance_by_position (vLLM's "per-position acceptance rate"): for position k, the steps
    that verified drafts and accepted at least k of them / all steps that verified drafts;
  - sglang_accept_length (SGLang's "accept len"): over the decoding steps (prefill left out), accepted
    draft tokens + 1 per step, per step, whether the step had drafts or its bonus was cut;
  - eagle_tau (EAGLE's tau, as the authors' evaluation computes it): per output, its decoding
    steps' accepted drafts + 1 each over the index of its last step (decoding steps - 1), averaged over
    a question's turns and then over questions; an output of fewer than two decoding steps is left out.
  Each record keeps what they count (`acceptance_counts`: draft_steps, accepted_at_least,
  verified_tokens); an older record has them from its trace.
- pool hit rate (n-gram pool methods, whose steps record info["hit"]): share of steps in
  which at least one candidate token was accepted.
- tokens/s: new tokens / wall latency summed over prompts; medians and quartiles per prompt.
- speedup, against autoregressive on the same prompts in the same process (the leaderboard's
  autoregressive entry; a run's check_lossless=true reference), three names, computed only by
  `speedups` below:
  - speedup (the default everywhere; Spec-Bench's, so figures compare with the field): the mean
    over prompts of tokens/s, divided by the reference's mean over the same prompts;
  - speedup_geomean: the geometric mean over prompts of reference latency / decoder latency
    (every prompt weighs the same, whatever its length);
  - speedup_pooled: summed tokens / summed seconds, divided by the reference's.
- speedup_per_run_median / _p25 / _p75: the spread behind `speedup`: per timed run (a prompt,
  and a repeat of it where the leaderboard repeats prompts: leaderboard.repeats), the run's
  tokens/s over the reference's on the same prompt and repeat, its median and quartiles
  (`speedup_per_run`).
- speedup_ci_low / _high, tokens_per_s_ci_low / _high: 95% bootstrap intervals of speedup and of
  tokens/s, over prompts and, within each, its timed repeats (`speedup_interval`,
  `tokens_per_s_interval`);
  a table does not order entries whose intervals overlap (`overlapping`), and an interval holding
  1.0 is no evidence of a speedup or a slowdown.
- decode_overhead_frac: the share of decoding-step time (the prefill step left out) spent
  outside the target and draft forwards: sampling, verification, bookkeeping, the loop itself
  (`decode_overhead_frac`; summaries' overhead_frac keeps the prefill in).
- where the time of a decoding step goes (prefill step left out; `decode_step_ms`): step_ms, and
  its parts target_ms (the target's forward), draft_ms (drafting) and other_ms (the rest); the
  leaderboard also gives each in autoregressive decoding steps on the same prompts
  (`in_reference_steps`: step_in_ar_steps, target_in_ar_steps, ...), so mean_accepted_tokens /
  step_in_ar_steps is about the speedup, and the parts say what holds it back.
- batched runs (gen.batch_size > 1; decoders/core/batch.py): a record's latency_s and ttft_s are
  its row's, from the batch's start (so tokens/s is per row); throughput_tokens_per_s is new tokens
  / the summed wall time of the batches (unbatched: of the prompts), padding_waste the share of
  the token slots batched forwards computed that were padding (`batch_totals`).
- lossless (check_lossless=true): a record is lossless when its tokens equal autoregressive
  greedy's; first_divergence is where they first differ. In half precision a k-token forward
  and the reference's 1-token step round differently, so near-ties can go either way;
  `judge_output` tells such ties from errors. At the first divergence, with the reference's own
  logits: divergence_logit_gap (top-1 minus top-2 logit) and divergence_ulps (top-1 minus the
  chosen token's logit, in ulps of the run's dtype at the top-1 logit). After it the outputs
  follow different paths and the reference's tokens say nothing, so each later token is judged
  against the target's one-token step on the output's own path: first_real_divergence is the
  first token more than TIE_ULPS below that step's top-1 that the same weights in a wider dtype
  (float32 for half precision, float64 for float32) do not put within TIE_ULPS of their own top-1
  either (ties_in_wider_dtype: the departures only that referee explains), and divergence_tie says
  every departure was a tie. A summary's
  lossless is the share of identical outputs, lossless_up_to_ties the share identical or departing
  at ties only, real_divergences the number of outputs with a first_real_divergence
  (`lossless_columns`). `lossless` means only this check.
- same_as_autoregressive (the leaderboard's): the share of prompts whose output equals the
  leaderboard's autoregressive entry's, token for token (`same_output_share`). Under greedy
  decoding a departure may be a tie, which the lossless columns tell apart; under sampling equal
  outputs need equal random streams, so it is no test of losslessness at all.
- quality: the mean of the records' quality scores (HumanEval pass@1, GSM8K accuracy) and its
  metric's name (`quality`).
- category: where prompts carry one (MT-Bench's eight, a jsonl's `category` field), every
  record keeps it and tables can be broken down by it (`summarize(by_category=True)`).
"""
from __future__ import annotations

import math
from typing import Callable, Iterable

import numpy as np
import pandas as pd
import torch

from decoders.core.lm import forward_flops
from decoders.core.trace import Generation



def timed_runs(record: dict) -> list[float]:
    """Every timed run's latency of a record's prompt (leaderboard.repeats; one without repeats)."""
    return record.get("repeat_latency_s") or [record["latency_s"]]


def generation_metrics(gen: Generation, flops_spec: dict, latency: float) -> dict:
    """Per-record totals from a decoder's trace."""
    steps = gen.steps
    n = len(gen.tokens)
    flops = [forward_flops(flops_spec, s.forward_tokens, s.context_tokens) for s in steps]
    return {
        "new_tokens": n,
        "steps": len(steps),
        "tokens_per_step": n / len(steps) if steps else math.nan,
        "latency_s": latency,
        "ttft_s": gen.ttft,
        "tokens_per_s": n / latency if latency > 0 else math.nan,
        "target_time_s": sum(s.target_time for s in steps),
        "draft_time_s": sum(s.draft_time for s in steps),
        "overhead_time_s": sum(s.overhead_time for s in steps),
        "forward_tokens": sum(s.forward_tokens for s in steps),
        "draft_tokens": sum(s.draft_tokens for s in steps),
        "accepted_draft_tokens": sum(s.accepted_draft_tokens for s in steps),
        "draft_forward_tokens": sum(s.draft_forward_tokens for s in steps),
        "target_flops": sum(flops),
        "decode_steps": len(steps) - 1,  # after the prefill step
        "decode_tokens": n - steps[0].committed if steps else 0,
        "decode_flops": sum(flops[1:]),
        "draft_flops": sum(s.draft_flops for s in steps),
        # Decode FLOPs leave out both prefills: the target's (step 0) and the draft's pass over the prompt.
        "decode_draft_flops": sum(s.draft_flops - s.draft_prefill_flops for s in steps),
        "stop_reason": gen.stop_reason,  # "eos" or "length"; the runner says "context" for a length the context cut
        # Only decoders verifying pool candidates record "hit"; None keeps the rate undefined for the rest.
        "hit_steps": sum(bool(s.info["hit"]) for s in steps) if steps and "hit" in steps[0].info else None,
        **_depth_counts(steps),
        **_info_sums(steps, ("paths", "head_flops", "rescore_flops")),
        **step_acceptance([s.draft_tokens for s in steps], [s.accepted_draft_tokens for s in steps]),
    }


def step_acceptance(draft_tokens: list[int], accepted: list[int]) -> dict:
    """What the engines' acceptance figures count, from each step's drafts proposed and accepted (the
    first step is the prefill): draft_steps, the steps that verified drafts; accepted_at_least[k - 1],
    those of them that accepted at least k; verified_tokens, the decoding steps' accepted drafts + 1 each."""
    verified = [a for d, a in zip(draft_tokens, accepted) if d > 0]
    return {"draft_steps": len(verified),
            "accepted_at_least": [sum(a >= k for a in verified) for k in range(1, max(verified, default=0) + 1)],
            "verified_tokens": sum(a + 1 for a in accepted[1:])}


def acceptance_counts(record: dict) -> dict:
    """step_acceptance's counts of a record: as it keeps them, else from its trace (records made before
    they were kept); {} without either."""
    if _known(record.get("draft_steps")):
        return {k: record[k] for k in ("draft_steps", "accepted_at_least", "verified_tokens")}
    trace = record.get("trace")
    if isinstance(trace, dict) and "draft_tokens" in trace and "accepted_draft_tokens" in trace:
        return step_acceptance(trace["draft_tokens"], trace["accepted_draft_tokens"])
    return {}


def vllm_mean_acceptance_length(records) -> float:
    """vLLM's mean acceptance length: 1 + accepted draft tokens / the steps that verified drafts."""
    counted = [(r["accepted_draft_tokens"], c["draft_steps"]) for r in records if (c := acceptance_counts(r))]
    return 1 + _ratio(sum(a for a, _ in counted), sum(n for _, n in counted)) if counted else math.nan


def vllm_acceptance_by_position(records) -> list[float]:
    """vLLM's per-position acceptance rate: for k = 1, 2, ..., the steps that verified drafts and accepted
    at least k / the steps that verified drafts ([] without such steps)."""
    counts = [c for r in records if (c := acceptance_counts(r))]
    steps = sum(c["draft_steps"] for c in counts)
    deepest = max((len(c["accepted_at_least"]) for c in counts), default=0)
    return [sum(c["accepted_at_least"][k] for c in counts if k < len(c["accepted_at_least"])) / steps
            for k in range(deepest)] if steps else []


def sglang_accept_length(records) -> float:
    """SGLang's accept length: over the decoding steps (prefill left out), accepted draft tokens + 1 per step."""
    counted = [(c["verified_tokens"], r["decode_steps"]) for r in records
               if (c := acceptance_counts(r)) and _known(r.get("decode_steps"))]
    return _ratio(sum(v for v, _ in counted), sum(n for _, n in counted)) if counted else math.nan


def eagle_tau(records) -> float:
    """EAGLE's tau: per output, accepted drafts + 1 summed over its decoding steps, over the index of its
    last decoding step (decoding steps - 1; the authors' loop index); the mean over a question's turns
    (outputs of one prompt_id), then over questions. Outputs of fewer than 2 decoding steps are left out."""
    by_question: dict = {}
    for r in records:
        c = acceptance_counts(r)
        if c and _known(r.get("decode_steps")) and r["decode_steps"] >= 2:
            by_question.setdefault(r.get("prompt_id", r.get("key")), []).append(
                c["verified_tokens"] / (r["decode_steps"] - 1))
    return float(np.mean([np.mean(turns) for turns in by_question.values()])) if by_question else math.nan


def positions_text(rates: list[float]) -> str | None:
    """Per-position rates as a table cell ("0.62 0.41 ..."); None without any."""
    return " ".join(f"{r:.2f}" for r in rates) if rates else None


def _info_sums(steps, keys) -> dict:
    """Totals of per-step info numbers some decoders record (Medusa/BPD: candidate paths per
    step, FLOPs of the heads and of lattice rescoring); None where a decoder records none."""
    return {key: (sum(s.info[key] for s in steps if key in s.info) if any(key in s.info for s in steps) else None)
            for key in keys}


def _depth_counts(steps) -> dict:
    """Draft decoders record per step how deep their draft went (draft_depth) and how many draft
    tokens the accepted path holds (accepted_depth). depth_proposed[d-1] counts the steps whose
    draft reached depth d, depth_accepted[d-1] those that accepted at least d draft tokens."""
    pairs = [(s.info["draft_depth"], s.info["accepted_depth"]) for s in steps if "draft_depth" in s.info]
    if not pairs:
        return {"depth_proposed": None, "depth_accepted": None}
    deepest = max(d for d, _ in pairs)
    return {"depth_proposed": [sum(d >= k for d, _ in pairs) for k in range(1, deepest + 1)],
            "depth_accepted": [sum(a >= k for _, a in pairs) for k in range(1, deepest + 1)]}


def depth_totals(records) -> tuple[np.ndarray, np.ndarray]:
    """Per draft depth d (index d-1), summed over records: the steps whose draft reached d, and
    those of them that accepted >= d draft tokens (acceptance by depth is their ratio)."""
    proposed, accepted = np.zeros(0), np.zeros(0)
    for r in records:
        p, a = r.get("depth_proposed"), r.get("depth_accepted")
        if isinstance(p, list) and p:
            n = max(len(proposed), len(p))
            proposed = np.pad(proposed, (0, n - len(proposed))) + np.pad(np.array(p, float), (0, n - len(p)))
            accepted = np.pad(accepted, (0, n - len(accepted))) + np.pad(np.array(a, float), (0, n - len(a)))
    return proposed, accepted


def _acceptance_by_depth(ok: pd.DataFrame) -> str | None:
    """Per depth d: of the steps whose draft reached d, the share that accepted >= d draft tokens."""
    if "depth_proposed" not in ok:
        return None
    proposed, accepted = depth_totals(ok[["depth_proposed", "depth_accepted"]].to_dict("records"))
    if not len(proposed):
        return None
    return " ".join(f"{a / p:.2f}" for p, a in zip(proposed, accepted))


def first_divergence(tokens: list[int], reference: list[int]) -> int | None:
    """First position where the two outputs differ (a length difference counts), else None."""
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


# A k-token forward and the reference's 1-token step sum in different orders (other GEMM shapes,
# other kernels), so the same logit can come out a few roundings apart, and a near-tie can go
# either way. Across the bfloat16 leaderboard's 136 departures the top-1/top-2 gap was 0, 1 or 2
# ulps (results/reference/leaderboard/README.md); 4 leaves room for longer contexts without
# reaching the gaps of a wrong token, which are a sizeable part of the logits' spread.
TIE_ULPS = 4


def ulp(x: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype` numbers at |x| (its resolution there)."""
    info = torch.finfo(dtype)
    return info.eps * 2.0 ** math.floor(math.log2(abs(x))) if abs(x) >= info.tiny else info.tiny


def departure_ulps(logits: torch.Tensor, chosen: int, dtype: torch.dtype | None = None) -> float:
    """How far below the top-1 logit the chosen token's logit is, in ulps of `dtype` (default the
    logits' own) at the top-1 logit: 0 for the argmax (or an exact tie), a few for a near-tie."""
    top = float(logits.max())
    return (top - float(logits[chosen].float())) / ulp(top, dtype or logits.dtype)


def rounding_tie(step: torch.Tensor, second: torch.Tensor, chosen: int) -> bool:
    """Whether the chosen token's deficit in the one-token step (its top-1 logit minus the chosen's) is within the
    distance between the step and a second computation of the same logits at the same precision (the largest
    difference over the vocabulary; `second` (V,), or (m, V) for several computations: the largest over all):
    an engine whose computations differ by more than the margin does not decide between the two tokens.
    llama.cpp's quantized kernels quantize activations, so no wider computation of the same function exists;
    its forwards over the prefix, batched two ways, are the second ones (docs/llamacpp.md)."""
    step, second = step.float(), second.float()
    margin = float(step.max() - step[chosen])
    distance = float((step - second).abs().max())
    return margin <= distance  # NaN anywhere: False, no tie


def judge_output(tokens: list[int], reference: list[int], rows: Iterable[torch.Tensor],
                 referee: Callable[[int], torch.Tensor | None] | None = None) -> dict:
    """The lossless check's fields for one output. rows: the target's next-token logits before
    each of `tokens`, from one-token steps along `tokens` itself, in the run's dtype
    (decoders.methods.autoregressive.step_logits); up to the first divergence they are the
    reference's own. There the departure is measured (divergence_logit_gap: the reference's top-1
    minus top-2 logit; divergence_ulps: top-1 minus the chosen token's logit, in ulps). Past it the
    reference's tokens are no yardstick (after a tie the outputs follow different, equally valid
    greedy paths), so every later token is judged against the target's step on the output's own
    path: first_real_divergence is the first position whose token is more than TIE_ULPS below
    that step's top-1 (None: none is), and divergence_tie says the output departs at ties only.
    referee(i): the logits before tokens[i] from the same weights in a wider dtype
    (decoders.methods.autoregressive.referee_logits; None: not available). A half-precision
    computation can be many ulps off the model's exact logits (tiny-random in bfloat16 on an H200:
    15 ulps; batched and one-token computations then rank a near-tie differently), so a token more
    than TIE_ULPS below the step's top-1 is still a tie where the referee puts it within TIE_ULPS
    (in ulps of the run's dtype) of its own top-1: the model, computed almost exactly, ranks the two
    within the run's rounding. ties_in_wider_dtype counts those. A referee at the run's own precision (llama.cpp's,
    whose quantized kernels have no wider twin) proves a tie where the step and it differ by at least the chosen
    token's margin (rounding_tie); ties_by_second_computation counts those. A difference in length at the
    first divergence is never a tie. rows is read lazily, and not at all for an identical output;
    the referee only where the step alone is no tie."""
    at = first_divergence(tokens, reference)
    out = {"lossless": at is None, "first_divergence": at, "divergence_logit_gap": None, "divergence_ulps": None,
           "first_real_divergence": None, "divergence_tie": None}
    if at is None:
        return out
    if at >= len(tokens) or at >= len(reference):
        out.update(first_real_divergence=at, divergence_tie=False)
        return out
    out["ties_in_wider_dtype"] = out["ties_by_second_computation"] = 0
    for i, row in enumerate(rows):
        if i < at:
            continue
        ulps = departure_ulps(row, tokens[i])
        if i == at:
            top2 = row.float().topk(2).values
            out.update(divergence_logit_gap=float(top2[0] - top2[1]), divergence_ulps=ulps)
        if ulps <= TIE_ULPS:
            continue
        wide = referee(i) if referee is not None else None
        if wide is not None and wide.dtype == row.dtype:  # a second computation at the run's precision
            if rounding_tie(row, wide, tokens[i]):
                out["ties_by_second_computation"] += 1
                continue
        elif wide is not None and departure_ulps(wide, tokens[i], row.dtype) <= TIE_ULPS:
            out["ties_in_wider_dtype"] += 1
            continue
        out["first_real_divergence"] = i  # NaN logits are no tie either
        break
    out["divergence_tie"] = out["first_real_divergence"] is None
    return out


def lossless_columns(records) -> dict:
    """lossless, lossless_up_to_ties (shares of checked records) and real_divergences (a count);
    NaN / None without checked records. A record without a verdict (an older run) counts as real."""
    def known(value) -> bool:  # None, or NaN where a table held records without the field
        return value is not None and value == value

    checked = [r for r in records if known(r.get("lossless"))]
    if not checked:
        return {"lossless": math.nan, "lossless_up_to_ties": math.nan, "real_divergences": None}
    identical = [bool(r["lossless"]) for r in checked]
    tie = [not same and known(r.get("divergence_tie")) and bool(r["divergence_tie"])
           for r, same in zip(checked, identical)]
    return {"lossless": float(np.mean(identical)),
            "lossless_up_to_ties": float(np.mean([a or b for a, b in zip(identical, tie)])),
            "real_divergences": int(sum(not a and not b for a, b in zip(identical, tie)))}


def _known(value) -> bool:
    """Neither None nor NaN (where a table holds records without the field)."""
    return value is not None and value == value


def _ratio(num: float, den: float) -> float:
    return num / den if den else math.nan


def tokens_per_step(records) -> float:
    """New tokens / target forward passes (prefill included), summed over records first."""
    return _ratio(sum(r["new_tokens"] for r in records), sum(r["steps"] for r in records))


def pooled_tokens_per_s(runs) -> float:
    """runs: {new_tokens, latency_s} per timed run (a record, or one repeat of it). Summed tokens
    over summed seconds."""
    runs = list(runs)
    return _ratio(sum(r["new_tokens"] for r in runs), sum(r["latency_s"] for r in runs))


def acceptance_rate(records) -> float:
    """Accepted draft tokens / draft tokens proposed (NaN for methods that propose none)."""
    return _ratio(sum(r["accepted_draft_tokens"] for r in records), sum(r["draft_tokens"] for r in records))


def total_flops_per_token(records) -> float:
    """Target + draft FLOPs per new token (summaries split it into flops_per_token, the target's,
    and draft_flops_per_token; the leaderboard's flops_per_token_vs_ar divides it by autoregressive's)."""
    return _ratio(sum(r["target_flops"] + r["draft_flops"] for r in records), sum(r["new_tokens"] for r in records))


def quality(records) -> dict:
    """quality_metric (the first record's that names one) and quality: the mean score of the
    records that have one (NaN without)."""
    scores = [r["quality_score"] for r in records
              if r.get("quality_score") is not None and r["quality_score"] == r["quality_score"]]
    metric = next((r["quality_metric"] for r in records if isinstance(r.get("quality_metric"), str)), None)
    return {"quality_metric": metric, "quality": float(np.mean(scores)) if scores else math.nan}


def decoder_lossless(records) -> bool:
    """False when a record's decoder is an explicitly lossy variant (e.g. typical acceptance);
    records without the field (older runs) do not count."""
    return all(bool(r["decoder_lossless"]) for r in records
               if r.get("decoder_lossless") is not None and r["decoder_lossless"] == r["decoder_lossless"])


def same_output_share(pairs: list[tuple[dict, dict]]) -> float:
    """pairs: (decoder's, reference's) records of the same prompt. The share whose tokens are
    equal (the leaderboard's same_as_autoregressive: no tie is excused, and under sampling no
    test of losslessness); NaN without pairs."""
    return float(np.mean([a["tokens"] == b["tokens"] for a, b in pairs])) if pairs else math.nan


def mean_tokens_per_s(runs) -> float:
    """The mean over runs ({new_tokens, latency_s}) of each run's tokens/s: `speedup` is the
    decoder's over the reference's. NaN without runs."""
    rates = [r["new_tokens"] / r["latency_s"] for r in runs]
    return float(np.mean(rates)) if rates else math.nan


def speedups(pairs: list[tuple[dict, dict]]) -> dict:
    """pairs: (decoder's, reference's) per-prompt {new_tokens, latency_s} on the same prompt.
    The three speedup figures (module docstring); NaN without pairs."""
    pairs = [(a, b) for a, b in pairs if a["latency_s"] > 0 and b["latency_s"] > 0]
    if not pairs:
        return {"speedup": math.nan, "speedup_geomean": math.nan, "speedup_pooled": math.nan}
    mine = np.array([[a["new_tokens"], a["latency_s"]] for a, _ in pairs], float)
    ref = np.array([[b["new_tokens"], b["latency_s"]] for _, b in pairs], float)
    return {"speedup": _ratio(mean_tokens_per_s(a for a, _ in pairs), mean_tokens_per_s(b for _, b in pairs)),
            "speedup_geomean": float(np.exp(np.mean(np.log(ref[:, 1] / mine[:, 1])))),
            "speedup_pooled": _ratio(mine[:, 0].sum() / mine[:, 1].sum(), ref[:, 0].sum() / ref[:, 1].sum())}


def speedup_per_run(pairs: list[tuple[dict, dict]]) -> dict:
    """pairs as for `speedups`, one per timed run (prompt, repeat). Median and quartiles of the
    per-run ratio: tokens/s / the reference's tokens/s on the same prompt and repeat."""
    ratios = [(a["new_tokens"] / a["latency_s"]) / (b["new_tokens"] / b["latency_s"]) for a, b in pairs
              if a["latency_s"] > 0 and b["latency_s"] > 0 and b["new_tokens"] > 0]
    if not ratios:
        return {"speedup_per_run_median": math.nan, "speedup_per_run_p25": math.nan, "speedup_per_run_p75": math.nan}
    p25, median, p75 = np.percentile(ratios, [25, 50, 75])
    return {"speedup_per_run_median": float(median), "speedup_per_run_p25": float(p25),
            "speedup_per_run_p75": float(p75)}


CI_LEVEL = 0.95  # of every interval the harness reports
CI_DRAWS = 2000  # bootstrap resamples: the interval's ends move by about 0.01x between seeds at this count


def _resample(prompts: list, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """CI_DRAWS bootstrap resamples of runs whose prompt is prompts[i]: prompts drawn with replacement
    and, within each drawn prompt, its runs (repeats) with replacement. Returns (rows, used), each
    (D, P, R): the runs drawn, and which of those slots count (a prompt has its own number of runs)."""
    groups: dict = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(prompt, []).append(i)
    runs = list(groups.values())
    counts = np.array([len(r) for r in runs])  # (P,)
    table = np.zeros((len(runs), counts.max()), dtype=int)  # (P, R): prompt p's runs, padded
    for p, rows in enumerate(runs):
        table[p, :len(rows)] = rows
    rng = np.random.default_rng(seed)
    drawn = rng.integers(len(runs), size=(CI_DRAWS, len(runs)))  # (D, P)
    n = counts[drawn][..., None]  # (D, P, 1)
    repeat = (rng.random((*drawn.shape, table.shape[1])) * n).astype(int)  # (D, P, R)
    return table[drawn[..., None], repeat], np.arange(table.shape[1]) < n


def _ends(draws: np.ndarray) -> tuple[float, float]:
    tail = 100 * (1 - CI_LEVEL) / 2
    low, high = np.percentile(draws, [tail, 100 - tail])
    return float(low), float(high)


def tokens_per_s_interval(runs: list[dict], prompts: list | None = None, seed: int = 0) -> dict:
    """Bootstrap interval (CI_LEVEL) of pooled tokens/s (summed tokens / summed seconds) over runs
    ({new_tokens, latency_s}); prompts[i]: run i's prompt (None: each run its own), as `_resample`
    draws them. NaN without runs."""
    runs = list(runs)
    if not runs:
        return {"tokens_per_s_ci_low": math.nan, "tokens_per_s_ci_high": math.nan}
    tokens = np.array([r["new_tokens"] for r in runs], float)
    seconds = np.array([r["latency_s"] for r in runs], float)
    rows, used = _resample(prompts if prompts is not None else list(range(len(runs))), seed)
    low, high = _ends((tokens[rows] * used).sum((1, 2)) / (seconds[rows] * used).sum((1, 2)))
    return {"tokens_per_s_ci_low": low, "tokens_per_s_ci_high": high}


def speedup_interval(pairs: list[tuple[dict, dict]], prompts: list | None = None, seed: int = 0) -> dict:
    """Bootstrap interval (CI_LEVEL) of `speedup`: pairs as for `speedup_per_run`, one per timed run;
    prompts[i]: pair i's prompt (None: each pair its own). Prompts are drawn with replacement and,
    within each, its repeats, so the interval holds both the spread over prompts and the run-to-run
    noise; a run and its reference stay paired (the same prompt, the same repeat). NaN without pairs."""
    keep = [i for i, (a, b) in enumerate(pairs) if a["latency_s"] > 0 and b["latency_s"] > 0]
    if not keep:
        return {"speedup_ci_low": math.nan, "speedup_ci_high": math.nan}
    mine = np.array([pairs[i][0]["new_tokens"] / pairs[i][0]["latency_s"] for i in keep])
    ref = np.array([pairs[i][1]["new_tokens"] / pairs[i][1]["latency_s"] for i in keep])
    rows, used = _resample([prompts[i] if prompts is not None else i for i in keep], seed)
    low, high = _ends((mine[rows] * used).sum((1, 2)) / (ref[rows] * used).sum((1, 2)))  # means' ratio
    return {"speedup_ci_low": low, "speedup_ci_high": high}


def overlapping(intervals: dict[str, tuple[float, float]]) -> dict[str, list[str]]:
    """For each label, the other labels whose interval overlaps its own: entries a table may not
    order (NaN intervals overlap nothing)."""
    known = {k: v for k, v in intervals.items() if not any(map(math.isnan, v))}
    return {a: [b for b, (lo, hi) in known.items() if b != a and lo <= known[a][1] and known[a][0] <= hi]
            if a in known else [] for a in intervals}


def decode_step_ms(records) -> dict:
    """Per decoding step (prefill step left out), pooled over the records' traces: the wall time in
    milliseconds of the whole step (`step_ms`) and of its parts, the target forward (`target_ms`),
    drafting (`draft_ms`) and the rest (`other_ms`: sampling, verification, bookkeeping)."""
    parts = {"target_ms": 0.0, "draft_ms": 0.0, "other_ms": 0.0}
    steps = 0
    for r in records:
        trace = r.get("trace") or {}
        if "overhead_time" not in trace:
            continue
        steps += len(trace["target_time"]) - 1
        for name, column in (("target_ms", "target_time"), ("draft_ms", "draft_time"), ("other_ms", "overhead_time")):
            parts[name] += 1e3 * sum(trace[column][1:])
    per_step = {name: _ratio(total, steps) for name, total in parts.items()}
    return {"step_ms": sum(per_step.values()), **per_step}


def in_reference_steps(split: dict, reference: dict) -> dict:
    """decode_step_ms's figures in units of the reference's (autoregressive) whole decoding step: how
    many one-token steps each part costs. speedup ~ mean_accepted_tokens / step_in_ar_steps."""
    return {name.replace("_ms", "_in_ar_steps"): _ratio(value, reference["step_ms"]) for name, value in split.items()}


def decode_overhead_frac(records) -> float:
    """Share of decoding-step time (prefill step excluded) outside the target and draft forwards,
    pooled over the records' traces (records without a trace are left out): decode_step_ms's
    other_ms over its step_ms."""
    split = decode_step_ms(records)
    return _ratio(split["other_ms"], split["step_ms"])


def decode_flops_per_step(records) -> float:
    """Target + draft FLOPs per decoding step, both prefills left out."""
    return _ratio(sum(r.get("decode_flops", math.nan) + r.get("decode_draft_flops", math.nan) for r in records),
                  sum(r.get("decode_steps", math.nan) for r in records))


def mean_accepted_tokens(records) -> float:
    """Spec-Bench's mean accepted tokens per decoding step (prefill excluded, bonus included)."""
    return _ratio(sum(r.get("decode_tokens", math.nan) for r in records),
                  sum(r.get("decode_steps", math.nan) for r in records))


def accepted_by_output_position(records, bin_tokens: int) -> pd.DataFrame:
    """Per bin of `bin_tokens` output positions [start, start + bin_tokens): the decoding steps
    (prefill left out, as in mean_accepted_tokens) that began there, the outputs they came from,
    and their mean accepted tokens. Records of status ok only."""
    if bin_tokens < 1:
        raise ValueError(f"bin_tokens must be >= 1, got {bin_tokens}")
    steps, tokens, outputs = {}, {}, {}
    for i, r in enumerate(records):
        if r.get("status", "ok") != "ok":
            continue
        trace = r["trace"]
        for position, committed in zip(trace["position"][1:], trace["committed"][1:]):
            start = position // bin_tokens * bin_tokens
            steps[start] = steps.get(start, 0) + 1
            tokens[start] = tokens.get(start, 0) + committed
            outputs.setdefault(start, set()).add(i)
    return pd.DataFrame([{"position": start, "steps": steps[start], "outputs": len(outputs[start]),
                          "mean_accepted_tokens": tokens[start] / steps[start]} for start in sorted(steps)],
                        columns=["position", "steps", "outputs", "mean_accepted_tokens"])


def engine_acceptance(records) -> dict:
    """The engines' acceptance figures of records (each defined above), as summaries and the leaderboard show them."""
    return {"vllm_mean_acceptance_length": vllm_mean_acceptance_length(records),
            "vllm_acceptance_by_position": positions_text(vllm_acceptance_by_position(records)),
            "sglang_accept_length": sglang_accept_length(records), "eagle_tau": eagle_tau(records)}


def _pool_hit_rate(ok: pd.DataFrame) -> float:
    if "hit_steps" not in ok:
        return math.nan
    hits = ok["hit_steps"].dropna()
    return _ratio(hits.sum(), ok.loc[hits.index, "steps"].sum()) if len(hits) else math.nan


def _info_ratio(ok: pd.DataFrame, key: str, per: str) -> float:
    if key not in ok:
        return math.nan
    known = ok[key].dropna()
    return _ratio(known.sum(), ok.loc[known.index, per].sum()) if len(known) else math.nan


def batch_totals(records) -> dict:
    """Throughput over the wall time the work took (each batch's once; an unbatched record's own
    latency) and the padding batched forwards computed (NaN without batches)."""
    batches = {r["batch"]["id"]: r["batch"] for r in records if isinstance(r.get("batch"), dict)}
    wall = sum(b["wall_s"] for b in batches.values()) + sum(r["latency_s"] for r in records
                                                           if not isinstance(r.get("batch"), dict))
    padded = sum(b["padded_tokens"] for b in batches.values())
    return {"throughput_tokens_per_s": _ratio(sum(r["new_tokens"] for r in records), wall),
            "padding_waste": 1 - sum(b["fed_tokens"] for b in batches.values()) / padded if padded else math.nan}


SUMMARY_KEYS = ["decoder", "model", "dataset"]


# The fields the per-record functions above read (tokens_per_step, pooled_tokens_per_s, acceptance_rate,
# mean_accepted_tokens, decode_flops_per_step, batch_totals, quality, decoder_lossless, lossless_columns).
_PER_RECORD = ["new_tokens", "steps", "latency_s", "batch", "draft_tokens", "accepted_draft_tokens", "decode_tokens",
               "decode_steps", "decode_flops", "decode_draft_flops", "quality_metric", "quality_score",
               "decoder_lossless", "lossless", "divergence_tie", "prompt_id", "draft_steps", "accepted_at_least",
               "verified_tokens", "trace"]


def summarize(records: list[dict] | pd.DataFrame, by_category: bool = False) -> pd.DataFrame:
    """One row per (decoder, model, dataset) from per-prompt records (or a DataFrame of them, one
    row a record: bench.report builds it column by column); by_category: one per (decoder, model,
    dataset, category) too, where records carry a category."""
    df = records if isinstance(records, pd.DataFrame) else pd.DataFrame([r for r in records if r is not None])
    if df.empty:
        return pd.DataFrame(columns=SUMMARY_KEYS)
    keys = (SUMMARY_KEYS + ["category"] if by_category and "category" in df and df["category"].notna().any()
            else SUMMARY_KEYS)
    rows = []
    for key, group in df.groupby(keys, sort=False, dropna=False):
        ok = group[group["status"] == "ok"]
        row = dict(zip(keys, key))
        row.update(records=len(ok), skipped=int((group["status"] != "ok").sum()))
        if len(ok):
            tokens, steps = ok["new_tokens"].sum(), ok["steps"].sum()
            busy = ok["target_time_s"].sum() + ok["draft_time_s"].sum() + ok["overhead_time_s"].sum()
            tps = ok["tokens_per_s"]
            ok_records = ok[[c for c in _PER_RECORD if c in ok]].to_dict("records")
            row.update(
                new_tokens=int(tokens), steps=int(steps),
                tokens_per_step=tokens_per_step(ok_records),
                tokens_per_s=pooled_tokens_per_s(ok_records),
                **tokens_per_s_interval(ok_records),
                tokens_per_s_median=float(tps.median()),
                tokens_per_s_p25=float(tps.quantile(0.25)), tokens_per_s_p75=float(tps.quantile(0.75)),
                latency_s_median=float(ok["latency_s"].median()), ttft_s_median=float(ok["ttft_s"].median()),
                forward_tokens_per_step=_ratio(ok["forward_tokens"].sum(), steps),
                flops_per_step=_ratio(ok["target_flops"].sum(), steps),
                # .get: records written before these fields existed (a resumed older run) give NaN.
                mean_accepted_tokens=mean_accepted_tokens(ok_records),
                decode_flops_per_step=decode_flops_per_step(ok_records),
                flops_per_token=_ratio(ok["target_flops"].sum(), tokens),
                draft_flops_per_token=_ratio(ok["draft_flops"].sum(), tokens),
                acceptance_rate=acceptance_rate(ok_records),
                acceptance_by_depth=_acceptance_by_depth(ok),
                **engine_acceptance(ok_records),
                target_time_frac=_ratio(ok["target_time_s"].sum(), busy),
                draft_time_frac=_ratio(ok["draft_time_s"].sum(), busy),
                pool_hit_rate=_pool_hit_rate(ok),
                paths_per_step=_info_ratio(ok, "paths", "decode_steps"),
                head_flops_per_token=_info_ratio(ok, "head_flops", "new_tokens"),
                rescore_flops_per_token=_info_ratio(ok, "rescore_flops", "new_tokens"),
                overhead_frac=_ratio(ok["overhead_time_s"].sum(), busy),
                batch_size=(int(ok["batch"].map(lambda b: b["size"] if isinstance(b, dict) else 1).max())
                            if "batch" in ok else 1),
                **batch_totals(ok_records),
            )
            row.update(quality(ok_records))
            if "decoder_lossless" in ok:  # False: an explicitly lossy variant (e.g. typical acceptance)
                row["decoder_lossless"] = decoder_lossless(ok_records)
            row.update(lossless_columns(ok_records))
            row.update(_against_reference(ok))
        rows.append(row)
    return pd.DataFrame(rows)


def _against_reference(ok: pd.DataFrame) -> dict:
    """A summary row's speedups (where the run made its autoregressive reference) and the decoder's
    own forecast (a hardware-aware decoder's), to set beside them."""
    row = {}
    ref = ok["reference"].dropna()
    if len(ref):
        row["ref_tokens_per_s"] = pooled_tokens_per_s(ref)
        pairs = [(ok.loc[i], r) for i, r in ref.items()]
        row.update(speedups(pairs), **speedup_interval(pairs))
    tuned = ok["tuned"].dropna() if "tuned" in ok else []
    if len(tuned):
        row["predicted_speedup"] = float(tuned.iloc[0].get("predicted_speedup", math.nan))
    return row


# Columns shown in the terminal / summary.md (summary.csv keeps them all).
DISPLAY = ["decoder", "model", "dataset", "category", "records", "skipped", "new_tokens", "tokens_per_step",
           "mean_accepted_tokens", "vllm_mean_acceptance_length", "vllm_acceptance_by_position",
           "sglang_accept_length", "eagle_tau", "tokens_per_s", "tokens_per_s_ci_low", "tokens_per_s_ci_high",
           "tokens_per_s_median", "batch_size", "throughput_tokens_per_s", "padding_waste", "latency_s_median",
           "ttft_s_median", "forward_tokens_per_step", "flops_per_step", "flops_per_token", "draft_flops_per_token",
           "acceptance_rate", "acceptance_by_depth", "pool_hit_rate", "paths_per_step", "head_flops_per_token",
           "rescore_flops_per_token", "target_time_frac", "draft_time_frac", "overhead_frac", "quality_metric",
           "quality", "decoder_lossless", "lossless", "lossless_up_to_ties", "real_divergences", "speedup",
           "speedup_ci_low", "speedup_ci_high", "speedup_geomean", "speedup_pooled", "predicted_speedup"]


def to_markdown(summary: pd.DataFrame) -> str:
    cols = [c for c in DISPLAY if c in summary.columns]
    return summary[cols].to_markdown(index=False, floatfmt=".4g")
