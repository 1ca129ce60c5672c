"""Where a run's lossless check finds a departure, print the chosen token's deficit below the top-1
under the one-token steps (the check's rows), the check's referee (the same weights in a wider dtype)
and the same weights in float64, and how far those computations' logits lie apart, all in ulps of
the run's dtype. Runs `python -m bench` in-process with the arguments given, wrapping
bench.runner.judge_lossless (results/reference/gpu/2026-11-27-h200/ used its first form, whose
second computation was a prefix forward in the run's dtype).

    python scripts/gpu/tie_probe.py decoder=autoregressive dtype=bfloat16 gen.batch_size=4 check_lossless=true ..."""
import copy
import sys

import torch

from bench import runner
from bench.__main__ import main
from bench.metrics import departure_ulps, ulp
from bench.usage import asks_help
from decoders.methods.autoregressive import referee_logits, step_logits

judge = runner.judge_lossless
_f64 = {}


def exact(lm, ids):
    if "m" not in _f64:
        _f64["m"] = copy.deepcopy(lm.model).double()
    with torch.inference_mode():
        return _f64["m"](input_ids=torch.tensor([ids], device=lm.device)).logits[0, -1]


def probe(lm, ids, tokens, reference):
    verdict = judge(lm, ids, tokens, reference)
    at = verdict.get("first_divergence")
    if at is None or at >= min(len(tokens), len(reference)):
        return verdict
    real = verdict.get("first_real_divergence")
    for i in sorted({at, real} - {None}):
        with torch.inference_mode():
            a = list(step_logits(lm, ids, tokens[:i + 1]))[i]
            b = referee_logits(lm, ids, tokens)(i)
        f = exact(lm, [*ids, *tokens[:i]])
        unit = ulp(float(a.max()), a.dtype)
        c, t = tokens[i], int(a.argmax())
        fd = (float(f.max()) - float(f[c])) / unit
        print(f"TIEPROBE prompt {len(ids)} pos {i} (first {at}, real {real}) chosen {c} step-top {t} "
              f"ref {reference[i] if i < len(reference) else None} unit {unit:.4g} top {float(a.max()):.4g}: "
              f"deficit step {departure_ulps(a, c):.1f} referee {departure_ulps(b, c, a.dtype):.2f} "
              f"float64 {fd:.2f} ulps; "
              f"float64 gap top-vs-chosen {(float(f[t]) - float(f[c])) / unit:.2f}; "
              f"max|step-referee| {float((a.float() - b.float()).abs().max()) / unit:.1f} "
              f"max|step-f64| {float((a.double() - f).abs().max()) / unit:.1f} "
              f"max|referee-f64| {float((b.double() - f).abs().max()) / unit:.1f}; ties_in_wider_dtype "
              f"{verdict.get('ties_in_wider_dtype')}", flush=True)
    return verdict


if __name__ == "__main__":
    if asks_help(sys.argv[1:]):
        print(f"{__doc__.strip()}\n\nIts arguments are python -m bench's: python -m bench --help lists them.")
        sys.exit(0)
    runner.judge_lossless = probe
    sys.argv = ["bench", *sys.argv[1:]]
    main()
