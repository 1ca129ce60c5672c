"""The text the trained add-ons (Medusa heads, the n-gram LM, the EAGLE draft, the exit adapter) learn
from: nothing from the benchmark test sets.

- Python standard-library source (this interpreter's own; train / held-out split by file name),
- GSM8K's train split (question + worked answer),
- self-distillation: the target's own greedy answers, rendered as a benchmark run renders prompts
  (its chat template, or the raw text for a tokenizer without one), to coding requests written here, to
  INSTRUCTIONS (general, code and arithmetic requests written here), and to GSM8K train questions; on
  request (the EAGLE draft's larger corpus) also to "complete this function" requests built from the
  standard library's own train-split functions and to general requests composed from templates and topics written here.
  The extra requests come after the others, so the first requests and their held-out answers stay
  the same whatever is added.

Generation is batched (left padding, similar lengths together) and cached one answer per line as each
batch finishes, so a killed run keeps what it generated and the heads, n-gram and EAGLE scripts share it.
Also what every script training on it starts with: the frozen target (`frozen_target`) and the
held-out split of the self-distilled answers (`split_answers`).
"""
from __future__ import annotations

import ast
import collections
import hashlib
import itertools
import json
import os
import random
import sysconfig
import textwrap
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..registry import CONF_DIR
from .target import load_target, request_ids

# Instructions for self-distillation: general chat, code and arithmetic requests written for
# this script (none is taken from MT-Bench, HumanEval or GSM8K).
INSTRUCTIONS = [
    "Explain how a hash table handles collisions.", "Write a Python function that reverses the words in a sentence.",
    "Describe the water cycle for a ten-year-old.", "What are three tips for writing clear emails?",
    "Write a Python class for a simple bank account with deposit and withdraw methods.",
    "A shop sells pencils at 3 for 50 cents. How much do 12 pencils cost? Explain step by step.",
    "Summarise the causes of the French Revolution in a short paragraph.",
    "Write a Python function that checks whether a string is a valid IPv4 address.",
    "Give a recipe for a simple tomato soup.", "Explain the difference between a list and a tuple in Python.",
    "A train travels 240 km in 3 hours. What is its average speed? Show your reasoning.",
    "Write a short poem about autumn leaves.", "How does binary search work? Give an example in Python.",
    "List the planets of the solar system with one fact about each.",
    "Write a Python generator that yields prime numbers.", "What is the difference between weather and climate?",
    "Tom has 5 apples and buys 3 bags of 4 apples each. How many apples does he have now?",
    "Write a Python function that merges two sorted lists.", "Explain what recursion is with a simple example.",
    "Give advice to someone starting to learn the guitar.", "Write a function that counts vowels in a string.",
    "Explain photosynthesis in two paragraphs.",
    "Write a Python script that reads a CSV file and prints the sum of a column.",
    "If a rectangle is 7 cm by 4 cm, what are its area and perimeter?",
]


def stdlib_files(split: str) -> list[Path]:
    """The interpreter's own standard-library modules (no tests), split by name hash into train / held-out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if not p.name.startswith("test"))
    return [p for p in files if (hash_name(p.name) % 10 == 0) == (split == "heldout")]


def hash_name(name: str) -> int:
    return sum(ord(c) * (i + 1) for i, c in enumerate(name))  # stable across runs, unlike hash()


def chunks(token_ids: list[int], seq_len: int) -> list[list[int]]:
    return [token_ids[i:i + seq_len] for i in range(0, len(token_ids) - seq_len + 1, seq_len)]


def text_chunks(tokenizer, files: list[Path], seq_len: int, limit: int) -> list[list[int]]:
    out: list[list[int]] = []
    for path in files:
        out += chunks(tokenizer(path.read_text(errors="ignore"))["input_ids"], seq_len)
        if len(out) >= limit:
            break
    return out[:limit]


def generated_chunks(lm, n: int, seq_len: int) -> list[list[int]]:
    """The target's own greedy answers, rendered as in a benchmark run (chat template, or raw text without one)."""
    from decoders.methods.autoregressive import autoregressive_decode
    from decoders.core.sampling import Sampling

    out = []
    for text in tqdm(INSTRUCTIONS[:n], desc="self-distillation answers", leave=False):
        ids = request_ids(lm.tokenizer, text)
        gen = autoregressive_decode(lm, ids, seq_len, Sampling(), lm.stop_ids)
        seq = (ids + gen.tokens)[-seq_len:]
        if len(seq) == seq_len:
            out.append(seq)
    return out



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


