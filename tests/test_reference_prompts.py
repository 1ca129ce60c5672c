"""Issue 41, item 1: prompts token-identical to the reference implementations, on Spec-Bench's
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
