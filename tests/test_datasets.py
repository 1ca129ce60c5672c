"""Datasets (bench/datasets.py), prompt rendering (bench/prompts.py) and quality scoring
(bench/quality.py). No test touches the network: the hub loader is monkeypatched."""
from __future__ import annotations

import copy
import gzip
import json
import time
import types
import uuid

import pytest

import bench.datasets as ds
from bench import quality
from bench.datasets import GSM8K, HumanEval, JsonlPrompts, MTBench, Prompt
from bench.errors import BenchError
from bench.prompts import render, rendering_for

HUMANEVAL_CHAT = ("Complete the following Python function. Reply with the whole function in one Python code block."
                  "\n\n```python\n{prompt}```")


# ---- helpers -----------------------------------------------------------------------------

def _hub_fails(*args, **kwargs):
    """A stand-in for _from_hub whose loader fails at once, as datasets does offline."""

    def load():
        raise ConnectionError("huggingface.co is unreachable")

    return load


def _hub_must_not_be_called(*args, **kwargs):
    def load():
        raise AssertionError(f"the hub was asked for {args}, although a local copy exists")

    return load


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def humaneval_prompts():
    return HumanEval().load()


@pytest.fixture(scope="module")
def problems(humaneval_prompts):
    return [p.meta["problem"] for p in humaneval_prompts]


@pytest.fixture(scope="module")
def tokenizer(smollm):
    return smollm.tokenizer


# ---- HumanEval ---------------------------------------------------------------------------

def test_humaneval_loads_all_164_with_ids(humaneval_prompts):
    assert len(humaneval_prompts) == 164
    assert [p.id for p in humaneval_prompts] == [f"HumanEval/{i}" for i in range(164)]
    for p in humaneval_prompts:
        problem = p.meta["problem"]
        assert {"prompt", "canonical_solution", "test", "entry_point"} <= set(problem)
        assert len(p.turns) == 1 and len(p.raw_turns) == 1
        # default templates are "{prompt}": the problem's prompt verbatim
        assert p.turns[0] == problem["prompt"] == p.raw_turns[0]
        assert p.shots == []


def test_humaneval_limit():
    prompts = HumanEval(limit=3).load()
    assert [p.id for p in prompts] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]


def test_humaneval_chat_and_raw_templates(problems):
    prompts = HumanEval(limit=2, chat_template=HUMANEVAL_CHAT, raw_template="# raw\n{prompt}").load()
    for p, problem in zip(prompts, problems):
        assert p.turns[0] == HUMANEVAL_CHAT.format(prompt=problem["prompt"])
        assert p.turns[0].startswith("Complete the following Python function.")
        assert problem["prompt"] in p.turns[0] and p.turns[0].endswith("```")
        assert p.raw_turns[0] == "# raw\n" + problem["prompt"]
        assert p.turns[0] != p.raw_turns[0]


@pytest.mark.parametrize("limit", [0, -1])
def test_humaneval_invalid_limit(limit):
    with pytest.raises(BenchError, match=r"dataset\.limit") as e:
        HumanEval(limit=limit).load()
    assert repr(limit) in str(e.value)


def test_humaneval_from_explicit_path(tmp_path, problems):
    path = tmp_path / "he.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for problem in problems[:2]:
            f.write(json.dumps(problem) + "\n")
    prompts = HumanEval(path=str(path)).load()
    assert [p.id for p in prompts] == ["HumanEval/0", "HumanEval/1"]
    assert prompts[1].meta["problem"] == problems[1]


def test_humaneval_missing_path():
    with pytest.raises(BenchError, match=r"dataset\.path=/nonexistent/he\.jsonl"):
        HumanEval(path="/nonexistent/he.jsonl").load()


# ---- MT-Bench ----------------------------------------------------------------------------

def test_mt_bench_from_data_dir(data_dir, monkeypatch):
    monkeypatch.setattr(ds, "_from_hub", _hub_must_not_be_called)
    prompts = MTBench(data_dir=str(data_dir)).load()
    assert len(prompts) == 80
    assert all(len(p.turns) == 2 and p.raw_turns == p.turns for p in prompts)
    assert all(isinstance(t, str) and t for p in prompts for t in p.turns)
    assert len({p.id for p in prompts}) == 80
    first = json.loads((data_dir / "mt_bench" / "question.jsonl").open(encoding="utf-8").readline())
    assert prompts[0].id == str(first["question_id"])
    assert prompts[0].turns == first["turns"]
    assert prompts[0].meta["category"] == first["category"]


