"""Rendering a prompt turn (with the conversation so far) into token ids."""
from __future__ import annotations

from .datasets import Prompt
from .errors import BenchError

FORMATS = ("auto", "chat", "raw")


def rendering_for(tokenizer, prompt_format: str) -> str:
    """'chat' when the tokenizer has a chat template (instruct models), else 'raw'."""
    if prompt_format not in FORMATS:
        raise BenchError(f"prompt_format={prompt_format!r} is not one of {', '.join(FORMATS)}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if prompt_format == "chat" and not has_template:
        raise BenchError("prompt_format=chat, but this model's tokenizer has no chat template; use prompt_format=raw "
                         "or set model.chat_template")
    if prompt_format == "auto":
        return "chat" if has_template else "raw"
    return prompt_format


def render(tokenizer, prompt: Prompt, turn: int, previous_outputs: list[str], rendering: str) -> tuple[str, list[int]]:
    """The text and ids for `turn`, after the model's own outputs for the earlier turns."""
    if rendering == "chat":
        messages = []
        for user, assistant in prompt.shots:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        for i in range(turn):
            messages += [{"role": "user", "content": prompt.turns[i]}, {"role": "assistant", "content": previous_outputs[i]}]
        messages.append({"role": "user", "content": prompt.turns[turn]})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        text = "".join(prompt.raw_turns[i] + previous_outputs[i] + "\n\n" for i in range(turn)) + prompt.raw_turns[turn]
        ids = tokenizer(text)["input_ids"]
    return text, list(ids)
