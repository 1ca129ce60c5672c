"""`python -m bench.show RUN_DIR --prompt ID`: one generation, step by step.

The new tokens are grouped by the target forward pass that committed them and coloured by how
many that pass committed (1 = plain, as autoregressive; 2, 3, 4+ = stronger colours), as the
lookahead decoding blog shows its demo: where a method speeds up, long coloured runs; where it
stalls, single plain tokens. Writes a self-contained HTML page (RUN_DIR/show/<prompt>_<turn>.html
by default; an id that is not a plain short file name gets a hash) and prints the same to the terminal
with ANSI colours. A page is written only as a new file or over a page of bench.show's own, never
through a symbolic link: --out cannot replace a run's records or any other file.

`--prompt-ids` prints instead the exact prompt text and token ids the run fed the model for that
prompt and turn (the record's text, encoded as the runner encodes it), to check a rendering
against a reference implementation's.
"""
from __future__ import annotations

import hashlib
import html
import json
import os
import re
import sys
from pathlib import Path

from . import rundir
from .errors import BenchError, fail
from .prompts import encode
from .records import read_records, records_path
from .runner import recorded_spec
from .usage import Parser

# tokens committed by one pass -> (HTML background, ANSI 256-colour background)
COLOURS = {1: ("#eeeeee", None), 2: ("#c6e9ff", 153), 3: ("#9fd99f", 114), 4: ("#ffd27f", 222)}
LEGEND = {1: "1 token (as autoregressive)", 2: "2 tokens", 3: "3 tokens", 4: "4+ tokens"}
# What marks a page as this command's own: only such a page may be written over.
GENERATOR = '<meta name="generator" content="decoding-bench show">'


def colour(n: int) -> tuple[str, int | None]:
    return COLOURS[min(max(n, 1), 4)]


def page_name(prompt_id: str, turn: int) -> str:
    """The HTML file's name: the id itself where it is a plain, short file name; else its safe
    characters, cut short, plus a hash of the whole id, so that two ids (a/b, a_b) never share a
    page and no name exceeds the file system's 255 bytes."""
    if re.fullmatch(r"[A-Za-z0-9._-]{1,100}", prompt_id) and not prompt_id.startswith("."):
        return f"{prompt_id}_{turn}.html"
    digest = hashlib.sha1(prompt_id.encode("utf-8", "surrogatepass")).hexdigest()[:10]
    return f"{re.sub(r'[^A-Za-z0-9._-]', '_', prompt_id)[:100].lstrip('.')}-{digest}_{turn}.html"


def load_record(run_dir: Path, prompt_id: str, turn: int) -> dict:
    if not run_dir.is_dir():
        raise BenchError(f"no run directory at {run_dir}")
    path = records_path(run_dir)  # records.jsonl, or a reference run's records.jsonl.gz
    if path.exists() and not path.is_file():
        raise BenchError(f"{path} is not a regular file: give a run directory written by python -m bench")
    if not path.is_file():
        raise BenchError(f"{run_dir} holds no records.jsonl: give a run directory written by python -m bench")
    records = read_records(path)  # a torn or damaged line is skipped with a warning
    for r in records:
        if r.get("prompt_id") == prompt_id and r.get("turn") == turn:
            if r.get("status") != "ok":
                raise BenchError(f"{prompt_id} turn {turn} was {r.get('status')}: {r.get('reason')}")
            return r
    ids = sorted({f"{r.get('prompt_id')}" for r in records})
    raise BenchError(f"no record for prompt {prompt_id!r} turn {turn} in {path}; it has {len(ids)} prompt(s): "
                     f"{', '.join(ids[:5])}{' ...' if len(ids) > 5 else ''}")


def tokenizer_for(run_dir: Path):
    spec = recorded_spec(run_dir, "model")  # a run directory's config may name only our classes
    return spec.load_tokenizer() if hasattr(spec, "load_tokenizer") else spec.load().tokenizer


def step_texts(record: dict, tokenizer) -> list[tuple[str, int, int]]:
    """Per target pass: (the text it committed, tokens committed, tokens fed). Text is decoded
    incrementally (the whole prefix, minus what came before), so multi-byte characters and
    word-initial spaces land in the step that completed them."""
    tokens, trace = record["tokens"], record["trace"]
    out, done, before = [], 0, ""
    for committed, fed in zip(trace["committed"], trace["forward_tokens"]):
        done += committed
        text = tokenizer.decode(tokens[:done], skip_special_tokens=True)
        out.append((text[len(before):], committed, fed))
        before = text
    return out


def prompt_ids(record: dict, tokenizer) -> list[int]:
    """The ids the run fed the model: the record's prompt text encoded as the runner encodes it
    (bench/prompts.py), checked against the count the run recorded."""
    if not record.get("prompt_text") or not record.get("rendering"):
        raise BenchError(f"the record of {record['prompt_id']} turn {record['turn']} keeps no prompt text or rendering")
    ids = encode(tokenizer, record["prompt_text"], record["rendering"])
    if record.get("prompt_tokens") is not None and len(ids) != record["prompt_tokens"]:
        raise BenchError(f"the run's tokenizer now encodes this prompt as {len(ids)} tokens, the run fed "
                         f"{record['prompt_tokens']}: the tokenizer or bench/prompts.py changed since")
    return ids