def test_mt_bench_from_explicit_file(data_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(ds, "_from_hub", _hub_must_not_be_called)
    src = data_dir / "mt_bench" / "question.jsonl"
    # data_dir points elsewhere: the explicit path wins
    prompts = MTBench(path=str(src), data_dir=str(tmp_path), limit=5).load()
    assert len(prompts) == 5
    assert all(len(p.turns) == 2 for p in prompts)
    assert prompts == MTBench(data_dir=str(data_dir)).load()[:5]


def test_mt_bench_from_explicit_directory(data_dir, monkeypatch):
    monkeypatch.setattr(ds, "_from_hub", _hub_must_not_be_called)
    prompts = MTBench(path=str(data_dir / "mt_bench")).load()
    assert len(prompts) == 80


def test_mt_bench_missing_everywhere(tmp_path, monkeypatch):
    monkeypatch.setattr(ds, "_from_hub", _hub_fails)
    start = time.perf_counter()
    with pytest.raises(BenchError) as e:
        MTBench(path=None, data_dir=str(tmp_path)).load()
    assert time.perf_counter() - start < 5
    msg = str(e.value)
    assert "dataset.path" in msg
    assert str(tmp_path / "mt_bench" / "question.jsonl") in msg
    assert "lighteval/mt-bench" in msg and "ConnectionError" in msg
    assert "BENCH_DATA_DIR" in msg
    assert "\n" not in msg


def test_mt_bench_missing_without_data_dir(monkeypatch):
    monkeypatch.setattr(ds, "_from_hub", _hub_fails)
    with pytest.raises(BenchError, match="BENCH_DATA_DIR unset") as e:
        MTBench(path=None, data_dir=None).load()
    assert "lighteval/mt-bench" in str(e.value)


def test_mt_bench_nonexistent_path(monkeypatch):
    monkeypatch.setattr(ds, "_from_hub", _hub_must_not_be_called)
    with pytest.raises(BenchError, match=r"dataset\.path=/nonexistent/question\.jsonl does not exist"):
        MTBench(path="/nonexistent/question.jsonl").load()


@pytest.mark.parametrize("case", ["mt_bench_dir", "gsm8k_file_without_train"])
def test_path_without_expected_file(case, data_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(ds, "_from_hub", _hub_must_not_be_called)
    if case == "mt_bench_dir":  # an existing directory without question.jsonl
        with pytest.raises(BenchError, match="question.jsonl"):
            MTBench(path=str(tmp_path)).load()
    else:  # dataset.path=.../test.jsonl with num_shots, and no train.jsonl beside it
        test = tmp_path / "test.jsonl"
        test.write_text((data_dir / "gsm8k" / "test.jsonl").open(encoding="utf-8").readline(), encoding="utf-8")
        with pytest.raises(BenchError, match="train.jsonl"):
            GSM8K(path=str(test), num_shots=2).load()


@pytest.mark.parametrize("rows", [
    # lighteval/mt-bench (the default): FastChat's own fields and ids
    [{"turns": ["Write a poem.", "Now shorter."], "question_id": 81, "category": "writing", "reference": []},
     {"turns": ["Solve x.", "Explain."], "question_id": 82, "category": "math", "reference": []}],
    # HuggingFaceH4/mt_bench_prompts (dataset.hub_id=...): turns renamed to prompt
    [{"prompt": ["Write a poem.", "Now shorter."], "prompt_id": 81, "category": "writing"},
     {"prompt": ["Solve x.", "Explain."], "prompt_id": 82, "category": "math"}],
], ids=["lighteval", "h4"])
def test_mt_bench_hub_rows(monkeypatch, rows):
    calls = []

    def fake_hub(hub_id, config, split):
        calls.append((hub_id, config, split))
        return lambda: rows

    monkeypatch.setattr(ds, "_from_hub", fake_hub)
    prompts = MTBench(data_dir=None).load()
    assert calls == [("lighteval/mt-bench", None, "train")]
    assert [p.id for p in prompts] == ["81", "82"]
    assert prompts[0].turns == ["Write a poem.", "Now shorter."] == prompts[0].raw_turns
    assert prompts[0].meta == {"category": "writing"}
    assert prompts[1].meta["category"] == "math"


def test_mt_bench_row_without_turns(tmp_path):
    path = _write_jsonl(tmp_path / "q.jsonl", [{"question_id": 1, "category": "x"}])
    with pytest.raises(BenchError, match="q.jsonl:1: field 'turns' is missing"):
        MTBench(path=str(path)).load()


# ---- GSM8K -------------------------------------------------------------------------------

def test_gsm8k_from_data_dir(data_dir, monkeypatch):
    monkeypatch.setattr(ds, "_from_hub", _hub_must_not_be_called)
    prompts = GSM8K(data_dir=str(data_dir)).load()
    assert len(prompts) == 1319
    assert prompts[0].id == "gsm8k/0" and prompts[-1].id == "gsm8k/1318"
    assert prompts[0].meta["answer"] == "18"
    assert all(p.shots == [] and len(p.turns) == 1 for p in prompts)
    first = json.loads((data_dir / "gsm8k" / "test.jsonl").open(encoding="utf-8").readline())
    assert prompts[0].turns[0].startswith(first["question"]) and "####" in prompts[0].turns[0]
    assert prompts[0].raw_turns[0] == f"Question: {first['question']}\nAnswer:"
    # every gold answer is normalised: digits, no commas, no '$'
    for p in prompts:
        gold = p.meta["answer"]
        assert gold and "," not in gold and "$" not in gold and "#" not in gold
        float(gold)


def test_gsm8k_shots(data_dir, monkeypatch):
    monkeypatch.setattr(ds, "_from_hub", _hub_must_not_be_called)
    train = [json.loads(line) for line in (data_dir / "gsm8k" / "train.jsonl").open(encoding="utf-8")][:3]
    assert any("<<" in r["answer"] for r in train)  # the annotations exist, so stripping them is tested
    prompts = GSM8K(data_dir=str(data_dir), num_shots=3, limit=2).load()
    assert len(prompts) == 2
    p = prompts[0]
    assert len(p.shots) == 3
    for (user, assistant), row in zip(p.shots, train):
        assert user.startswith(row["question"])
        assert "<<" not in assistant and ">>" not in assistant
        assert assistant.endswith(row["answer"].split("####")[-1].strip())
        assert "####" in assistant
    raw = p.raw_turns[0]
    assert raw.count("Question:") == 4
    question = json.loads((data_dir / "gsm8k" / "test.jsonl").open(encoding="utf-8").readline())["question"]
    assert raw.endswith(f"Question: {question}\nAnswer:")
    assert raw.index(train[2]["question"]) < raw.index(question)
    assert "<<" not in raw and ">>" not in raw
    # the chat turn itself carries no shots
    assert p.turns[0].count("Question:") == 0 and p.turns[0].startswith(question)
    assert prompts[1].shots == p.shots


def test_gsm8k_explicit_test_file_with_shots(data_dir, monkeypatch):
    monkeypatch.setattr(ds, "_from_hub", _hub_must_not_be_called)
    prompts = GSM8K(path=str(data_dir / "gsm8k" / "test.jsonl"), data_dir=None, num_shots=1, limit=1).load()
    assert len(prompts) == 1 and len(prompts[0].shots) == 1
    assert prompts[0].meta["answer"] == "18"


@pytest.mark.parametrize("shots", [-1, 1.5])
def test_gsm8k_invalid_num_shots(shots):
    with pytest.raises(BenchError, match=r"dataset\.num_shots"):
        GSM8K(num_shots=shots).load()


def test_gsm8k_missing_everywhere(tmp_path, monkeypatch):
    monkeypatch.setattr(ds, "_from_hub", _hub_fails)
    with pytest.raises(BenchError) as e:
        GSM8K(path=None, data_dir=str(tmp_path)).load()
    msg = str(e.value)
    assert "dataset.path" in msg
    assert str(tmp_path / "gsm8k" / "test.jsonl") in msg
    assert "openai/gsm8k" in msg and "ConnectionError" in msg
    assert "BENCH_DATA_DIR" in msg


def test_gsm8k_nonexistent_path(monkeypatch):
    monkeypatch.setattr(ds, "_from_hub", _hub_must_not_be_called)
    with pytest.raises(BenchError, match=r"dataset\.path=/nonexistent/gsm8k"):
        GSM8K(path="/nonexistent/gsm8k").load()


def test_gsm8k_hub_rows(monkeypatch):
    calls = []
    rows = {"train": [{"question": "Shot q?", "answer": "Two <<1+1=2>>2 things.\n#### 2"}],
            "test": [{"question": "What is 40+2?", "answer": "40+2=<<40+2=42>>42\n#### 42"},
                     {"question": "Cost?", "answer": "It costs $1,000.\n#### 1,000"}]}

    def fake_hub(hub_id, config, split):
        calls.append((hub_id, config, split))
        return lambda: rows[split]

    monkeypatch.setattr(ds, "_from_hub", fake_hub)
    prompts = GSM8K(data_dir=None, num_shots=1).load()
    assert sorted(calls) == [("openai/gsm8k", "main", "test"), ("openai/gsm8k", "main", "train")]
    assert [p.id for p in prompts] == ["gsm8k/0", "gsm8k/1"]
    assert [p.meta["answer"] for p in prompts] == ["42", "1000"]
    assert prompts[0].turns[0].startswith("What is 40+2?")
    assert prompts[0].shots[0][1] == "Two 2 things.\n#### 2"
    assert prompts[0].raw_turns[0] == ("Question: Shot q?\nAnswer: Two 2 things.\n#### 2\n\n"
                                       "Question: What is 40+2?\nAnswer:")


# ---- JsonlPrompts ------------------------------------------------------------------------

def test_jsonl_string_and_list_prompts(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "prompt": "hello"},
                                               {"id": "b", "prompt": ["first", "second", "third"]}])
    prompts = JsonlPrompts(path=str(path)).load()
    assert [p.id for p in prompts] == ["a", "b"]
    assert prompts[0].turns == ["hello"] == prompts[0].raw_turns
    assert prompts[1].turns == ["first", "second", "third"] == prompts[1].raw_turns
    assert JsonlPrompts(path=str(path)).score(prompts[0], 0, "x", "chat") is None


