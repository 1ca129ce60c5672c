"""The text Medusa heads and the n-gram LM are trained on: nothing from the benchmark test sets.

- Python standard-library source (this interpreter's own; train / held-out split by file name),
- GSM8K's train split (question + worked answer),
- self-distillation: the target's own greedy answers, rendered as a benchmark run renders prompts
  (its chat template, or the raw text for a tokenizer without one), to coding requests written for this script,
  to the exit adapter script's instructions, and to GSM8K train questions.

Generation is batched (left padding) and cached, so the heads and the n-gram LM scripts share it.
Also what every script training on it starts with: the frozen target (`frozen_target`) and the
held-out split of the self-distilled answers (`split_answers`).
"""
from __future__ import annotations

import collections
import hashlib
import json
from pathlib import Path

import torch
from tqdm.auto import tqdm

from train_exit_adapter import INSTRUCTIONS, chunks, stdlib_files
from training_target import load_target, request_ids

CODE_TASKS = [
    "returns the n-th Fibonacci number iteratively", "checks whether a word is a palindrome",
    "returns the second largest number in a list", "flattens a nested list", "counts word frequencies in a text",
    "removes duplicates from a list while keeping order", "converts a Roman numeral to an integer",
    "returns the greatest common divisor of two integers", "rotates a list by k positions",
    "transposes a matrix given as a list of lists", "checks whether two strings are anagrams",
    "returns all prime factors of a number", "computes the running sum of a list", "capitalises every word in a string",
    "finds the longest common prefix of a list of strings", "converts Celsius to Fahrenheit for a list of values",
    "returns the indices of two numbers that add up to a target", "splits a list into chunks of size n",
    "computes the median of a list", "counts the digits of an integer",
    "checks whether brackets in a string are balanced",
    "returns the factorial of n recursively", "finds the maximum depth of nested parentheses",
    "interleaves two lists", "returns the sum of the squares of odd numbers in a list",
    "converts a binary string to an integer", "groups words by their first letter", "returns the mode of a list",
    "checks whether a number is a perfect square", "reverses the order of words in each line of a file",
    "computes the dot product of two vectors", "returns the n smallest elements of a list",
    "encodes a string with run-length encoding", "decodes a run-length encoded string",
    "returns the number of vowels and consonants in a string", "merges two dictionaries summing shared keys",
    "finds the first non-repeating character of a string", "sorts a list of tuples by their second element",
    "returns True if a list is sorted", "computes the cumulative product of a list",
]

GSM8K_TEMPLATE = "{question}\nSolve it step by step, then give the final answer on its own line as '#### <number>'."


def requests(gsm8k_train: list[dict], n_gsm8k: int) -> list[str]:
    code = [f"Write a Python function that {task}." for task in CODE_TASKS]
    maths = [GSM8K_TEMPLATE.format(question=r["question"]) for r in gsm8k_train[:n_gsm8k]]
    return code + list(INSTRUCTIONS) + maths


def gsm8k_train_rows(data_dir: str | None) -> list[dict]:
    if not data_dir:
        raise SystemExit("error: GSM8K's train split is needed: set BENCH_DATA_DIR=DIR holding gsm8k/train.jsonl")
    path = Path(data_dir).expanduser() / "gsm8k" / "train.jsonl"
    if not path.is_file():
        raise SystemExit(f"error: no GSM8K train split at {path}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@torch.inference_mode()
def self_distilled(lm, texts: list[str], max_new_tokens: int, batch: int) -> list[list[int]]:
    """The target's greedy answers (prompt + answer ids), in batches with left padding."""
    tok = lm.tokenizer
    rendered = [request_ids(tok, t) for t in texts]
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(lm.stop_ids)
    out: list[list[int]] = []
    for i in tqdm(range(0, len(rendered), batch), desc="self-distillation answers", unit="batch"):
        ids = rendered[i:i + batch]
        width = max(map(len, ids))
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=lm.device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=lm.device)
        gen = lm.model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                do_sample=False, pad_token_id=pad, eos_token_id=sorted(lm.stop_ids))
        for x, row in zip(ids, gen[:, width:].tolist()):
            answer = []
            for t in row:
                answer.append(t)
                if t in lm.stop_ids:
                    break
            out.append(x + answer)
    return out


def corpus(lm, model_name: str, data_dir: str | None, cache_dir: str, n_gsm8k: int = 48, answer_tokens: int = 192,
           batch: int = 8) -> dict[str, list[list[int]]]:
    """Token-id sequences: {"stdlib", "gsm8k", "generated", "heldout"} (heldout: other stdlib modules)."""
    rows = gsm8k_train_rows(data_dir)
    texts = requests(rows, n_gsm8k)
    key = hashlib.sha1(json.dumps([model_name, texts, answer_tokens]).encode()).hexdigest()[:12]
    cache = Path(cache_dir).expanduser() / f"corpus-{model_name}-{key}.json"
    if cache.is_file():
        generated = json.loads(cache.read_text())
    else:
        generated = self_distilled(lm, texts, answer_tokens, batch)
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(generated))
    tok = lm.tokenizer
    stdlib = [tok(p.read_text(errors="ignore"))["input_ids"] for p in stdlib_files("train")]
    heldout = [tok(p.read_text(errors="ignore"))["input_ids"] for p in stdlib_files("heldout")]
    gsm8k = [tok(r["question"] + "\n" + r["answer"])["input_ids"] for r in rows[n_gsm8k:]]
    return {"stdlib": stdlib, "gsm8k": gsm8k, "generated": generated, "heldout": heldout}


def frozen_target(overrides: list[str], seed: int):
    """(config, LM): the run's config (Hydra overrides as `python -m bench` takes them), threads
    set, torch seeded, the target loaded with every parameter frozen."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parent.parent / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(seed)
    lm = load_target(cfg.model)
    for p in lm.model.parameters():
        p.requires_grad_(False)
    return cfg, lm


def split_answers(data: dict) -> tuple[list[list[int]], list[list[int]]]:
    """(train, held out): every 10th self-distilled answer is held out."""
    generated = data["generated"]
    return [s for j, s in enumerate(generated) if j % 10], generated[::10]


def fixed_chunks(sequences: list[list[int]], seq_len: int) -> list[list[int]]:
    out: list[list[int]] = []
    for seq in sequences:
        out += chunks(seq, seq_len)
    return out


OWN_WEIGHT = 10  # the target's own answers count this many times in a draft vocabulary's token counts


def draft_vocabulary(own: list[list[int]], other: list[list[int]], size: int) -> list[int]:
    """The `size` most frequent tokens of `own` (the target's answers, counted OWN_WEIGHT times) and
    `other` text, ascending: what a draft's reduced readout reads."""
    counts = collections.Counter(t for c in other for t in c)
    for c in own:
        for t in c:
            counts[t] += OWN_WEIGHT
    return sorted(t for t, _ in counts.most_common(size))
