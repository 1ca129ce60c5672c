"""The cost of one prompt-lookup search, per step, against the context's length: ours
(decoders/methods/prompt_lookup.py's proposer, as the decoding loop calls it: one token committed a
step) beside hf_pld's (transformers' PromptLookupCandidateGenerator.get_candidates, which hf_pld runs
every step), and a scan over every position in Python, the definition both implement. Two texts:
random token ids whose last token never occurred before (no match at any n-gram length: the whole text is
searched) and random tokens from 50 ids (a match near the start). Run from the repository root:

    python results/reference/prompt_lookup_search/bench.py [--threads 1] [--steps 200]

Writes results.csv (median and 90th percentile per step, in microseconds) and provenance.json beside
this file."""
import argparse
import csv
import importlib.metadata
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from decoders.methods.prompt_lookup import PromptLookup

HERE = Path(__file__).resolve().parent
NUM_TOKENS, MAX_NGRAM = 10, 2  # both decoders' defaults (prompt_lookup_num_tokens, max_matching_ngram_size)


def scan(sequence: list[int]) -> int | None:
    for n in range(min(MAX_NGRAM, len(sequence) - 1), 0, -1):
        suffix = sequence[-n:]
        for i in range(len(sequence) - n):
            if sequence[i:i + n] == suffix:
                return i + n
    return None


def text(length: int, case: str, rng: random.Random) -> list[int]:
    if case == "no match":  # ids above 1000 never repeat the step tokens appended below 1000
        return [rng.randrange(1000, 50_000) for _ in range(length)]
    return [rng.randrange(1000, 1050) for _ in range(length)]


def per_step(search, sequence: list[int], steps: int, rng: random.Random, case: str) -> list[float]:
    """Seconds of the search after each of `steps` tokens appended (a fresh one where no match): `search`
    is (keep, find): keep(sequence), untimed, is what the decoding loop does anyway; find(kept), timed."""
    keep, find = search
    times = []
    for step in range(steps):
        sequence.append(step if case == "no match" else rng.randrange(1000, 1050))
        kept = keep(sequence)
        start = time.perf_counter()
        find(kept)
        times.append(time.perf_counter() - start)
    return times


def searches():
    """name -> a function making a fresh search (a new prompt's state): (keep, find) as per_step takes."""
    def ours():  # our proposer converts the tokens committed since its last step itself: timed
        proposer = PromptLookup(NUM_TOKENS, MAX_NGRAM, set())
        return (lambda sequence: sequence), (lambda sequence: proposer.propose(sequence, NUM_TOKENS))

    def hf_pld():  # generate() holds the text as a tensor, grown by torch.cat each step: untimed
        generator = PromptLookupCandidateGenerator(num_output_tokens=NUM_TOKENS, max_matching_ngram_size=MAX_NGRAM,
                                                   max_length=1 << 20)
        held = []

        def keep(sequence):
            held[:] = [torch.tensor([sequence]) if not held else
                       torch.cat([held[0], torch.tensor([sequence[held[0].shape[1]:]])], 1)]
            return held[0]
        return keep, generator.get_candidates

    return {"ours": ours, "hf_pld": hf_pld, "python_scan": lambda: ((lambda sequence: sequence), scan)}


def lscpu() -> dict:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return {}
    keep = ("Model name", "CPU family", "Model", "CPU(s)", "Thread(s) per core", "L2 cache", "L3 cache")
    return {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in out.splitlines() if ":" in line)
            if k.strip() in keep}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--steps", type=int, default=200, help="steps timed per context length (default 200)")
    parser.add_argument("--lengths", default="500,1000,2000,3000,4000", help="context lengths, comma-separated")
    parser.add_argument("--out", type=Path, default=HERE, help="where results.csv and provenance.json go")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    rows = []
    for case in ("no match", "match"):
        for length in map(int, args.lengths.split(",")):
            row = {"case": case, "context_tokens": length}
            for name, make in searches().items():
                steps = args.steps if name != "python_scan" else max(5, args.steps // 20)
                (keep, find), rng = make(), random.Random(length)
                find(keep(text(length, case, rng)))  # the first search reads the prompt: not a step's cost
                times = per_step((keep, find), text(length, case, random.Random(length)), steps, rng, case)
                row[f"{name}_median_us"] = round(statistics.median(times) * 1e6, 1)
                row[f"{name}_p90_us"] = round(statistics.quantiles(times, n=10)[-1] * 1e6, 1)
            rows.append(row)
            print(row, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    versions = {p: importlib.metadata.version(p) for p in ("torch", "numpy", "transformers")}
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True).stdout.strip())
    (args.out / "provenance.json").write_text(json.dumps({
        "git_commit": commit, "git_dirty": dirty, "python": platform.python_version(), "packages": versions,
        "cpu": lscpu(), "torch_threads": args.threads, "token_dtype": "int64", "num_tokens": NUM_TOKENS,
        "max_ngram": MAX_NGRAM, "steps": args.steps, "load_average_1min": [load_before, os.getloadavg()[0]],
        "command": " ".join(["python", "results/reference/prompt_lookup_search/bench.py", *sys.argv[1:]])}, indent=1))


if __name__ == "__main__":
    main()