def test_jsonl_custom_fields_and_limit(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"key": 7, "text": "one"}, {"key": 8, "text": ["two", "three"]},
                                               {"key": 9, "text": "four"}])
    prompts = JsonlPrompts(path=str(path), id_field="key", prompt_field="text", limit=2).load()
    assert [p.id for p in prompts] == ["7", "8"]
    assert prompts[1].turns == ["two", "three"]


def test_jsonl_missing_path(tmp_path):
    with pytest.raises(BenchError, match=r"dataset\.path"):
        JsonlPrompts(path=None).load()
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(BenchError, match=r"dataset\.path=.*nope\.jsonl does not exist"):
        JsonlPrompts(path=str(missing)).load()


@pytest.mark.parametrize("value", [3, [], ["ok", 5], None])
def test_jsonl_bad_prompt_field(tmp_path, value):
    row = {"id": "x", "question": value} if value is not None else {"id": "x", "other": "y"}
    path = _write_jsonl(tmp_path / "p.jsonl", [row])
    with pytest.raises(BenchError, match="'question'") as e:
        JsonlPrompts(path=str(path), prompt_field="question").load()
    assert "dataset.prompt_field" in str(e.value)


def test_jsonl_duplicate_ids(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"id": 1, "prompt": "a"}, {"id": 1, "prompt": "b"}])
    with pytest.raises(BenchError, match="p.jsonl:2: field 'id' repeats id '1' of .*p.jsonl:1"):
        JsonlPrompts(path=str(path)).load()


