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


def set_system_message(tokenizer, text: str | None) -> None:
    """A system turn to open every chat conversation with (model.system_message: the EAGLE authors'
    Llama-3 evaluation gives one), kept on the tokenizer beside its chat template."""
    tokenizer.bench_system_message = text


def render_text(tokenizer, prompt: Prompt, turn: int, previous_outputs: list[str], rendering: str) -> str:
    """The text for `turn`, after the model's own outputs for the earlier turns."""
    if rendering == "chat":
        system = getattr(tokenizer, "bench_system_message", None)
        messages = [{"role": "system", "content": system}] if system else []
        for user, assistant in prompt.shots:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        for i in range(turn):
            messages += [{"role": "user", "content": prompt.turns[i]},
                         {"role": "assistant", "content": previous_outputs[i]}]
        messages.append({"role": "user", "content": prompt.turns[turn]})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(prompt.raw_turns[i] + previous_outputs[i] + "\n\n" for i in range(turn)) + prompt.raw_turns[turn]


def encode(tokenizer, text: str, rendering: str) -> list[int]:
    """Ids as the reference code encodes them. Raw text gets the tokenizer's special tokens (a BOS,
    if any). A chat text that begins with the BOS (transformers' templates write it) gets none more;
    one that does not (FastChat's conversations, as Spec-Bench and the EAGLE authors' scripts render
    them, then call tokenizer([prompt])) gets the tokenizer's, as there. Either way: one BOS."""
    bos = getattr(tokenizer, "bos_token", None)
    special = rendering != "chat" or not (bos and text.startswith(bos))
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def render(tokenizer, prompt: Prompt, turn: int, previous_outputs: list[str], rendering: str) -> tuple[str, list[int]]:
    """The text and ids for `turn`, after the model's own outputs for the earlier turns."""
    text = render_text(tokenizer, prompt, turn, previous_outputs, rendering)
    return text, encode(tokenizer, text, rendering)


def _longest_token(tokenizer) -> int | None:
    """The most characters one token of this vocabulary stands for (byte-level BPE spells a byte
    as one character, SentencePiece a character as one), cached on the tokenizer; None for a
    tokenizer that cannot list its vocabulary."""
    if not hasattr(tokenizer, "_bench_longest_token"):
        try:
            tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
            tokenizer._bench_longest_token = max((len(t) for t in tokens if t), default=None)
        except (AttributeError, TypeError):
            tokenizer._bench_longest_token = None
    return tokenizer._bench_longest_token


KEPT_CHARS = 2000  # of a prompt too long to tokenize, what its skipped record keeps


def prepare(tokenizer, prompt: Prompt, turn: int, previous_outputs: list[str], rendering: str,
            max_context: int | None) -> tuple[str, list[int] | None, str | None]:
    """(text, ids, why it cannot run or None). A prompt cannot run when it renders to no tokens
    (an empty raw prompt: nothing to condition on) or when it fills the context by itself (no
    room for one new token); a prompt that fits runs, its new tokens capped by new_token_budget.
    A text too long to fit by its length alone (at least len / (2 x the longest token) tokens) is
    not tokenized (ids None), and its text comes back cut to KEPT_CHARS: a 50 MB line costs no
    minutes and no gigabytes."""
    text = render_text(tokenizer, prompt, turn, previous_outputs, rendering)
    longest = _longest_token(tokenizer) if max_context else None
    if longest:
        at_least = len(text) // (2 * longest)
        if at_least >= max_context:
            return (text[:KEPT_CHARS] + f"... ({len(text)} characters)", None,
                    f"prompt of {len(text)} characters (at least {at_least} tokens) leaves no room in the model's "
                    f"context of {max_context}")
    ids = encode(tokenizer, text, rendering)
    if not ids:
        return text, ids, f"empty prompt: rendered as {rendering} it has no tokens to condition on"
    if max_context and len(ids) >= max_context:
        return text, ids, f"prompt of {len(ids)} tokens leaves no room in the model's context of {max_context}"
    return text, ids, None


def new_token_budget(max_new: int, max_context: int | None, prompt_tokens: int) -> int:
    """The new tokens a prompt of prompt_tokens may get: max_new, capped where prompt and output
    reach the context (Spec-Bench runs every question and stops a generation at the length limit)."""
    return min(max_new, max_context - prompt_tokens) if max_context else max_new


def capped_stop_reason(generated: int, stopped: str, max_new: int) -> str:
    """A generation's stop_reason: "context" where it ran to a budget the context cut below max_new."""
    return "context" if stopped == "length" and generated < max_new else stopped
