"""Small trained add-ons (exit adapters, Medusa heads) as safetensors files tagged with a format
name, so that a file of one kind given where another is expected fails with a clear message; and
checkpoints published by others (a directory or a hub id: config.json + weights), with the checks
that they were made for this target."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn


REPO = Path(__file__).resolve().parents[2]


def addon_path(path: str | Path) -> Path:
    """An add-on file named in a config: as given (absolute, or found from the working directory),
    else relative to the repository, where the shipped ones live (adapters/)."""
    p = Path(path).expanduser()
    return p if p.is_absolute() or p.exists() else REPO / p


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gz")


def addon_bytes(decoder) -> int:
    """Bytes of the add-on files a decoder names (its EAGLE draft / heads / n-gram LM, its draft's exit
    adapter), for the memory estimate before the target loads: a local file or directory as it is; a
    hub id by the size of its largest weights file (the one a loader reads), from the hub's file
    listing, without downloading. A hub id that cannot be looked up (offline) counts 0."""
    names = [getattr(decoder, key, None) for key in ("draft_weights", "heads", "ngram")]
    names.append(getattr(getattr(decoder, "draft", None), "adapter", None))
    total = 0
    for name in names:
        if not isinstance(name, (str, Path)) or not name:
            continue
        p = addon_path(name)
        if not p.exists():
            total += hub_weights_bytes(str(name))
            continue
        files = [p] if p.is_file() else [f for f in p.rglob("*") if f.suffix in WEIGHT_SUFFIXES]
        total += sum(f.stat().st_size for f in files if f.is_file())
    return total


def hub_weights_bytes(repo_id: str) -> int:
    """The largest weights file of hub repository `repo_id` (0 where the hub cannot be asked)."""
    from huggingface_hub import HfApi

    try:
        info = HfApi().model_info(repo_id, files_metadata=True, timeout=10)
    except Exception:  # not a hub id, no network, HF_HUB_OFFLINE: the estimate goes without it
        return 0
    return max((f.size or 0 for f in info.siblings or [] if Path(f.rfilename).suffix in WEIGHT_SUFFIXES), default=0)


def save_weights(module: nn.Module, path: str | Path, fmt: str, meta: dict[str, str], int8: bool = False) -> None:
    """Floating-point tensors in float16, as the EAGLE and Medusa authors publish theirs: half the
    bytes of float32 (the shipped add-ons must travel to a GPU machine in a small checkout), and
    loaders cast to the run's dtype. Measured on SmolLM2's add-ons: results/reference/adapters_fp16/.
    int8: weight matrices in 8 bits (int8_state), half the bytes again."""
    save_state(module.state_dict(), path, fmt, meta, int8)


def save_state(state: dict, path: str | Path, fmt: str, meta: dict[str, str], int8: bool = False) -> None:
    from safetensors.torch import save_file

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    state = {k: (v.detach().to(torch.float16) if v.is_floating_point() else v.detach()).contiguous()
             for k, v in state.items()}
    if int8:
        state, quantized = int8_state(state)
        meta = {**meta, INT8: json.dumps(quantized)}
    save_file(state, str(path), metadata={"format": fmt, **meta})


INT8 = "int8"  # metadata: the names of the matrices stored in 8 bits, each with <name>.scale beside it
INT8_MIN_ELEMENTS = 4096  # smaller tensors (norms, biases) stay float16: a few bytes, rounded for nothing


def int8_state(state: dict) -> tuple[dict, list[str]]:
    """Every floating weight matrix of INT8_MIN_ELEMENTS or more as int8 with one float16 scale per
    output row (symmetric: the row's largest magnitude is 127), and the names of those matrices; the
    rest as given. Each value is then off by at most half a step, 1/254 of its row's largest."""
    out, quantized = {}, []
    for name, v in state.items():
        if v.is_floating_point() and v.dim() == 2 and v.numel() >= INT8_MIN_ELEMENTS:
            scale = (v.float().abs().amax(1) / 127).clamp(min=torch.finfo(torch.float16).tiny).to(torch.float16)
            out[name] = (v.float() / scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
            out[f"{name}.scale"] = scale.contiguous()
            quantized.append(name)
        else:
            out[name] = v
    return out, quantized


def load_weights(path: Path, fmt: str, key: str, kind: str, hint: str) -> tuple[dict[str, str], dict]:
    """(metadata, state dict) of a file written by save_weights with this format, matrices stored in
    int8 back in float32; `key` (the config key that named the file), `kind` and `hint` (how to get
    one) word the errors."""
    from safetensors import safe_open

    if not path.is_file():
        raise FileNotFoundError(f"{key}: no {kind} at {path}; {hint}")
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            state = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors' own error: empty, truncated, or another format
        reason = " ".join(str(e).split())[:200] or type(e).__name__
        raise ValueError(f"{key}: {path} is not a readable safetensors file ({reason}); {hint}") from None
    if meta.get("format") != fmt:
        article = "an" if kind[0].lower() in "aeiou" else "a"
        raise ValueError(f"{key}: {path} is not {article} {kind} (format {meta.get('format')!r})")
    return meta, dequantized(meta, state, key, path)


def dequantized(meta: dict, state: dict, key: str, path) -> dict:
    """`state` with the matrices its metadata stores in int8 (int8_state) back in float32."""
    quantized = meta_json(meta, INT8, key, path, "[]")
    if not isinstance(quantized, list) or any(
            not isinstance(n, str) or state.get(n, torch.empty(0)).dtype != torch.int8 or f"{n}.scale" not in state
            for n in quantized):
        raise ValueError(f"{key}: {path} records int8 matrices it does not hold with their scales; replace the file")
    for name in quantized:
        state[name] = state[name].float() * state.pop(f"{name}.scale").float()[:, None]
    return state


def whole_number(value, name: str, key: str, path) -> int:
    """`value`, an integer a weights file's metadata (or a checkpoint's config.json) records as
    `name`; missing or not an integer is one line naming the key, the file and the entry."""
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().isdigit():
        what = f"does not record {name}" if value is None else f"records {name}={value!r}, not a whole number"
        raise ValueError(f"{key}: {path} {what}; it was not written for this harness, or was damaged: replace it")
    return int(value)


def meta_int(meta: dict, name: str, key: str, path) -> int:
    """The integer entry `name` of a weights file's metadata (whole_number)."""
    return whole_number(meta.get(name), name, key, path)


def meta_json(meta: dict, name: str, key: str, path, default: str):
    """A JSON entry of a weights file's metadata (`default` where absent), one line if unreadable."""
    try:
        return json.loads(meta.get(name, default))
    except (TypeError, ValueError):
        raise ValueError(f"{key}: {path} records {name} that is not JSON; it was not written for this "
                         "harness, or was damaged: replace it") from None


def load_state(module, state: dict, key: str, where, layout: str) -> None:
    """module.load_state_dict, with missing, unexpected or misshapen tensors one line naming the first."""
    try:
        module.load_state_dict(state)
    except RuntimeError as e:
        detail = " ".join(str(e).split("\n\t")[1:2]).strip() or str(e).splitlines()[0]
        raise ValueError(f"{key}: {where} does not hold {layout} ({detail[:200]})") from None


# ---- checkpoints published by others (EAGLE, Medusa): a directory, or a hub id ----------------------
def is_checkpoint_dir(path: str | Path) -> bool:
    """A published checkpoint (a directory, local or a hub id), as opposed to one of our files."""
    p = addon_path(path)
    return p.is_dir() or (not p.exists() and p.suffix not in (".safetensors", ".pt", ".bin", ".gz"))


def checkpoint_dir(name: str | Path, key: str, files: list[str]) -> Path:
    """A local directory as is; anything else is a hub id, fetched (only `files`) with huggingface_hub's
    snapshot_download into its cache."""
    p = addon_path(name)
    if p.is_dir():
        return p
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=str(name), allow_patterns=files))
    except Exception as e:  # not a hub id, no such repository, or no network
        reason = " ".join(str(e).split())[:200] or type(e).__name__
        raise ValueError(f"{key}: {name} is neither a local directory nor a hub id "
                         f"that could be fetched ({reason})") from None