def test_jsonl_invalid_json_names_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": 1, "prompt": "a"}\n{not json\n', encoding="utf-8")
    with pytest.raises(BenchError, match=r"p\.jsonl:2 is not valid JSON"):
        JsonlPrompts(path=str(path)).load()


def test_jsonl_bad_field_reports_file_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": 1, "prompt": "a"}\n\n\n{"id": 2, "prompt": 3}\n', encoding="utf-8")
    with pytest.raises(BenchError, match=r"p\.jsonl:4: field 'prompt' must be a string or a non-empty list"):
        JsonlPrompts(path=str(path)).load()


# ---- every loader against hostile rows -----------------------------------------------------

# Per loader: a valid row; a value of a wrong type for each field (the first string becomes five
# one-letter turns where turns are read as a list, a list of numbers failed at rendering); the fields
# a row must have; the id field (None: ids are positions, unique by construction).
LOADERS = {
    "mt_bench": (MTBench, {"question_id": 81, "category": "writing", "turns": ["Write.", "Shorter."]},
                 {"turns": ["Hello", [1, 2], []], "question_id": [[81], True, ""], "category": [["x"]]},
                 ["turns", "question_id"], "question_id"),
    "humaneval": (HumanEval, {"task_id": "T/0", "prompt": "def f():\n", "entry_point": "f",
                              "test": "def check(c):\n    pass\n"},
                  {"task_id": [None, 7.5], "prompt": [["def f():"]], "entry_point": [5, "not a name"],
                   "test": [{"a": 1}]},
                  ["task_id", "prompt", "entry_point", "test"], "task_id"),
    "gsm8k": (GSM8K, {"question": "What is 2+3?", "answer": "2+3=5\n#### 5"},
              {"question": [5], "answer": [["#### 5"], "no final answer"]}, ["question", "answer"], None),
    "spec_bench": (ds.SpecBench, {"question_id": 1, "category": "qa", "turns": ["Who?"]},
                   {"turns": ["Who?", [1]], "question_id": [{"id": 1}], "category": [[1], False]},
                   ["turns", "question_id", "category"], "question_id"),
    "jsonl": (JsonlPrompts, {"id": "a", "prompt": "Hello", "category": "greeting"},
              {"prompt": [5, [1, 2], []], "id": [[1], 2.5], "category": [{"a": 1}]}, ["prompt"], "id"),
}


