"""Small trained add-ons (exit adapters, Medusa heads) as safetensors files tagged with a format
name, so that a file of one kind given where another is expected fails with a clear message."""
from __future__ import annotations

from pathlib import Path

from torch import nn


REPO = Path(__file__).resolve().parents[2]


def addon_path(path: str | Path) -> Path:
    """An add-on file named in a config: as given (absolute, or found from the working directory),
    else relative to the repository, where the shipped ones live (adapters/)."""
    p = Path(path).expanduser()
    return p if p.is_absolute() or p.exists() else REPO / p


def save_weights(module: nn.Module, path: str | Path, fmt: str, meta: dict[str, str]) -> None:
    from safetensors.torch import save_file

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().contiguous() for k, v in module.state_dict().items()}
    save_file(state, str(path), metadata={"format": fmt, **meta})


def load_weights(path: Path, fmt: str, key: str, kind: str, hint: str) -> tuple[dict[str, str], dict]:
    """(metadata, state dict) of a file written by save_weights with this format; `key` (the config
    key that named the file), `kind` and `hint` (how to get one) word the errors."""
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
    return meta, state
