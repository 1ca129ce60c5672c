"""Prompts token-identical to the reference implementations, on Spec-Bench's
multi-turn questions (MT-Bench's 80, both turns, after a fixed first answer), text and ids. The
oracle is the reference code itself: fschat's conversations, driven as Spec-Bench's
evaluation/eval.py and the EAGLE authors' evaluation scripts drive them. The tokenizer is a small
sentencepiece model trained here on the questions, saved as a Llama checkpoint's tokenizer
(tokenizer.model + tokenizer_config.json) and loaded by the model config's own loading code."""
from __future__ import annotations

import json

import pytest
from fastchat.model import get_conversation_template  # fschat, the oracle: README's test command installs it

from bench.datasets import SPEC_BENCH_GROUPS, SpecBench
from bench.prompts import render
from helpers import DATA_DIR
from test_models import _instantiate_model

QUESTIONS = DATA_DIR / "spec_bench" / "question.jsonl"
# a first answer as the model might write it: surrounding whitespace, which the references strip
FIRST_ANSWER = "\n Sure! Here is my answer: 42.\n\nIt has two lines.  \n"


@pytest.fixture(scope="module")
def mt_bench() -> list:
    prompts = [p for p in SpecBench(path=str(QUESTIONS)).load() if p.meta["category"] in SPEC_BENCH_GROUPS["MT-Bench"]]
    assert len(prompts) == 80 and all(len(p.turns) == 2 for p in prompts)
    return prompts


@pytest.fixture(scope="module")
def llama_tokenizer_dir(tmp_path_factory, mt_bench):
    """A Llama-format tokenizer directory: sentencepiece BPE with byte fallback, <unk> <s> </s> as
    ids 0 1 2 (Llama's), trained in seconds on the questions themselves."""
    import sentencepiece

    path = tmp_path_factory.mktemp("llama_tokenizer")
    text = path / "corpus.txt"
    text.write_text("\n".join(t for p in mt_bench for t in p.turns) + "\n" + FIRST_ANSWER)
    sentencepiece.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(path / "tokenizer"), vocab_size=600, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        normalization_rule_name="identity", remove_extra_whitespaces=False, minloglevel=2)
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
         "add_bos_token": True, "add_eos_token": False}))
    return path


def _tokenizer(choice: str, tokenizer_dir):
    """The model config's tokenizer, by its own loading code, from the local directory."""
    return _instantiate_model(choice, f"model.path={tokenizer_dir}").load_tokenizer()


def _ours(tokenizer, prompt, turn: int):
    return render(tokenizer, prompt, turn, [FIRST_ANSWER] if turn else [], "chat")


def _fastchat_turns(conv, prompt, suffix: str = ""):
    """The prompt of each turn as the reference scripts build it: append the question and an open
    answer, get_prompt() (+ suffix), then store the stripped answer in the open slot."""
    prompts = []
    for turn, question in enumerate(prompt.turns):
        conv.append_message(conv.roles[0], question)
        conv.append_message(conv.roles[1], None)
        prompts.append(conv.get_prompt() + suffix)
        conv.messages[-1][-1] = FIRST_ANSWER.strip()
    return prompts


def test_vicuna_renders_as_spec_bench_renders_fastchats_vicuna_v1_1(llama_tokenizer_dir, mt_bench):
    """vicuna-7b-v1.3: Spec-Bench's get_conversation_template(model path) -> vicuna_v1.1, then
    tokenizer([prompt]): the same text and ids for both turns of all 80 questions, the BOS once."""
    for choice in ("vicuna-7b-v1.3", "vicuna-7b"):
        tokenizer = _tokenizer(choice, llama_tokenizer_dir)
        for prompt in mt_bench:
            conv = get_conversation_template("lmsys/vicuna-7b-v1.3")
            assert conv.name == "vicuna_v1.1"
            conv.messages = []  # as Spec-Bench does
            for turn, reference in enumerate(_fastchat_turns(conv, prompt)):
                text, ids = _ours(tokenizer, prompt, turn)
                assert text == reference, (choice, prompt.id, turn)
                assert ids == tokenizer([reference]).input_ids[0], (choice, prompt.id, turn)
                assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert "</s>USER: " in text and text.endswith(" ASSISTANT:")  # the second turn, after the first answer