def _hostile_cases():
    for name, (_, row, wrong, required, ident) in LOADERS.items():
        for field, values in wrong.items():
            for value in values:
                yield name, f"{field} = {json.dumps(value)}", field, json.dumps({**row, field: value})
        for field in required:
            yield name, f"no {field}", field, json.dumps({k: v for k, v in row.items() if k != field})
        if ident:
            yield name, "a duplicate id", ident, json.dumps(row)
        field = ident or "answer"
        for number in ("1e400", "9" * 5000, "NaN", "-Infinity"):
            yield name, f"{field} = {number[:8]}", field, json.dumps(row).replace(
                json.dumps(row[field]), number, 1)


@pytest.mark.parametrize("loader, case, field, line", list(_hostile_cases()),
                         ids=[f"{n}: {c}" for n, c, _, _ in _hostile_cases()])
def test_every_loader_names_file_line_and_field_of_a_hostile_row(tmp_path, monkeypatch, loader, case, field, line):
    """A row with a wrong type in a field, a missing field, a repeated id or a number Python cannot
    hold (more digits than int() reads, beyond a double, NaN) is refused when the dataset loads:
    one line naming the file, the line and the field. Each had been a traceback, or a wrong prompt,
    after generation had begun."""
    cls, row, *_ = LOADERS[loader]
    monkeypatch.setattr(ds, "_from_hub", _hub_must_not_be_called)
    path = tmp_path / ("test.jsonl" if loader == "gsm8k" else "rows.jsonl")
    path.write_text(json.dumps(row) + "\n" + line + "\n", encoding="utf-8")
    (tmp_path / "ok").mkdir()
    assert len(cls(path=str(_write_jsonl(tmp_path / "ok" / path.name, [row]))).load()) == 1  # the valid row loads
    with pytest.raises(BenchError) as e:
        cls(path=str(path)).load()
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{path}:2: field {field!r}"), message


