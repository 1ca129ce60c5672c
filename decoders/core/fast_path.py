"""The fast forward path (model.fast_path): linear layers on oneDNN-prepacked weights, CPU
(model.fast_path=kernel, our own kernel, lives in kernels.py).

The kernels are private torch ops: prepacked_supported probes them before use.
"""
from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F
from torch import nn


# ---- the fast forward path -------------------------------------------------------------
# On CPU, nn.Linear's default kernels make a k-row forward cost ~2x a 1-row one (k = 8..16, fp32)
# although both read the same weights once. oneDNN's prepacked weights (the kernels torch.compile's
# CPU freezing emits) are cheaper from a few rows up in fp32, and in bfloat16 (AMX) at every size,
# the 1-row step included. Where the packed kernel starts to win depends on the CPU (4 rows on a
# Sapphire Rapids Xeon, 1 row on a Zen 5 EPYC: results/reference/fast_path/README.md), so below
# `min_rows` the native kernel is kept; these are the defaults, and model.fast_path=auto measures it.
FAST_PATHS = ("none", "prepacked", "kernel")  # kernel: our own small-M kernel, decoders/core/kernels.py
PACKED_MIN_ROWS = {torch.float32: 4, torch.bfloat16: 1}


# Packed weights by (address, dtype), for the custom op below: inductor cannot lower the packed
# kernel, nor hold an opaque packed tensor, so a compiled graph calls an opaque op that finds the
# packed copy by its weight (model.compile; weights are fixed while compiled).
_PACKED: dict[tuple[int, torch.dtype], torch.Tensor] = {}


def _register(weight: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    key = (weight.data_ptr(), weight.dtype)
    _PACKED[key] = packed
    # Forgotten with its weight: a later tensor at the same address must not find this copy.
    weakref.finalize(weight, _PACKED.pop, key, None)
    return packed


@torch.library.custom_op("decoding_bench::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    packed = _PACKED.get((weight.data_ptr(), weight.dtype))
    if packed is None:
        packed = _register(weight, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None))
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


class PrepackedLinear(nn.Linear):
    """An nn.Linear (the same module, its class swapped: parameters, tying, hooks and sharing
    with self-drafts stay as they are) that keeps a oneDNN-packed copy of its weight for inputs
    of `_min_rows` rows or more. The copy is rebuilt when the weight changes (training, .to())."""

    _min_rows = 1 << 30  # set by prepack

    def _pack(self):
        # Called on every multi-row forward: the check allocates nothing; detach() only to repack.
        weight = self.weight
        try:
            version = weight._version
        except RuntimeError:  # an inference tensor (made under inference_mode) cannot change in place
            version = 0
        key = (weight.data_ptr(), weight.dtype, version)
        if self.__dict__.get("_packed_key") != key:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            self._packed_key = key
            _register(weight, self._packed)
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if (rows < self._min_rows or x.dtype != self.weight.dtype or linear_problem(x.dtype) is not None
                or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            return F.linear(x, self.weight, self.bias)
        if torch.compiler.is_compiling():
            return packed_linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._pack(), self.bias, "none", [], "")


def prepack(model: nn.Module, min_rows: int) -> int:
    """Swap every plain nn.Linear of `model` to PrepackedLinear, packed from `min_rows` rows up;
    returns the bytes of the packed copies it made (modules already swapped, e.g. shared with a
    self-draft's target, cost nothing but take the new threshold)."""
    extra = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = PrepackedLinear
            extra += module._pack().numel() * module.weight.element_size()
        if type(module) is PrepackedLinear:
            module._min_rows = min_rows
    return extra


def unpack(model: nn.Module) -> None:
    for module in model.modules():
        if type(module) is PrepackedLinear:
            module.__class__ = nn.Linear
            _PACKED.pop((module.weight.data_ptr(), module.weight.dtype), None)
            for attr in ("_packed", "_packed_key", "_min_rows"):
                module.__dict__.pop(attr, None)


def prepacked_supported(model: nn.Module) -> str | None:
    """None if the prepacked path runs here, else why not (private ops: checked, not assumed)."""
    ref = model.get_input_embeddings().weight
    if ref.device.type != "cpu":
        return f"prepacked linears are a CPU path; this model is on {ref.device.type}"
    return linear_problem(ref.dtype)


@functools.cache
def linear_problem(dtype: torch.dtype) -> str | None:
    """None if oneDNN's prepacked linear runs in `dtype` on this CPU, else why not (e.g. bfloat16 needs
    AVX-512 or AVX-NE-CONVERT: a Zen 3 has neither). Probed once per dtype and process."""
    if dtype not in (torch.float32, torch.bfloat16):
        return f"prepacked linears support float32 and bfloat16, not {str(dtype).replace('torch.', '')}"
    try:
        if not torch.backends.mkldnn.is_available():
            return "this torch build has no oneDNN (mkldnn)"
        probe = torch.ones(3, 4, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(probe, None)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 4, dtype=dtype), packed, None, "none", [], "")
        if out.shape != (2, 3) or not torch.allclose(out.float(), torch.full((2, 3), 4.0)):
            return "the oneDNN linear gave a wrong result on a probe"
    except (AttributeError, RuntimeError, NotImplementedError) as e:
        return f"the oneDNN linear ops are unavailable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return None