# General requests (MT-Bench's kinds of task, none of its text): every template meets every topic in turn.
GENERAL_TEMPLATES = [
    "Write a short blog post about {topic}.", "Explain {topic} to a curious teenager.",
    "Give five practical tips about {topic}.", "Write a persuasive paragraph arguing that {topic} matters.",
    "Pretend you are a museum guide and introduce an exhibition about {topic}.",
    "What are the main arguments for and against {topic}? Answer in a balanced way.",
    "Write a haiku and then a limerick about {topic}.", "Summarise the history of {topic} in three paragraphs.",
    "Draft a formal email inviting colleagues to a workshop on {topic}.",
    "List common misconceptions about {topic} and correct each one.",
    "Write a dialogue between a teacher and a student about {topic}.",
    "Describe how {topic} might change over the next twenty years.",
]
GENERAL_TOPICS = [
    "urban gardening", "renewable energy", "sleep", "volcanoes", "the printing press", "remote work",
    "honeybees", "public libraries", "electric cars", "the Roman aqueducts", "learning a second language",
    "plate tectonics", "jazz", "budgeting for students", "the immune system", "chess openings", "recycling plastic",
    "black holes", "ancient Egyptian writing", "team sports", "vaccines", "coral reefs", "the stock market",
    "baking bread", "the history of the bicycle", "social media and teenagers", "climate migration",
    "the Silk Road", "machine translation", "mountain hiking safety", "minimalism", "the water footprint of food",
    "classical music for beginners", "desert ecosystems", "board games", "the Moon landing", "public speaking",
    "open-source software", "the Renaissance", "time management",
]