def test_gsm8k_scores_numbers_of_any_length(tmp_path, monkeypatch):
    """A gold answer or an output holding a number of 400 digits (or more than int() reads) scores
    exactly; it raised OverflowError at scoring, at every resume."""
    monkeypatch.setattr(ds, "_from_hub", _hub_must_not_be_called)
    big = "1" * 399 + "2"
    path = _write_jsonl(tmp_path / "test.jsonl", [{"question": "Big?", "answer": f"So\n#### {big}"}])
    dataset = GSM8K(path=str(path))
    prompt = dataset.load()[0]
    assert prompt.meta["answer"] == big
    assert dataset.score(prompt, 0, f"#### {big}", "chat")["correct"] is True
    assert dataset.score(prompt, 0, f"#### {big[:-1]}3", "chat")["correct"] is False  # a float made these equal
    assert dataset.score(prompt, 0, "#### " + "9" * 10_000, "chat")["correct"] is False


# ---- rendering ---------------------------------------------------------------------------

def test_render_chat_single_turn(tokenizer):
    prompt = Prompt(id="x", turns=["What is 2+2?"], raw_turns=["Q: 2+2\nA:"])
    text, ids = render(tokenizer, prompt, 0, [], "chat")
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_render_chat_second_turn(tokenizer, data_dir):
    prompt = MTBench(data_dir=str(data_dir), limit=1).load()[0]
    previous = "PREVIOUS ANSWER about Hawaii."
    text, ids = render(tokenizer, prompt, 1, [previous], "chat")
    first, second = prompt.turns
    i1, ip, i2 = text.index(first), text.index(previous), text.index(second)
    assert i1 < ip < i2
    assert f"<|im_start|>assistant\n{previous}<|im_end|>" in text
    assert text.endswith(f"{second}<|im_end|>\n<|im_start|>assistant\n")
    assert text.count("<|im_start|>user") == 2
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    # turn 0 of the same prompt is a prefix-free, shorter conversation
    text0, _ = render(tokenizer, prompt, 0, [], "chat")
    assert second not in text0 and first in text0


def test_render_chat_with_shots(tokenizer):
    prompt = Prompt(id="x", turns=["Q3"], raw_turns=["Q3"], shots=[("Q1", "A1"), ("Q2", "A2")])
    text, _ = render(tokenizer, prompt, 0, [], "chat")
    order = [text.index(s) for s in ("Q1", "A1", "Q2", "A2", "Q3")]
    assert order == sorted(order)
    assert "<|im_start|>assistant\nA1<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_render_raw_is_concatenation(tokenizer):
    prompt = Prompt(id="x", turns=["chat1", "chat2"], raw_turns=["Raw one:", "Raw two:"])
    text, ids = render(tokenizer, prompt, 1, [" out one"], "raw")
    assert text == "Raw one: out one\n\nRaw two:"
    assert ids == tokenizer(text)["input_ids"]
    assert "<|im_start|>" not in text
    text0, ids0 = render(tokenizer, prompt, 0, [], "raw")
    assert text0 == "Raw one:" and ids0 == tokenizer("Raw one:")["input_ids"]


def test_rendering_for(tokenizer):
    assert rendering_for(tokenizer, "auto") == "chat"
    assert rendering_for(tokenizer, "chat") == "chat"
    assert rendering_for(tokenizer, "raw") == "raw"
    with pytest.raises(BenchError, match="prompt_format='markdown'") as e:
        rendering_for(tokenizer, "markdown")
    assert "auto" in str(e.value) and "raw" in str(e.value)


def test_rendering_for_without_template(tokenizer):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    stub = types.SimpleNamespace(chat_template=None)
    for tok in (plain, stub):
        assert rendering_for(tok, "auto") == "raw"
        assert rendering_for(tok, "raw") == "raw"
        with pytest.raises(BenchError, match="no chat template") as e:
            rendering_for(tok, "chat")
        assert "prompt_format=raw" in str(e.value) and "model.chat_template" in str(e.value)
    assert tokenizer.chat_template  # the shared tokenizer was not touched


# ---- HumanEval quality -------------------------------------------------------------------

SAMPLE = [0, 2, 10, 38, 163]  # 10 and 38 have helper functions before the entry point