# The system message of the EAGLE authors' Llama-2-chat and Llama-3 evaluation scripts (Llama-2's own)
EAGLE_SYSTEM = ("You are a helpful, respectful and honest assistant. Always answer as helpfully as possible, while "
                "being safe.  Your answers should not include any harmful, unethical, racist, sexist, toxic, "
                "dangerous, or illegal content. Please ensure that your responses are socially unbiased and "
                "positive in nature.\n\nIf a question does not make any sense, or is not factually coherent, "
                "explain why instead of answering something not correct. If you don't know the answer to a "
                "question, please don't share false information.")


@pytest.mark.parametrize("choice", ["llama2-7b-chat", "llama2-13b-chat"])
def test_llama2_chat_renders_as_the_eagle_authors_evaluation(llama_tokenizer_dir, mt_bench, choice):
    """llama2-*-chat: eagle/evaluation/gen_ea_answer_llama2chat.py's rendering: fschat's
    get_conversation_template("llama-2-chat") with their system message, get_prompt() + " ", then
    tokenizer([prompt]): the same text and ids for both turns of all 80 questions, the BOS once."""
    tokenizer = _tokenizer(choice, llama_tokenizer_dir)
    for prompt in mt_bench:
        conv = get_conversation_template("llama-2-chat")
        assert conv.name == "llama-2"
        conv.system_message = EAGLE_SYSTEM
        for turn, reference in enumerate(_fastchat_turns(conv, prompt, suffix=" ")):
            text, ids = _ours(tokenizer, prompt, turn)
            assert text == reference, (prompt.id, turn)
            assert ids == tokenizer([reference]).input_ids[0], (prompt.id, turn)
            assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == turn + 1
    assert " </s><s>[INST] " in text and text.endswith(" [/INST] ")  # the second turn, after the first answer


# A stand-in for Llama-3.1-Instruct's own template (Meta's tokenizer is gated): its plain-chat shape,
# BOS written by the template, every message's content trimmed.
LLAMA3_STAND_IN = ("{{ bos_token }}{% for m in messages %}"
                   "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
                   "{{ m['content'] | trim + '<|eot_id|>' }}"
                   "{% endfor %}{% if add_generation_prompt %}"
                   "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")


def test_llama3_renders_as_the_eagle_authors_evaluation(llama_tokenizer_dir, mt_bench, tmp_path):
    """llama-3.1-8b-instruct: eagle/evaluation/gen_ea_answer_llama3chat.py's rendering: the
    tokenizer's own template over their system message and the turns (add_generation_prompt), then
    tokenizer([prompt], add_special_tokens=False); the answer stored stripped. Our config adds the
    system message (model.system_message) and keeps the tokenizer's template: the same text and ids,
    the template's BOS once."""
    import shutil

    shutil.copytree(llama_tokenizer_dir, tmp_path / "tok")
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": LLAMA3_STAND_IN}))
    tokenizer = _tokenizer("llama-3.1-8b-instruct", tmp_path / "tok")
    assert tokenizer.chat_template == LLAMA3_STAND_IN  # the tokenizer's own, not replaced
    for prompt in mt_bench:
        messages = [{"role": "system", "content": EAGLE_SYSTEM}]
        for turn, question in enumerate(prompt.turns):
            messages.append({"role": "user", "content": question})
            reference = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            text, ids = _ours(tokenizer, prompt, turn)
            assert text == reference, (prompt.id, turn)
            assert ids == tokenizer([reference], add_special_tokens=False).input_ids[0], (prompt.id, turn)
            assert ids.count(tokenizer.bos_token_id) == 1
            messages.append({"role": "assistant", "content": FIRST_ANSWER.strip()})
    assert EAGLE_SYSTEM in text and text.count("<|start_header_id|>user") == 2


def test_speed_py_counts_a_baseline_answer_without_its_bos(llama_tokenizer_dir):
    """Spec-Bench's evaluation/speed.py counts the baseline's tokens as len(tokenizer(turn).input_ids) - 1:
    with a Llama tokenizer (BOS added) that is the stripped answer's own tokens."""
    from bench.spec_bench_table import speed_py_tokens

    tokenizer = _tokenizer("vicuna-7b-v1.3", llama_tokenizer_dir)
    assert tokenizer("x").input_ids[0] == tokenizer.bos_token_id == 1
    for answer in (FIRST_ANSWER, "Sure!", " Here is my answer: 42."):
        assert speed_py_tokens(tokenizer, answer) == len(tokenizer(answer.strip(), add_special_tokens=False).input_ids)