def show_prompt(run_dir: str | Path, prompt_id: str, turn: int = 0) -> list[int]:
    """Print the prompt text and ids the run fed the model for this prompt and turn."""
    run_dir = Path(run_dir)
    record = load_record(run_dir, prompt_id, turn)
    ids = prompt_ids(record, tokenizer_for(run_dir))
    print(f"prompt {prompt_id} turn {turn} as the run fed it ({record['rendering']} rendering, {len(ids)} tokens); "
          f"text between the lines:\n{'-' * 40}\n{record['prompt_text']}\n{'-' * 40}\nids: {json.dumps(ids)}")
    return ids


def render_html(record: dict, steps: list[tuple[str, int, int]]) -> str:
    spans = []
    for i, (text, committed, fed) in enumerate(steps):
        bg, _ = colour(committed)
        tip = f"step {i}: {committed} token(s) committed, {fed} fed to the target"
        spans.append(f'<span class="step" data-tokens="{committed}" title="{html.escape(tip)}" '
                     f'style="background:{bg}">{html.escape(text)}</span>')
    legend = " ".join(f'<span style="background:{COLOURS[k][0]};padding:0 6px">{v}</span>' for k, v in LEGEND.items())
    n, steps_n = record["new_tokens"], record["steps"]
    head = (f"{html.escape(str(record['decoder']))} | {html.escape(str(record['model']))} | "
            f"{html.escape(str(record['dataset']))} | prompt {html.escape(str(record['prompt_id']))} "
            f"turn {record['turn']} | {n} new tokens in {steps_n} steps = {n / steps_n:.2f} tokens per step | "
            f"{record['tokens_per_s']:.1f} tokens/s")
    return f"""<!doctype html>
<html><head>
<meta charset="utf-8">{GENERATOR}
<title>{html.escape(str(record['decoder']))} {html.escape(str(record['prompt_id']))}</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto}}
pre{{white-space:pre-wrap;font-size:14px;line-height:1.6}}
.step{{border-right:1px solid #fff}} .prompt{{color:#666}}</style></head><body>
<h3>{head}</h3>
<p>Each box is one target forward pass; its colour says how many tokens that pass committed. {legend}</p>
<h4>Prompt</h4><pre class="prompt">{html.escape(record.get('prompt_text') or '')}</pre>
<h4>Output</h4><pre>{''.join(spans)}</pre>
</body></html>
"""


def check_page(path: Path, default: bool) -> None:
    """A page goes to a new file or over a page of this command's own, and never through a symbolic
    link (the page's, or the show/ directory a run holds): else one line naming the file."""
    where = "RUN_DIR/show/" if default else "--out"
    for link in ([path.parent] if default else []) + [path]:
        if link.is_symlink():
            raise BenchError(f"{link} is a symbolic link; bench.show writes only files it makes, never through a "
                             f"link: remove it, or give --out a new file")
    if default and path.parent.exists() and not path.parent.is_dir():
        raise BenchError(f"{path.parent} is not a directory; bench.show writes its pages into {where}: remove it, "
                         "or give --out a new file")
    if not os.path.lexists(path):
        return
    try:
        ours = path.is_file() and GENERATOR.encode() in path.read_bytes()[:4096]
    except OSError as e:
        raise BenchError(f"cannot read {path} ({e.strerror or e}); give --out a new file") from None
    if not ours:
        raise BenchError(f"{path} exists and is not a page of bench.show; a page is written only as a new file or "
                         f"over an earlier page: give --out a new file")


def render_terminal(steps: list[tuple[str, int, int]], use_colour: bool) -> str:
    parts = []
    for text, committed, _ in steps:
        _, ansi = colour(committed)
        if not use_colour:
            parts.append(text if committed == 1 else f"[{text}]")
        elif ansi is None:
            parts.append(text)
        else:
            parts.append(f"\x1b[48;5;{ansi}m\x1b[30m{text}\x1b[0m")
    return "".join(parts)


def show(run_dir: str | Path, prompt_id: str, turn: int = 0, out: str | Path | None = None,
         use_colour: bool | None = None) -> Path:
    run_dir = Path(run_dir)
    record = load_record(run_dir, prompt_id, turn)
    steps = step_texts(record, tokenizer_for(run_dir))
    path = Path(out) if out else run_dir / "show" / page_name(prompt_id, turn)
    check_page(path, default=not out)
    rundir.write_atomic(path, render_html(record, steps), hint="give a writable --out FILE")
    if use_colour is None:
        use_colour = sys.stdout.isatty()
    print(render_terminal(steps, use_colour))
    n = record["new_tokens"]
    legend = ("plain = 1 token per pass, coloured/bracketed = several" if use_colour
              else "[...] = one pass that committed several tokens")
    print(f"\n{record['decoder']}: {n} tokens in {record['steps']} steps ({n / record['steps']:.2f} per step); "
          f"{legend}; wrote {path}")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = Parser(__doc__, prog="python -m bench.show")
    parser.add_argument("run_dir")
    parser.add_argument("--prompt", required=True, help="prompt id, e.g. HumanEval/0")
    parser.add_argument("--turn", type=int, default=0)
    parser.add_argument("--out", help="HTML file (default RUN_DIR/show/<prompt>_<turn>.html)")
    parser.add_argument("--no-color", action="store_true")
    parser.add_argument("--prompt-ids", action="store_true",
                        help="print the exact prompt text and token ids the run fed the model, instead")
    args = parser.parse_args(argv)
    try:
        if args.prompt_ids:
            show_prompt(args.run_dir, args.prompt, args.turn)
        else:
            show(args.run_dir, args.prompt, args.turn, args.out, False if args.no_color else None)
    except BenchError as e:
        fail(e)


if __name__ == "__main__":
    main()
