"""model.backend=llamacpp: a GGUF package's model on llama.cpp, as shipped (dtype=auto) or converted once to
F32 (dtype=float32), with the harness's tokenizer (token ids identical to the torch path's)."""
from __future__ import annotations

import importlib.metadata
from pathlib import Path

import torch

from decoders.core.contract import CAPABILITIES
from decoders.core.llamacpp import GIVES, KV_TYPES, LlamaCppLM, bindings

from .errors import BenchError
from .hashes import file_sha256

BACKENDS = ("torch", "llamacpp")
WEIGHTS = {"auto": "shipped", "float32": "f32", "fp32": "f32"}  # dtype -> the GGUF llama.cpp reads
DEFAULT_CONTEXT = 8192  # llama.cpp's context when model.max_context is null: KV memory grows with it


def engine_of(spec) -> tuple[frozenset[str], str]:
    """What a model spec's engine gives a decoder (contract.check_engine), and the engine's name."""
    if getattr(spec, "backend", "torch") == "llamacpp":
        return GIVES, "llama.cpp (model.backend=llamacpp)"
    return frozenset(CAPABILITIES), "torch"


def check_backend(name: str, backend: str, dtype: str, kv_type: str) -> None:
    """model.backend, and what dtype and model.kv_type mean on it: one line when not allowed."""
    if backend not in BACKENDS:
        raise BenchError(f"model {name}: model.backend={backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "llamacpp":
        if dtype not in WEIGHTS:
            raise BenchError(f"model {name}: on model.backend=llamacpp, dtype={dtype!r} is not allowed; use auto "
                             "(the GGUF as shipped) or float32 (an F32 conversion of it)")
        if kv_type not in ("auto", *KV_TYPES):
            raise BenchError(f"model {name}: model.kv_type={kv_type!r} is not one of auto, {', '.join(KV_TYPES)}")


def f32_copy(gguf: Path, cache_dir: str) -> Path:
    """The GGUF with every tensor in F32, written once beside the cache's models by llama.cpp's own
    quantizer (llama_model_quantize to ALL_F32, requantizing allowed: each tensor dequantized)."""
    target = Path(cache_dir).expanduser() / "gguf-f32" / f"{gguf.stem}-{gguf.stat().st_size}.F32.gguf"
    if target.is_file():
        return target
    lib = bindings()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    params = lib.llama_model_quantize_default_params()
    params.ftype = lib.LLAMA_FTYPE_ALL_F32
    params.allow_requantize = True
    params.nthread = torch.get_num_threads()
    print(f"[bench] converting {gguf.name} to F32 once into {target.parent}", flush=True)
    if lib.llama_model_quantize(str(gguf).encode(), str(tmp).encode(), params) != 0:
        tmp.unlink(missing_ok=True)
        raise BenchError(f"llama.cpp could not convert {gguf} to F32")
    tmp.replace(target)
    return target


def load(spec, step: int) -> LlamaCppLM:
    """The spec's GGUF (bench.models.GGUFPackageModel) on llama.cpp, for steps of up to `step` tokens."""
    from transformers import GenerationConfig

    shipped = spec.gguf_path()
    gguf = shipped if WEIGHTS[spec.dtype] == "shipped" else f32_copy(shipped, spec.cache_dir)
    tokenizer = spec.load_tokenizer()
    config = spec.config()
    margin = step + 64  # a step's tree past the last admitted token
    trained = config.get_text_config().max_position_embeddings
    context = spec.max_context or min(DEFAULT_CONTEXT, trained) - margin
    kv_type = spec.kv_type if spec.kv_type != "auto" else ("f32" if gguf is not shipped else "f16")
    try:
        lm = LlamaCppLM(gguf, tokenizer, config, name=spec.name, threads=torch.get_num_threads(),
                        n_ctx=context + margin, n_seq=min(256, max(64, step + 2)), kv_type=kv_type,
                        max_context=context)
    except (ImportError, ValueError) as e:
        raise BenchError(f"model {spec.name}: {e}") from None
    eos = GenerationConfig.from_model_config(config).eos_token_id
    lm.stop_ids = lm.stop_ids | frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])
    lm.source = {"package": spec.package, "version": importlib.metadata.version(spec.package),
                 "gguf_file": spec.gguf_file, "packages": spec.package_versions(),
                 "gguf_sha256": file_sha256(shipped, spec.cache_dir), "engine": lm.engine(),
                 "llama_cpp_python": importlib.metadata.version("llama_cpp_python")}
    lm.weights_id = f"sha256:{file_sha256(gguf, spec.cache_dir)}"
    lm.memory_estimate = None
    return lm