@pytest.mark.slow
@pytest.mark.parametrize("index", SAMPLE)
def test_run_humaneval_canonical_passes(problems, index):
    problem = problems[index]
    result = quality.run_humaneval(problem, problem["canonical_solution"])
    assert result["passed"] is True and result["score"] == 1.0, result


@pytest.mark.slow
def test_run_humaneval_wrong_body_fails(problems):
    result = quality.run_humaneval(problems[0], "    return None\n", timeout=1.0)
    assert result["passed"] is False and result["score"] == 0.0
    assert result["result"].startswith("failed")


@pytest.mark.slow
def test_run_humaneval_starts_one_sandbox_per_program(problems, monkeypatch):
    """Equal completions (a leaderboard's lossless entries write them) are judged once; another
    program gets a sandbox of its own."""
    real, programs = quality.sandbox.run, []
    monkeypatch.setattr(quality.sandbox, "run", lambda program, t: programs.append(program) or real(program, t))
    same, other = (problems[0]["canonical_solution"] + f"\n# {uuid.uuid4().hex}\n" for _ in range(2))
    first = quality.run_humaneval(problems[0], same)
    assert first["passed"] is True and quality.run_humaneval(problems[0], same) == first
    assert len(programs) == 1
    assert quality.run_humaneval(problems[0], other)["passed"] is True and len(programs) == 2


@pytest.mark.slow
def test_run_humaneval_syntax_error_fails(problems):
    result = quality.run_humaneval(problems[0], "    return (\n", timeout=1.0)
    assert result["passed"] is False and result["score"] == 0.0


@pytest.mark.slow
def test_run_humaneval_infinite_loop_times_out(problems):
    start = time.perf_counter()
    result = quality.run_humaneval(problems[0], "    while True:\n        pass\n", timeout=1.0)
    elapsed = time.perf_counter() - start
    assert result["passed"] is False and result["score"] == 0.0
    assert "timed out" in result["result"]
    assert elapsed < 1.0 + 5


def _chatty(code: str, fence: str = "```python") -> str:
    return f"Sure! Here is the completed function:\n\n{fence}\n{code}```\n\nIt handles every case in the docstring."


@pytest.mark.slow
@pytest.mark.parametrize("index", [0, 10])
def test_humaneval_completion_chat_full_function(problems, index):
    problem = problems[index]
    full = problem["prompt"] + problem["canonical_solution"]
    completion = quality.humaneval_completion(problem, _chatty(full), "chat")
    assert completion == "\n" + full
    assert "Sure!" not in completion and "```" not in completion
    assert quality.run_humaneval(problem, completion)["passed"] is True


@pytest.mark.slow
def test_humaneval_completion_chat_variants(problems):
    problem = problems[0]
    full = problem["prompt"] + problem["canonical_solution"]
    # "```py" fences, and an unterminated block (output cut at max_new_tokens)
    assert quality.humaneval_completion(problem, _chatty(full, "```py"), "chat") == "\n" + full
    unterminated = quality.humaneval_completion(problem, "Here:\n```python\n" + full, "chat")
    assert unterminated.rstrip("\n") == "\n" + full.rstrip("\n")
    assert quality.run_humaneval(problem, unterminated)["passed"] is True
    # a block with only the body is appended as is
    body = problem["canonical_solution"]
    assert quality.humaneval_completion(problem, _chatty(body), "chat") == body
    # a block defining another function is not treated as a redefinition
    other = "def helper():\n    return 1\n"
    assert quality.humaneval_completion(problem, _chatty(other), "chat") == other
    # no block at all: the text itself
    assert quality.humaneval_completion(problem, body, "chat") == body


@pytest.mark.slow
def test_humaneval_completion_chat_wrong_function_fails(problems):
    problem = problems[0]
    wrong = problem["prompt"] + "    return False\n"
    completion = quality.humaneval_completion(problem, _chatty(wrong), "chat")
    assert completion.startswith("\ndef ") or completion.startswith("\nfrom ")
    assert quality.run_humaneval(problem, completion, timeout=1.0)["passed"] is False


def test_humaneval_completion_chat_python3_fence(problems):
    problem = problems[0]
    full = problem["prompt"] + problem["canonical_solution"]
    assert quality.humaneval_completion(problem, _chatty(full, "```python3"), "chat") == "\n" + full