def read_config(directory: Path, key: str) -> dict:
    path = directory / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{key}: {directory} has no readable config.json ({type(e).__name__}); "
                         "a published checkpoint directory holds config.json and its weights") from None
    if not isinstance(config, dict):
        raise ValueError(f"{key}: {path} holds a JSON {type(config).__name__}, not an object of settings")
    return config


def read_state(directory: Path, names: list[str], key: str) -> dict:
    """The state dict of the first of `names` present in `directory` (safetensors, its int8 matrices
    back in float32 (an EAGLE-3 draft trained here may store them so), or a pickled torch state dict
    loaded with weights_only=True: tensors, never code)."""
    import torch

    path = next((directory / n for n in names if (directory / n).is_file()), None)
    if path is None:
        raise ValueError(f"{key}: {directory} holds none of {', '.join(names)}")
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open
            with safe_open(str(path), "pt") as f:
                meta, state = f.metadata() or {}, {k: f.get_tensor(k) for k in f.keys()}
        else:
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        reason = " ".join(str(e).split())[:200] or type(e).__name__
        raise ValueError(f"{key}: {path} could not be read ({reason})") from None
    return dequantized(meta, state, key, path)


def _base_name(name: str) -> str:
    return str(name).rstrip("/").rsplit("/", 1)[-1].lower()