def function_tasks(n: int) -> list[str]:
    """Up to `n` "complete this function" requests (HumanEval's form, none of its text): the standard
    library's train-split public top-level functions with a docstring, spread evenly over them."""
    found = []
    for path in stdlib_files("train"):
        try:
            tree = ast.parse(path.read_text(errors="ignore"))
        except (SyntaxError, ValueError):
            continue
        for node in tree.body:
            doc = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) else None
            if doc and not node.name.startswith("_"):
                doc = doc.split("\n\n")[0].strip()[:400]
                body = textwrap.indent(f'"""{doc}\n"""', "    ")
                found.append(f"def {node.name}({ast.unparse(node.args)}):\n{body}\n")
    picked = found[::max(1, len(found) // n)][:n] if n > 0 else []
    return [f"Complete the following Python function.\n\n```python\n{code}```" for code in picked]


def general_requests(n: int) -> list[str]:
    """Up to `n` general requests: template x topic pairs in a fixed shuffled order."""
    pairs = list(itertools.product(GENERAL_TEMPLATES, GENERAL_TOPICS))
    random.Random(0).shuffle(pairs)
    return [t.format(topic=topic) for t, topic in pairs[:n]]


def request_families(gsm8k_train: list[dict], n_gsm8k: int, n_functions: int = 0,
                     n_general: int = 0) -> dict[str, list[str]]:
    """The self-distillation requests by family, in order, the extras last (so the first ones, and
    their held-out every 10th, do not move when extras are added)."""
    return {"code": [f"Write a Python function that {task}." for task in CODE_TASKS],
            "instructions": list(INSTRUCTIONS),
            "gsm8k": [GSM8K_TEMPLATE.format(question=r["question"]) for r in gsm8k_train[:n_gsm8k]],
            "functions": function_tasks(n_functions), "general": general_requests(n_general)}



def gsm8k_train_rows(data_dir: str | None) -> list[dict]:
    if not data_dir:
        raise SystemExit("error: GSM8K's train split is needed: set BENCH_DATA_DIR=DIR holding gsm8k/train.jsonl")
    path = Path(data_dir).expanduser() / "gsm8k" / "train.jsonl"
    if not path.is_file():
        raise SystemExit(f"error: no GSM8K train split at {path}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def request_key(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def read_answers(path: Path) -> dict[str, list[int]]:
    """The cached answers by request key. A line a kill tore, or any line that is not an answer, is
    skipped: its request is generated again."""
    answers: dict[str, list[int]] = {}
    if path.is_file():
        for line in path.read_bytes().splitlines():
            try:
                row = json.loads(line)
                key, ids = row["request"], row["ids"]
            except (ValueError, TypeError, KeyError):
                continue
            if isinstance(key, str) and isinstance(ids, list) and all(isinstance(t, int) for t in ids):
                answers.setdefault(key, ids)
    return answers


def append_answers(path: Path, rows: list[tuple[str, list[int]]]) -> None:
    """Appends one line per answer and syncs, starting a new line if a killed writer left half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        torn = size > 0 and os.pread(fd, 1, size - 1) != b"\n"
        text = "".join(json.dumps({"request": k, "ids": ids}) + "\n" for k, ids in rows)
        os.write(fd, (("\n" if torn else "") + text).encode())
        os.fsync(fd)
    finally:
        os.close(fd)


@torch.inference_mode()
def self_distilled(lm, texts: list[str], max_new_tokens: int, batch: int, cache: Path) -> list[list[int]]:
    """The target's greedy answers (prompt + answer ids), generated in batches of similar lengths with
    left padding, each batch appended to `cache` as it finishes; answers already there are reused."""
    tok = lm.tokenizer
    known = read_answers(cache)
    keys = [request_key(t) for t in texts]
    todo = sorted(((k, request_ids(tok, t)) for k, t in dict(zip(keys, texts)).items() if k not in known),
                  key=lambda kx: len(kx[1]))
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(lm.stop_ids)
    for i in tqdm(range(0, len(todo), batch), desc="self-distillation answers", unit="batch"):
        part = todo[i:i + batch]
        ids = [x for _, x in part]
        width = max(map(len, ids))
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=lm.device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=lm.device)
        gen = lm.model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                do_sample=False, pad_token_id=pad, eos_token_id=sorted(lm.stop_ids))
        done = []
        for (key, _), x, row in zip(part, ids, gen[:, width:].tolist()):
            answer = []
            for t in row:
                answer.append(t)
                if t in lm.stop_ids:
                    break
            done.append((key, x + answer))
        append_answers(cache, done)
        known.update(done)
    return [known[k] for k in keys]


def corpus(lm, model_name: str, data_dir: str | None, cache_dir: str, *, n_gsm8k: int = 48, answer_tokens: int = 192,
           batch: int = 8, n_functions: int = 0, n_general: int = 0) -> dict[str, list[list[int]]]:
    """Token-id sequences: {"stdlib", "gsm8k", "generated", "heldout"} (heldout: other stdlib modules),
    and "family": each generated answer's request family."""
    rows = gsm8k_train_rows(data_dir)
    families = request_families(rows, n_gsm8k, n_functions, n_general)
    texts = [t for group in families.values() for t in group]
    cache = Path(cache_dir).expanduser() / f"answers-{model_name}-{answer_tokens}.jsonl"
    generated = self_distilled(lm, texts, answer_tokens, batch, cache)

    def ids(texts: list[str]) -> list[list[int]]:  # in one call: the ids text by text gives, in a third of its time
        return lm.tokenizer(texts)["input_ids"] if texts else []
    stdlib = ids([p.read_text(errors="ignore") for p in stdlib_files("train")])
    heldout = ids([p.read_text(errors="ignore") for p in stdlib_files("heldout")])
    gsm8k = ids([r["question"] + "\n" + r["answer"] for r in rows[n_gsm8k:]])
    return {"stdlib": stdlib, "gsm8k": gsm8k, "generated": generated, "heldout": heldout,
            "family": [name for name, group in families.items() for _ in group]}


def frozen_target(overrides: list[str], seed: int):
    """(config, LM): the run's config (Hydra overrides as `python -m bench` takes them), threads
    set, torch seeded, the target loaded with every parameter frozen."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
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