@pytest.mark.parametrize("stop", ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert "])
def test_humaneval_completion_raw_stops(problems, stop):
    body = "    x = 1\n    # an indented comment is kept\n    return x\n"
    text = body + stop + "rest of the file\n"
    assert quality.humaneval_completion(problems[0], text, "raw") == body


@pytest.mark.slow
def test_humaneval_completion_raw_earliest_stop_and_no_stop(problems):
    body = "    return 1\n"
    assert quality.humaneval_completion(problems[0], body + "\nprint(f())\ndef g():\n    pass\n", "raw") == body
    assert quality.humaneval_completion(problems[0], body, "raw") == body
    # ```python fences are not special in raw rendering
    problem = problems[2]
    text = problem["canonical_solution"] + "\n\ndef check(candidate):\n    assert False\n"
    completion = quality.humaneval_completion(problem, text, "raw")
    assert completion == problem["canonical_solution"] + "\n"
    assert quality.run_humaneval(problem, completion)["passed"] is True


@pytest.mark.slow
def test_humaneval_score_end_to_end():
    dataset = HumanEval(limit=1, chat_template=HUMANEVAL_CHAT, timeout=2.0)
    prompt = dataset.load()[0]
    problem = prompt.meta["problem"]
    good = dataset.score(prompt, 0, _chatty(problem["prompt"] + problem["canonical_solution"]), "chat")
    assert good["score"] == 1.0 and good["passed"] is True
    bad = dataset.score(prompt, 0, _chatty(problem["prompt"] + "    return None\n"), "chat")
    assert bad["score"] == 0.0 and bad["passed"] is False
    raw = dataset.score(prompt, 0, problem["canonical_solution"] + "\n\nprint('done')\n", "raw")
    assert raw["score"] == 1.0


# ---- GSM8K quality -----------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("#### 1,234", "1234"),
    ("So she makes 9 * 2 = $18 a day.\n#### 18", "18"),
    ("First 5, then 7 and finally 12 apples", "12"),
    ("The total is $18.00", "18"),
    ("It takes 3.5 hours", "3.5"),
    ("The answer is 42.", "42"),
    ("She lost 5 so the change is -5", "-5"),
    ("#### 72\n\nQuestion: another 99", "72"),
    ("####18", "18"),
])
def test_gsm8k_extract(text, expected):
    assert quality.gsm8k_extract(text) == expected


def test_gsm8k_extract_no_number():
    assert quality.gsm8k_extract("I do not know.") is None
    assert quality.gsm8k_extract("") is None
    assert quality.gsm8k_equal(None, "18") is False
    assert quality.gsm8k_equal("18", "18") is True
    assert quality.gsm8k_equal("17", "18") is False


def test_gsm8k_extract_empty_final_answer_takes_last_number():
    assert quality.gsm8k_extract("I got 5 then 7.\n####") == "7"


@pytest.mark.parametrize("answer, gold", [("... #### 18", "18"), ("x\n#### 1,000", "1000"), ("#### -3", "-3"),
                                          ("#### 2.50", "2.5")])
def test_gsm8k_gold(answer, gold):
    assert quality.gsm8k_gold(answer) == gold


def test_gsm8k_score(data_dir):
    dataset = GSM8K(data_dir=str(data_dir), limit=1)
    prompt = dataset.load()[0]
    right = dataset.score(prompt, 0, "16 - 3 - 4 = 9 eggs, 9 * 2 = $18.\n#### 18", "chat")
    assert right == {"score": 1.0, "correct": True, "pred": "18", "gold": "18"}
    assert dataset.score(prompt, 0, "She makes $18.00 every day.", "raw")["score"] == 1.0
    wrong = dataset.score(prompt, 0, "#### 9", "chat")
    assert wrong["score"] == 0.0 and wrong["correct"] is False and wrong["pred"] == "9"
    none = dataset.score(prompt, 0, "no idea", "chat")
    assert none["score"] == 0.0 and none["pred"] is None and none["gold"] == "18"
    assert MTBench().score(prompt, 0, "x", "chat") is None