def check_target(lm, key: str, where, *, vocab: int | None = None, hidden: int | None = None,
                 base: str | None = None, check_base: bool = True) -> None:
    """One line naming both sides when an add-on was made for another target: vocabulary size, hidden
    size, and the base model's name where the file records one (compared by its last path component
    with the target's config name and the path it was loaded from)."""
    cfg = lm.config.get_text_config()
    vocab = None if vocab is None else whole_number(vocab, "vocab_size", key, where)
    hidden = None if hidden is None else whole_number(hidden, "hidden_size", key, where)
    if vocab is not None and vocab != lm.vocab_size:
        raise ValueError(f"{key}: {where} was made for a vocabulary of {vocab} tokens; {lm.name} has {lm.vocab_size}")
    if hidden is not None and hidden != cfg.hidden_size:
        raise ValueError(f"{key}: {where} was trained for hidden size {hidden}; {lm.name} has {cfg.hidden_size}")
    if base and check_base:
        names = {_base_name(n) for n in (lm.name, getattr(lm.config, "_name_or_path", "")) if n}
        if _base_name(base) not in names:
            loaded = getattr(lm.config, "_name_or_path", "") or lm.name
            raise ValueError(f"{key}: {where} was made for base model {base}; the target is {lm.name} ({loaded}); "
                             f"use a checkpoint for this target, or decoder.check_base=false if it is the same model "
                             f"under another name")


def load_checked(lm, path: str | Path, fmt: str, key: str, kind: str, hint: str, *,
                 check_base: bool = True) -> tuple[dict[str, str], dict, dict]:
    """One of our add-on files (load_weights), checked against the target it is loaded for
    (check_target): its metadata, tensors and recorded info."""
    p = addon_path(path)
    meta, state = load_weights(p, fmt, key, kind, hint)
    info = meta_json(meta, "info", key, p, "{}")
    if not isinstance(info, dict):
        raise ValueError(f"{key}: {p} has metadata info that is not a JSON object; replace the file")
    check_target(lm, key, p, vocab=meta.get("vocab_size"), hidden=meta_int(meta, "hidden_size", key, p),
                 base=info.get("model"), check_base=check_base)
    return meta, state, info


VOCAB_FORMAT = "draft-vocab-v1"


def load_vocab(lm, spec: str | None, key: str = "decoder.readout_vocab",
               check_base: bool = True) -> tuple[list[int] | None, dict]:
    """The token ids a draft's readout is limited to, and what tuning reports about them. `spec`:
    auto, adapters/<model>-vocab.json when it exists (scripts/draft_vocab.py), else the whole
    vocabulary; full (or null), the whole vocabulary; or the path of such a file."""
    whole = None, {"readout_vocab": lm.vocab_size}
    if spec in (None, "full"):
        return whole
    path = addon_path(f"adapters/{lm.name}-vocab.json" if spec == "auto" else spec)
    if spec == "auto" and not path.is_file():
        return whole
    hint = "make one with scripts/draft_vocab.py, or use auto or full"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{key}: no vocabulary file at {path}; {hint}") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{key}: {path} could not be read ({' '.join(str(e).split())[:120]}); {hint}") from None
    if not isinstance(data, dict) or data.get("format") != VOCAB_FORMAT:
        raise ValueError(f"{key}: {path} is not a {VOCAB_FORMAT} file; {hint}")
    check_target(lm, key, path, vocab=data.get("vocab_size"), base=data.get("model"), check_base=check_base)
    tokens = data.get("tokens")
    if (not isinstance(tokens, list) or not tokens or len(set(tokens)) != len(tokens)
            or any(type(t) is not int or not 0 <= t < lm.vocab_size for t in tokens)):
        raise ValueError(f"{key}: {path} must list distinct token ids in [0, {lm.vocab_size}); {hint}")
    return sorted(tokens), {"readout_vocab": len(tokens), "readout_coverage": data.get("heldout_coverage")}
