"""model.fast_path=kernel: our own small-M linear kernel (kernels.cpp beside this file), CPU: AVX-512
(float32 and bfloat16), or else AVX2 with FMA (float32).

Every nn.Linear's class is swapped for KernelLinear (the same module: parameters, tying, hooks and
sharing stay as they are), which keeps its weight repacked into column panels and computes inputs of
1..MAX_ROWS rows on them: each weight is streamed once for all the rows, and each output is summed
over k in a fixed order, so a row's result is bitwise the same alone or among others (a tree's
verification and a one-token step agree in the linears). Wider inputs (a prompt's prefill) and
autograd keep the native kernel. RMSNorms of Llama's formula, or Gemma's ((1 + w), computed in float32;
their class checked by a probe), are swapped too, for KernelRMSNorm: one call into the library per norm instead of
transformers' seven or eight operations;
and attention whose model's rotary is Llama's, for KernelAttention: inside it, apply_rotary_pos_emb runs
in the library, bitwise transformers' result (both save 2.1-4.2 ms a SmolLM2 forward on a 2-core Zen 4:
results/reference/kernels/split_zen4/).

The extension (plain C on raw pointers, called through ctypes: no torch headers, so it builds in
seconds) is built at first use by torch.utils.cpp_extension.load (g++ -O3 with the flags of the widest
instructions the CPU has, AVX-512 or AVX2; bfloat16's kernel needs avx512_bf16) into torch's extension
cache, TORCH_EXTENSIONS_DIR or
~/.cache/torch_extensions/<python>_<accelerator>/decoding_bench_kernels_<hash of source and flags>/,
once per machine: later processes load the built library from there without a compiler. The build's
seconds are kept apart (build_seconds), never inside a timed run. kernel_supported says in one line
why a machine cannot take the path (neither AVX-512 nor AVX2 with FMA, no avx512_bf16 for bfloat16, no
compiler, a build error); the caller then keeps the native path.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import sys
import threading
import time
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

SOURCE = Path(__file__).with_name("kernels.cpp")
# The library is built for the widest instructions the CPU has (ISAS, in order of preference). AVX-512:
# every kernel; the bfloat16 one adds avx512_bf16 by a target attribute in the source, so the float32
# kernels still run on an AVX-512 CPU without it. AVX2 with FMA (a Zen 3, older Xeons): float32 alone, and
# no contraction of a product and a sum into an FMA (the rotary stays bitwise transformers').
ISAS = {"avx512": ("avx512f", "avx512bw", "avx512dq", "avx512vl", "fma"), "avx2": ("avx2", "fma")}
CFLAGS = {"avx512": ["-O3", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mfma",
                     "-mprefer-vector-width=512", "-fopenmp"],
          "avx2": ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp"]}
LDFLAGS = ["-fopenmp"]  # OpenMP: the same libgomp torch has loaded (torch.set_num_threads holds)
MAX_ROWS = 64  # wider inputs run the native kernel (oneDNN/MKL block over k; a prompt's prefill)
PANEL = {"avx512": 32, "avx2": 16}  # output columns per packed panel (kernels.cpp: two vectors)
NEEDED_FLAGS = {torch.float32: ISAS["avx2"], torch.bfloat16: (*ISAS["avx512"], "avx512_bf16")}  # the least

_lib: Library | None = None  # the loaded extension
_why_not: str | None = None  # why it cannot load here, once found (not tried again in this process)
build_seconds = 0.0  # seconds this process spent building it (0 when it was loaded from the cache)


def extension_name(built_for: str) -> str:
    """The extension's name in torch's cache: a new source, new flags or another torch build a new one."""
    digest = hashlib.sha1(SOURCE.read_bytes() + " ".join(CFLAGS[built_for] + LDFLAGS).encode()
                          + torch.__version__.encode())
    return f"decoding_bench_kernels_{digest.hexdigest()[:12]}"


def build_id() -> str | None:
    """The library this CPU takes (its name: source, flags and torch), or None where it has no build."""
    built_for = isa()
    return extension_name(built_for) if built_for else None


def build_directory(name: str) -> Path:
    from torch.utils import cpp_extension
    try:
        return Path(cpp_extension._get_build_directory(name, False))
    except (AttributeError, TypeError):  # a torch without the private helper: its documented default
        root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
        return Path(root) / name


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags (Linux: /proc/cpuinfo), or None where they cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def isa() -> str | None:
    """The instructions the library is built for on this CPU (a key of ISAS), or None where it has neither."""
    flags = cpu_flags() or set()
    return next((name for name, needed in ISAS.items() if set(needed) <= flags), None)


def missing_instructions(dtype: torch.dtype) -> str | None:
    """Why this CPU cannot run the kernel for `dtype`, or None."""
    if dtype not in NEEDED_FLAGS:
        return f"the kernel path supports float32 and bfloat16, not {str(dtype).replace('torch.', '')}"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the kernel path needs an x86-64 CPU with AVX-512 or AVX2, not {platform.machine()}"
    flags = cpu_flags()
    if flags is None:
        return "cannot read this CPU's instruction sets (/proc/cpuinfo)"
    missing = [f for f in NEEDED_FLAGS[dtype] if f not in flags]
    if missing and dtype == torch.bfloat16:
        return f"this CPU lacks {', '.join(missing)} (the bfloat16 kernel needs it)"
    if missing:
        return f"this CPU lacks {', '.join(missing)} (the kernel path needs AVX-512, or AVX2 with FMA)"
    return None


def _build(built_for: str) -> Path:
    """The extension's library for `built_for` (a key of ISAS) in torch's cache, built there first if it
    is not (a compiler and ninja needed)."""
    global build_seconds
    name = extension_name(built_for)
    where = build_directory(name)
    library = where / f"{name}.so"
    if library.is_file() and not (where / "lock").exists():  # built before, by any process: no compiler needed
        return library
    from torch.utils import cpp_extension
    print(f"model.fast_path=kernel: building the {built_for} kernels once for this machine into {where}",
          file=sys.stderr, flush=True)
    start = time.perf_counter()
    built = cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=CFLAGS[built_for],
                               extra_ldflags=LDFLAGS, is_python_module=False, verbose=False)
    build_seconds += time.perf_counter() - start
    return Path(built)


class Library:
    """The built library (ctypes) and the kernels on tensors: pack a weight, y = x W^T + bias."""

    def __init__(self, path: str | os.PathLike):
        lib = ctypes.CDLL(str(path))
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        for name in ("db_kernel_panel", "db_kernel_rows"):
            getattr(lib, name).restype = i64
        # The bfloat16 kernels are in an AVX-512 build only.
        suffixes = ("f32", "bf16") if hasattr(lib, "db_linear_bf16") else ("f32",)
        kinds = {"pack": [ptr, i64, i64, ptr], "linear": [ptr, i64, i64, ptr, ptr, i64, ptr],
                 "linear_best": [ptr, i64, i64, ptr, ptr, i64, ptr, ptr, ptr],
                 "rmsnorm": [ptr, i64, i64, ptr, ctypes.c_float, ptr],
                 "rotary": [ptr, ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr]}
        for kind, argtypes in kinds.items():
            for suffix in suffixes:
                getattr(lib, f"db_{kind}_{suffix}").argtypes = argtypes
                getattr(lib, f"db_{kind}_{suffix}").restype = None
        for suffix in ("f32", "bf16"):  # in every build: they read bfloat16 bits as float32, never compute in it
            getattr(lib, f"db_top_k_{suffix}").argtypes = [ptr, i64, i64, ptr, i64, i64, i64, i64, ptr]
            getattr(lib, f"db_top_k_{suffix}").restype = i64
        self._top_k = {torch.float32: lib.db_top_k_f32, torch.bfloat16: lib.db_top_k_bf16}
        self.path, self.lib = Path(path), lib
        by_suffix = {"f32": torch.float32, "bf16": torch.bfloat16}
        self.dtypes = [by_suffix[x] for x in suffixes]  # what this build computes
        self.rmsnorm = {by_suffix[x]: getattr(lib, f"db_rmsnorm_{x}") for x in suffixes}
        self.rotary = {by_suffix[x]: getattr(lib, f"db_rotary_{x}") for x in suffixes}
        # Gemma's formula (a float32 weight): float32's own kernel, and a bfloat16 one that rounds once
        self.rmsnorm_f32_weight = {torch.float32: lib.db_rmsnorm_f32}
        if "bf16" in suffixes:
            lib.db_rmsnorm_f32w_bf16.argtypes, lib.db_rmsnorm_f32w_bf16.restype = kinds["rmsnorm"], None
            self.rmsnorm_f32_weight[torch.bfloat16] = lib.db_rmsnorm_f32w_bf16
        self.panel, self.rows = lib.db_kernel_panel(), lib.db_kernel_rows()  # output columns a panel, rows a block
        self._f32, self._bf16 = lib.db_linear_f32, getattr(lib, "db_linear_bf16", None)
        self.best = {by_suffix[x]: getattr(lib, f"db_linear_best_{x}") for x in suffixes}

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """A (n, k) CPU weight in column panels: float32 (ceil(n/panel), k, panel), bfloat16
        (ceil(n/panel), ceil(k/2), panel, 2); zero-padded, a plain tensor."""
        w = weight.detach().contiguous()
        n, k = w.shape
        p = -(-n // self.panel)
        if w.dtype == torch.float32:
            out = torch.zeros(p, k, self.panel, dtype=w.dtype)
            self.lib.db_pack_f32(w.data_ptr(), n, k, out.data_ptr())
        elif w.dtype == torch.bfloat16 and w.dtype in self.dtypes:
            out = torch.zeros(p, -(-k // 2), self.panel, 2, dtype=w.dtype)
            self.lib.db_pack_bf16(w.data_ptr(), n, k, out.data_ptr())
        else:
            raise TypeError(f"this build of the kernel packs {' and '.join(map(str, self.dtypes))} weights, "
                            f"not {w.dtype}")
        return out

    def linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int, best: bool = False
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (..., k) @ W^T + bias for W (n, k) packed by pack(); x, bias in W's dtype, on the CPU. best: also
        each output row's largest value per panel (float32) and its column in the panel (int32), both
        (..., ceil(n / panel)): numpy's argmax within the panel (kernels.cpp panel_best)."""
        k = x.shape[-1]
        f32 = packed.dtype == torch.float32
        if (x.dtype != packed.dtype or packed.shape[0] != -(-n // self.panel)
                or packed.shape[1] != (k if f32 else -(-k // 2))):
            raise ValueError(f"input {tuple(x.shape)} {x.dtype} does not fit the packed weight "
                             f"{tuple(packed.shape)} {packed.dtype} of {n} outputs")
        if bias is not None and (bias.dtype != x.dtype or bias.numel() != n):
            raise ValueError(f"bias {tuple(bias.shape)} {bias.dtype} for {n} outputs in {x.dtype}")
        x2 = x.reshape(-1, k)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        out = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
        if bias is not None and not bias.is_contiguous():
            bias = bias.contiguous()
        args = (x2.data_ptr(), x2.shape[0], k, packed.data_ptr(), bias.data_ptr() if bias is not None else None, n,
                out.data_ptr())
        if not best:
            (self._f32 if f32 else self._bf16)(*args)
            return out
        values, where = self.panel_maxima(x.shape[:-1], n)
        self.best[x.dtype](*args, values.data_ptr(), where.data_ptr())
        return out, values, where

    def top_k(self, rows: torch.Tensor, maxima: torch.Tensor, panel: int, k: int) -> torch.Tensor | None:
        """(n, V) logits rows, their (n, ceil(V / panel)) panel maxima -> (n, k) each row's k largest values'
        ids, largest first (kernels.cpp top_k: torch.topk's values; ids among equal values may differ from
        its). None where this cannot answer: a NaN in a row (torch.topk's order of NaNs decides), a dtype
        or shape it does not take."""
        n, V = rows.shape
        if (rows.dtype not in self._top_k or rows.stride(1) != 1 or not 1 <= k <= 64 or not 1 <= panel <= 64
                or maxima.dtype != torch.float32 or maxima.shape != (n, -(-V // panel)) or maxima.shape[1] < k):
            return None
        maxima = maxima.contiguous()
        top = torch.empty(n, k, dtype=torch.long)
        nan_rows = self._top_k[rows.dtype](maxima.data_ptr(), n, maxima.shape[1], rows.data_ptr(), rows.stride(0),
                                           V, panel, k, top.data_ptr())
        return None if nan_rows else top

    def panel_maxima(self, rows: tuple[int, ...], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Empty (rows..., panels) float32 and int32 tensors for linear(best=True) over n outputs."""
        p = -(-n // self.panel)
        return torch.empty(*rows, p), torch.empty(*rows, p, dtype=torch.int32)


def extension() -> Library:
    """The loaded extension, or RuntimeError with one line saying why not (remembered for this process)."""
    global _lib, _why_not
    if _lib is None and _why_not is None:
        try:
            built_for = isa()
            lib = Library(_build(built_for))
            if lib.panel != PANEL[built_for]:
                raise RuntimeError(f"the library's panel is {lib.panel} columns, not {PANEL[built_for]}")
            _lib = lib
        except Exception as e:  # noqa: BLE001 -- a compiler's error, missing ninja, a bad cache: one line
            text = str(e).strip().splitlines()
            _why_not = (f"the kernel extension did not build or load ({type(e).__name__}"
                        f"{': ' + text[0][:200] if text else ''})")
    if _lib is None:
        raise RuntimeError(_why_not)
    return _lib


@contextlib.contextmanager
def using(library: Library):
    """Every kernel call in this process goes to `library` (another build of kernels.cpp with the same panel:
    scripts/bench_linear_kernels.py's variants) until the block ends, for an A/B of whole forwards in one
    process. Weights stay packed as they are, so the panel must match."""
    global _lib
    previous = extension()
    if library.panel != previous.panel:
        raise ValueError(f"{library.path.name} packs {library.panel}-column panels; this process's {previous.panel}")
    _lib = library
    try:
        yield library
    finally:
        _lib = previous


def dtype_supported(dtype: torch.dtype) -> str | None:
    """None if the kernel runs `dtype` on this machine (building the extension if need be), else why not."""
    why_not = missing_instructions(dtype)
    if why_not:
        return why_not
    try:
        w = torch.arange(1, 2 * 37 + 1, dtype=torch.float32).reshape(2, 37).to(dtype)  # an odd K, 2 of 32 columns
        out = linear(torch.ones(3, 37, dtype=dtype), pack(w), torch.ones(2, dtype=dtype), 2)
        if out.shape != (3, 2) or not torch.equal(out, (w.float().sum(1) + 1).to(dtype).expand(3, 2)):
            return "the kernel gave a wrong result on a probe"
    except RuntimeError as e:
        return str(e).splitlines()[0] if str(e) else "the kernel extension failed"
    return None


def kernel_supported(model: nn.Module) -> str | None:
    """None if the kernel path runs `model` here, else why not, in one line."""
    ref = model.get_input_embeddings().weight
    if ref.device.type != "cpu":
        return f"the kernel path is CPU only; this model is on {ref.device.type}"
    return dtype_supported(ref.dtype)


# ---- the kernels on tensors ------------------------------------------------------------------------
def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` in the kernel's column panels (Library.pack), building the extension if need be."""
    return extension().pack(weight)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int, best: bool = False):
    """x (..., k) @ W^T + bias for W (n, k) packed by pack() (Library.linear, with its `best`); the extension
    is loaded."""
    return _lib.linear(x, packed, bias, n, best)


# Packed copies by (address, dtype), for kernel_linear: a compiled graph calls it with the weight.
_PACKED: dict[tuple[int, torch.dtype], torch.Tensor] = {}


def _register(weight: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    key = (weight.data_ptr(), weight.dtype)
    _PACKED[key] = packed
    weakref.finalize(weight, _PACKED.pop, key, None)  # a later tensor at the same address must not find it
    return packed


@torch.library.custom_op("decoding_bench::kernel_linear", mutates_args=())
def kernel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    packed = _PACKED.get((weight.data_ptr(), weight.dtype))
    if packed is None:
        packed = _register(weight, pack(weight))
    return linear(x, packed, bias, weight.shape[0])


@kernel_linear.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


class KernelLinear(nn.Linear):
    """An nn.Linear (its class swapped) computing inputs of 1..MAX_ROWS rows with the kernel, on a
    packed copy of its weight rebuilt when the weight changes (training, .to()). A model's readout
    (keep_panel_maxima) also leaves each row's panel maxima in `last_maxima`: (output, values, where, panel)."""

    def _pack(self) -> torch.Tensor:
        """The packed copy of the weight as it is now (repacked if its address, dtype or version changed)."""
        weight = self.weight
        try:
            version = weight._version
        except RuntimeError:  # an inference tensor cannot change in place
            version = 0
        key = (weight.data_ptr(), weight.dtype, version)
        if self.__dict__.get("_kernel_key") != key:
            self._kernel_packed = _register(weight, pack(weight))
            self._kernel_key = key
        return self._kernel_packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The hot path of every linear layer in a decode step (about nn.Linear's own cost in Python):
        # checks that allocate nothing, then one call into the library, whose shape checks hold here.
        # The parameters straight from their dict: nn.Module's attribute lookup costs 0.6 us each.
        params = self.__dict__["_parameters"]
        weight = params["weight"] if "weight" in params else self.weight
        bias = params["bias"] if "bias" in params else self.bias
        shape, dtype = x.shape, x.dtype
        k = shape[-1]
        rows = x.numel() // k if k else 0
        if (not 0 < rows <= MAX_ROWS or dtype != weight.dtype or dtype not in _DTYPES or not x.is_cpu
                or k != weight.shape[1] or (bias is not None and bias.dtype != dtype)
                or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
            return F.linear(x, weight, bias)
        if torch.compiler.is_compiling():
            return kernel_linear(x, weight, bias)
        try:
            version = weight._version
        except RuntimeError:  # an inference tensor cannot change in place
            version = 0
        state = self.__dict__
        packed = (state["_kernel_packed"] if state.get("_kernel_key") == (weight.data_ptr(), dtype, version)
                  else self._pack())
        if not x.is_contiguous():
            x = x.contiguous()
        if bias is not None and not bias.is_contiguous():
            bias = bias.contiguous()
        n = weight.shape[0]
        out = torch.empty(*shape[:-1], n, dtype=dtype)
        args = (x.data_ptr(), rows, k, packed.data_ptr(), bias.data_ptr() if bias is not None else None, n,
                out.data_ptr())
        if state.get("keeps_maxima"):
            values, where = _lib.panel_maxima(shape[:-1], n)
            _lib.best[dtype](*args, values.data_ptr(), where.data_ptr())
            state["last_maxima"] = (out, values, where, _lib.panel)
        else:
            (_lib._f32 if dtype == torch.float32 else _lib._bf16)(*args)
        return out


def keep_panel_maxima(head: nn.Module | None) -> bool:
    """Let a model's readout (a KernelLinear) keep each row's panel maxima beside its logits, so that an
    argmax reads those, not the row (sampling.PanelMaxima); False where the readout is not on the kernel."""
    if type(head) is not KernelLinear:
        return False
    head.keeps_maxima = True
    return True


def panel_maxima_of(head: nn.Module | None, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """(values, where, panel) of the readout's last call, if `logits` is that call's output itself (a model
    that changes the readout's output after it, e.g. soft-capping, returns another tensor: None); given up
    either way."""
    last = head.__dict__.pop("last_maxima", None) if head is not None else None
    if last is None or last[0] is not logits:
        return None
    return last[1:]


_DTYPES: set[torch.dtype] = set()  # dtypes KernelLinear runs here (filled by swap, as each is probed)


class KernelRMSNorm:
    """Mixed into an RMSNorm class whose forward a probe found to be one of two formulas (swap makes
    `Kernel<its name>` from both, so isinstance still holds): Llama's, w * (x * rsqrt(mean(x^2) + eps)),
    or Gemma's, the same with (1 + w) in float32 (its weight stored as w - 1); the norm of a CPU input in
    the dtypes the probe agreed in, in one call into the library instead of transformers' seven or eight
    operations. Compiled graphs, autograd and anything else keep the class's own."""

    weight_offset = 0.0  # Gemma's formula: 1.0
    eps_attribute = "variance_epsilon"  # Gemma's norms call it eps
    kernel_dtypes: frozenset = frozenset()  # where the probe agreed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        dim = x.shape[-1]
        if (x.dtype != weight.dtype or x.dtype not in self.kernel_dtypes or not x.is_cpu or x.numel() == 0
                or weight.shape != (dim,) or torch.compiler.is_compiling()
                or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
            return super().forward(x)
        if not x.is_contiguous():
            x = x.contiguous()
        out = torch.empty_like(x)
        norm = _lib.rmsnorm_f32_weight[x.dtype] if self.weight_offset else _lib.rmsnorm[x.dtype]
        norm(x.data_ptr(), x.numel() // dim, dim, self._kernel_weight().data_ptr(), getattr(self, self.eps_attribute),
             out.data_ptr())
        return out

    def _kernel_weight(self) -> torch.Tensor:
        """The weight the formula multiplies by: w, or Gemma's 1 + w in float32 (made once per weight version)."""
        weight = self.weight
        if not self.weight_offset:
            return weight if weight.is_contiguous() else weight.contiguous()
        key = (weight.data_ptr(), weight._version)
        made = self.__dict__.get("_offset_weight")
        if made is None or made[0] != key:
            made = key, (self.weight_offset + weight.detach().float()).contiguous()
            self.__dict__["_offset_weight"] = made
        return made[1]


_NORMS: dict[type, type | None] = {}  # a norm class -> its Kernel class, or None where the probe refused it
# The formulas a norm class is probed for, in every dtype the kernel runs
_FORMULAS = ({"weight_offset": 0.0, "eps_attribute": "variance_epsilon"},
             {"weight_offset": 1.0, "eps_attribute": "eps"})


def _kernel_norm_class(cls: type) -> type | None:
    """`cls` with KernelRMSNorm's forward, if its own forward is one of _FORMULAS (a probe on random rows in
    each dtype the kernel runs must agree to the dtype's rounding), for the dtypes it agreed in; None where
    no formula agreed in any."""
    if cls not in _NORMS:
        _NORMS[cls] = None
        for formula in _FORMULAS:
            kernel = type(f"Kernel{cls.__name__}", (KernelRMSNorm, cls), dict(formula))
            agreed = set()
            for dtype in sorted(_DTYPES, key=str):
                try:
                    probe = cls(96, eps=1e-5).to(dtype)
                except TypeError:  # not constructed as these are: not known to be their formula
                    break
                if not hasattr(probe, formula["eps_attribute"]):
                    break
                with torch.no_grad():
                    probe.weight.copy_(torch.linspace(-2, 2, 96))
                    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(0)).to(dtype) * 3
                    want = probe(x)
                    kernel.kernel_dtypes = frozenset({dtype})
                    probe.__class__ = kernel
                    got = probe(x)
                if torch.allclose(got.float(), want.float(), rtol=2 * torch.finfo(dtype).eps, atol=1e-6):
                    agreed.add(dtype)
            if agreed:
                kernel.kernel_dtypes = frozenset(agreed)
                _NORMS[cls] = kernel
                break
    return _NORMS[cls]


# ---- rotary embeddings: transformers' apply_rotary_pos_emb, fused inside attention on the kernel path ----
_in_kernel_attention = threading.local()  # .on: inside a KernelAttention's forward (this thread)


def fused_rotary(q, k, cos, sin, original):
    """transformers' apply_rotary_pos_emb(q, k, cos, sin) in one call into the library (bitwise the same
    result), inside a KernelAttention's forward on the CPU in the kernel's dtypes; `original` elsewhere."""
    if getattr(_in_kernel_attention, "on", False) and q.dtype in _DTYPES and q.is_cpu:
        B, H, T, D = q.shape
        if (q.dtype == k.dtype == cos.dtype == sin.dtype and k.shape[0] == B and k.shape[2:] == (T, D)
                and cos.shape == sin.shape == (B, T, D) and cos.is_contiguous() and sin.is_contiguous()
                and q.stride(-1) == 1 and k.stride(-1) == 1 and D % 2 == 0
                and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))):
            q_out, k_out = torch.empty_like(q), torch.empty_like(k)  # the inputs' layouts, as torch's would be
            strides = (ctypes.c_int64 * 12)(*q.stride()[:3], *q_out.stride()[:3], *k.stride()[:3],
                                            *k_out.stride()[:3])
            _lib.rotary[q.dtype](q.data_ptr(), k.data_ptr(), B, H, k.shape[1], T, D, strides, cos.data_ptr(),
                                 sin.data_ptr(), q_out.data_ptr(), k_out.data_ptr())
            return q_out, k_out
    return original(q, k, cos, sin)


class KernelAttention:
    """Mixed into an attention class whose model module's apply_rotary_pos_emb is Llama's (swap makes
    `Kernel<its name>`): its forward marks the thread so that the module's rotary, replaced once by a
    dispatcher (fused_rotary), runs in the library. Other models' attention in the process is untouched."""

    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return super().forward(*args, **kwargs)
        was = getattr(_in_kernel_attention, "on", False)
        _in_kernel_attention.on = True
        try:
            return super().forward(*args, **kwargs)
        finally:
            _in_kernel_attention.on = was


_ROTARY: dict[str, bool] = {}  # a model module's name -> its rotary replaced by the dispatcher (False: refused)
_ATTENTIONS: dict[type, type] = {}


def _rotary_module(module_name: str) -> bool:
    """Replace `module_name`'s apply_rotary_pos_emb by the dispatcher, once, if the library's result is
    bitwise its own on random queries and keys in every dtype the kernel runs here."""
    if module_name not in _ROTARY:
        python_module = sys.modules.get(module_name)
        original = getattr(python_module, "apply_rotary_pos_emb", None)
        ok = callable(original)
        gen = torch.Generator().manual_seed(0)
        for dtype in _DTYPES if ok else ():
            q = torch.randn(2, 5, 3, 36, generator=gen).to(dtype).transpose(1, 2)  # (B, T, H, D) memory, as q's
            k = torch.randn(2, 5, 1, 36, generator=gen).to(dtype).transpose(1, 2)
            angle = torch.randn(2, 5, 36, generator=gen) * 5
            cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
            try:
                want = original(q, k, cos, sin)
            except (RuntimeError, ValueError, TypeError):  # another layout of cos / sin (GPT-OSS halves them)
                ok = False
                break
            _in_kernel_attention.on = True
            try:
                got = fused_rotary(q, k, cos, sin, lambda *a: (None, None))
            finally:
                _in_kernel_attention.on = False
            ok = ok and all(g is not None and torch.equal(g, w) for g, w in zip(got, want))
        if ok:
            def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, *, original=original):
                if unsqueeze_dim != 1 or torch.compiler.is_compiling():  # a graph traces transformers' own
                    return original(q, k, cos, sin, unsqueeze_dim)
                return fused_rotary(q, k, cos, sin, original)
            apply_rotary_pos_emb.original = original
            python_module.apply_rotary_pos_emb = apply_rotary_pos_emb
        _ROTARY[module_name] = ok
    return _ROTARY[module_name]


def _kernel_attention_class(cls: type) -> type | None:
    """`cls` with KernelAttention's forward, if its model module's rotary could be fused; else None."""
    if not _rotary_module(cls.__module__):
        return None
    if cls not in _ATTENTIONS:
        _ATTENTIONS[cls] = type(f"Kernel{cls.__name__}", (KernelAttention, cls), {})
    return _ATTENTIONS[cls]


def _is_attention(module: nn.Module) -> bool:
    return (type(module).__name__.endswith("Attention") and hasattr(module, "q_proj") and hasattr(module, "k_proj")
            and hasattr(sys.modules.get(type(module).__module__), "apply_rotary_pos_emb"))


def _is_rmsnorm(module: nn.Module) -> bool:
    return (type(module).__name__.endswith("RMSNorm") and any(hasattr(module, f["eps_attribute"]) for f in _FORMULAS)
            and isinstance(getattr(module, "weight", None), torch.Tensor) and module.weight.dim() == 1)


def swap(model: nn.Module) -> int:
    """Swap every plain nn.Linear of `model` whose dtype the kernel runs here to KernelLinear; returns
    the bytes of the packed copies made (modules already swapped, e.g. a self-draft's shared layers,
    cost nothing). Call kernel_supported first."""
    extra = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.device.type == "cpu":
            dtype = module.weight.dtype
            if dtype not in _DTYPES and dtype_supported(dtype) is None:
                _DTYPES.add(dtype)
            if dtype in _DTYPES:
                module.__class__ = KernelLinear
                extra += module._pack().numel() * module.weight.element_size()
    for module in model.modules():  # after the linears: the probe needs the dtypes found above
        if _is_rmsnorm(module) and not isinstance(module, KernelRMSNorm) and module.weight.device.type == "cpu":
            kernel = _kernel_norm_class(type(module))
            if kernel is not None:
                module.__class__ = kernel
        elif _is_attention(module) and not isinstance(module, KernelAttention) and _DTYPES:
            kernel = _kernel_attention_class(type(module))
            if kernel is not None:
                module.__class__ = kernel
    return extra


def unswap(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, (KernelRMSNorm, KernelAttention)):
            module.__class__ = type(module).__bases__[1]
            module.__dict__.pop("_offset_weight", None)
        if type(module) is KernelLinear:
            module.__class__ = nn.Linear
            _PACKED.pop((module.weight.data_ptr(), module.weight.dtype), None)
            for attr in ("_kernel_packed", "_kernel_key", "keeps_maxima", "last_maxima"):
                module.__dict__.pop(attr, None)
