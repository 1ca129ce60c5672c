"""Drafts and heads published by their authors, read in the layouts they publish (a local directory
or a hub id holding config.json and the weights); each is checked against the target first.

- EAGLE-1/2 (SafeAILab/EAGLE, `cnets1.py`; `eagle.model.cnets` in eagle-llm 1.2): `fc` (2d -> d,
  bias unless config `bias` is false) over [embedding(token t+1), features t], then Llama decoder
  layers whose first has no input norm. Its features are the target's last hidden state *after*
  the final norm, and the target's head reads the draft's output directly (no norm between).
- EAGLE-3 (`cnets.py`): the target's features are the inputs of its layers 2, L // 2 and L - 3,
  concatenated (low, mid, high) and fused by `fc` (3d -> d, no bias). One layer: `hidden_norm` of
  the features and `input_layernorm` of the embedding, concatenated [embedding, features] (2d) into
  the attention; the residual is the fused features. Its own `norm` and `lm_head` read a draft
  vocabulary; draft id i is target id i + d2t[i]. A drafted node feeds back the layer's output
  (already d wide: no `fc`).
- Medusa-1 (FasterDecoding/Medusa, `medusa_model.py`): `medusa_lm_head.safetensors` or `.pt`; head i
  is `medusa_num_layers` ResBlocks (h + SiLU(W h + b)) then its own Linear(d, V) (`{i}.{layers}.weight`);
  older files without it use the target's head. The heads read the last hidden state (after the
  final norm), as ours do.

The embedding is the file's `embed_tokens` where it has one (a copy of the target's), else the
target's. How drafts become trees stays in eagle.py's proposer; heads' trees in medusa.py.

An EAGLE-3 draft trained here (`scripts/train_eagle.py --layout eagle3`: `new_eagle3`, `save_eagle3`)
is written in the authors' layout (a directory: config.json, model.safetensors with d2t and t2d)
and loads as theirs do; the safetensors metadata `info` adds what the training measured (read
back into `draft.info`: its held-out accuracy by depth builds decoder.tree=static's tree).
"""
from __future__ import annotations

import json
import re
from functools import cached_property
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (LlamaDecoderLayer, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding,
                                                      apply_rotary_pos_emb)

from ..core.kv_cache import KVCache, cache_kwarg
from ..core.lm import LM, DraftCost, TargetParts
from ..core.weights_file import check_target, checkpoint_dir, load_state, read_config, read_state


class Float32Rotary(LlamaRotaryEmbedding):
    """LlamaRotaryEmbedding whose frequencies stay float32 when the draft is cast to half precision;
    its cos / sin are still rounded once, to the activations' dtype. The authors build their tables
    in float32 too: a float16 inv_freq put the draft's cos off by up to 0.23 at position 1000 and
    0.9 at 4000, which keeps the output lossless but lowers every published draft's acceptance."""

    def __init__(self, config: LlamaConfig):
        super().__init__(config=config)
        self._float32 = self.inv_freq.float().clone()  # a plain attribute (and no alias): casts leave it alone

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)  # moves and casts the buffers ...
        self._float32 = self._float32.to(self.inv_freq.device)
        self.inv_freq, self.original_inv_freq = self._float32, self._float32.clone()  # ... then undoes the cast
        return self


def _llama_config(config: dict, lm: LM) -> LlamaConfig:
    known = {k: v for k, v in config.items() if k not in ("architectures", "auto_map", "model_type", "torch_dtype")}
    cfg = LlamaConfig(**known)
    cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads  # as the authors' attention computes it
    cfg._attn_implementation = lm.attn_implementation
    return cfg


def _load(module: nn.Module, state: dict, key: str, where) -> None:
    load_state(module, state, key, where, "the layout its config.json describes")


def _embedding(module: nn.Module, lm: LM, state: dict, key: str, where) -> None:
    """The file's embed_tokens (checked against the target's vocabulary) or the target's own."""
    if "embed_tokens.weight" in state:
        check_target(lm, key, where, vocab=state["embed_tokens.weight"].shape[0])
        module.embed_tokens = nn.Embedding(*state["embed_tokens.weight"].shape)
    else:
        module.target.embedding = lm.model.get_input_embeddings()


class Eagle1Draft(nn.Module):
    """EAGLE-1/2's published draft, read by FeatureDraftProposer like our FeatureDraft."""

    reads = True  # the final norm's input; from_target applies the norm (EAGLE-1/2 read the normed state)

    def __init__(self, lm: LM, config: dict, state: dict, where):
        super().__init__()
        cfg = _llama_config(config, lm)
        d = cfg.hidden_size
        self.target = TargetParts(lm)  # not submodules: neither loaded nor moved
        _embedding(self, lm, state, "decoder.draft_weights", where)
        self.fc = nn.Linear(2 * d, d, bias=bool(config.get("bias", True)))
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, layer_idx=i) for i in range(cfg.num_hidden_layers))
        self.layers[0].input_layernorm = nn.Identity()  # absent in the published layer 0
        _load(self, state, "decoder.draft_weights", where)
        self.rotary = Float32Rotary(cfg)
        self.vocab = torch.arange(lm.vocab_size)
        self.info: dict = {}
        self.dense_params = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def readout(self) -> nn.Module:
        return self.target.lm.model.get_output_embeddings()

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return (self.embed_tokens if hasattr(self, "embed_tokens") else self.target.embedding)(tokens)

    def from_target(self, features: torch.Tensor) -> torch.Tensor:
        return self.target.lm.final_norm(features)

    def forward(self, features, tokens, positions, mask, cache: KVCache | None = None) -> torch.Tensor:
        batched = features.dim() == 3
        if not batched:
            features, tokens = features[None], tokens[None]
        x = self.fc(torch.cat([self.embed(tokens).to(features.dtype), features], -1))  # embedding first
        pos = positions.reshape(1, -1).to(x.device)
        rope, mask4 = self.rotary(x, pos), self.target.lm.mask_4d(mask)
        for layer in self.layers:
            out = layer(x, attention_mask=mask4, position_ids=pos, position_embeddings=rope,
                        use_cache=cache is not None, **{cache_kwarg(layer): cache.hf if cache is not None else None})
            x = out[0] if isinstance(out, tuple) else out
        return x if batched else x[0]

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        # no norm: the draft predicts the normed state; the head is the target's (its dtype)
        return self.target.lm.cap_logits(self.readout(features.to(self.readout.weight.dtype)))

    @cached_property
    def flops(self) -> DraftCost:
        return DraftCost.of(self.dense_params, self.layers[0].self_attn.o_proj.weight.shape[1] * len(self.layers),
                         self.readout.weight.numel())

    def accuracy(self):
        return None


class _WideAttention(nn.Module):
    """EAGLE-3's attention: queries, keys and values from the 2d-wide [embedding, features]."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(2 * d, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * d, cfg.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(2 * d, cfg.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, d, bias=False)
        self.head_dim = hd

    def forward(self, x, rope, mask, cache: KVCache | None):
        b, q, _ = x.shape
        qs, ks, vs = (p(x).view(b, q, -1, self.head_dim).transpose(1, 2)
                      for p in (self.q_proj, self.k_proj, self.v_proj))
        qs, ks = apply_rotary_pos_emb(qs, ks, *rope)
        if cache is not None:
            ks, vs = cache.hf.update(ks, vs, 0)
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask.to(x.device), enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, q, -1))


def eagle3_reads(lm: LM) -> tuple[int, int, int]:
    """The target layers whose inputs an EAGLE-3 draft fuses (low, mid, high: ea_model.py's 2, L // 2,
    L - 3); a ValueError where the target has too few layers for three distinct ones."""
    layers = lm.config.get_text_config().num_hidden_layers
    reads = (2, layers // 2, layers - 3)
    if len(set(reads)) < 3 or layers - 3 < 0:
        raise ValueError(f"an EAGLE-3 draft reads the inputs of the target's layers 2, L/2 and L-3; "
                         f"{lm.name} has {layers} layers (at least 7 are needed)")
    return reads


class Eagle3Draft(nn.Module):
    """EAGLE-3's published draft, read by FeatureDraftProposer like our FeatureDraft; `state=None`
    builds a new one (`new_eagle3`) over the draft vocabulary `vocab`."""

    def __init__(self, lm: LM, config: dict, state: dict | None, where, vocab: Sequence[int] | None = None):
        super().__init__()
        cfg = _llama_config(config, lm)
        d = cfg.hidden_size
        try:
            self.reads = eagle3_reads(lm)
        except ValueError as e:
            raise ValueError(f"decoder.draft_weights: {where}: {e}") from None
        self.target = TargetParts(lm)
        _embedding(self, lm, state or {}, "decoder.draft_weights", where)
        target_hidden = int(config.get("target_hidden_size", d))
        self.fc = nn.Linear(3 * target_hidden, d, bias=False)
        self.midlayer = nn.Module()
        self.midlayer.self_attn = _WideAttention(cfg)
        self.midlayer.mlp = LlamaMLP(cfg)
        for name in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
            setattr(self.midlayer, name, LlamaRMSNorm(d, eps=cfg.rms_norm_eps))
        self.norm = LlamaRMSNorm(d, eps=cfg.rms_norm_eps)
        draft_vocab = int(config.get("draft_vocab_size", cfg.vocab_size))
        self.lm_head = nn.Linear(d, draft_vocab, bias=False)
        if state is None:  # new: torch's own initialisation (the authors' too), the draft vocabulary given
            ids = torch.as_tensor(list(vocab) if vocab is not None else range(draft_vocab), dtype=torch.long)
            d2t = ids - torch.arange(len(ids))
        else:
            d2t = state.pop("d2t", torch.zeros(draft_vocab, dtype=torch.long))  # absent when the vocabularies agree
            state.pop("t2d", None)  # its inverse (a membership mask): not needed to draft
            _load(self, state, "decoder.draft_weights", where)
        self.vocab = torch.arange(draft_vocab) + d2t.long().cpu()
        if len(d2t) != draft_vocab or int(self.vocab.min()) < 0 or int(self.vocab.max()) >= lm.vocab_size:
            raise ValueError(f"decoder.draft_weights: {where}: its d2t maps {draft_vocab} draft ids "
                             f"outside the target's vocabulary of {lm.vocab_size}")
        self.rotary = Float32Rotary(cfg)
        self.info: dict = {}
        self.dense_params = sum(m.weight.numel() for m in self.midlayer.modules() if isinstance(m, nn.Linear))

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def readout(self) -> nn.Module:
        return self.lm_head

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return (self.embed_tokens if hasattr(self, "embed_tokens") else self.target.embedding)(tokens)

    def from_target(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc(features)  # low, mid, high (3d) -> d

    def forward(self, features, tokens, positions, mask, cache: KVCache | None = None) -> torch.Tensor:
        batched = features.dim() == 3
        if not batched:
            features, tokens = features[None], tokens[None]
        m = self.midlayer
        x = torch.cat([m.input_layernorm(self.embed(tokens).to(features.dtype)), m.hidden_norm(features)], -1)
        pos = positions.reshape(1, -1).to(x.device)
        h = features + m.self_attn(x, self.rotary(x, pos), mask, cache)
        h = h + m.mlp(m.post_attention_layernorm(h))
        return h if batched else h[0]

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return self.target.lm.cap_logits(self.lm_head(self.norm(features)))

    @cached_property
    def flops(self) -> DraftCost:
        # fc is charged on every row, though drafted rows skip it: a bound, and fc is one of six matmuls
        return DraftCost.of(self.dense_params + self.fc.weight.numel(), self.midlayer.self_attn.o_proj.weight.shape[1],
                         self.lm_head.weight.numel())

    def accuracy(self) -> list[list[float]] | None:
        """acc[j][r] measured on held-out text, for a draft trained here (a published one: None)."""
        return self.info.get("accuracy")


def eagle3_config(lm: LM, draft_vocab: int, base: str) -> dict:
    """config.json of an EAGLE-3 draft for `lm`, as the authors write theirs: the target's own
    settings for one decoder layer, its vocabulary and the draft's; `base` names the target."""
    cfg = lm.config.get_text_config()
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    if isinstance(rope.get("full_attention"), dict):  # one table per layer type (Gemma 3): the draft attends fully
        rope = dict(rope["full_attention"])
    theta = rope.pop("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    act = getattr(cfg, "hidden_act", None) or cfg.hidden_activation  # Gemma's configs name it hidden_activation
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": cfg.hidden_size,
              "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_attention_heads,
              "num_key_value_heads": cfg.num_key_value_heads, "num_hidden_layers": 1, "hidden_act": act,
              "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": theta,
              "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": lm.vocab_size,
              "draft_vocab_size": draft_vocab, "target_hidden_size": cfg.hidden_size, "torch_dtype": "float16",
              "base_model_name_or_path": base}
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = rope
    return config


def new_eagle3(lm: LM, vocab: Sequence[int] | None = None) -> Eagle3Draft:
    """An untrained EAGLE-3 draft for `lm` over the draft vocabulary `vocab` (ascending target ids;
    None: the whole vocabulary), for scripts/train_eagle.py --layout eagle3: fc, midlayer and fresh
    weights as torch initialises them (as the authors' traineagle3/cnets.py does), except the output
    norm and lm_head, which start as the target's final norm and its head's rows over `vocab` (the
    authors start lm_head at random; on a CPU budget of steps the target's own readout is a nearer
    start). Everything it stores is trained; the embedding stays the target's."""
    size = len(vocab) if vocab is not None else lm.vocab_size
    draft = Eagle3Draft(lm, eagle3_config(lm, size, lm.name), None, "a new draft", vocab)
    head = lm.model.get_output_embeddings()
    norm = lm.final_norm
    with torch.no_grad():
        # The gain the target's final norm applies (to ones, whose RMS is 1 up to eps): its weight for
        # Llama's RMSNorm, 1 + weight for Gemma's; taken exactly where it is one of those.
        gain = norm(torch.ones(norm.weight.shape, dtype=norm.weight.dtype, device=norm.weight.device))
        exact = [w for w in (norm.weight, 1 + norm.weight) if torch.allclose(gain, w, rtol=1e-4)]
        draft.norm.weight.copy_(exact[0] if exact else gain)
        draft.lm_head.weight.copy_(head.weight[draft.vocab.to(head.weight.device)])
    draft.info = {"layout": "eagle3"}
    draft.requires_grad_(False)  # trained only by scripts/train_eagle.py, which turns this back on
    return draft.to(device=lm.output_device, dtype=lm.dtype).eval()


def save_eagle3(draft: Eagle3Draft, directory: str | Path, info: dict, base: str) -> Path:
    """`directory`/config.json and model.safetensors in the authors' layout (what `load_eagle` and
    their own loader read): float16 weights, d2t (draft id -> target id offset) and t2d (the
    target ids in the draft vocabulary); `info` (what training measured) in the file's metadata."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: (v.detach().to(torch.float16) if v.is_floating_point() else v.detach()).cpu().contiguous()
             for k, v in draft.state_dict().items()}
    vocab = draft.vocab.cpu()
    state["d2t"] = vocab - torch.arange(len(vocab))
    state["t2d"] = torch.zeros(draft.target.lm.vocab_size, dtype=torch.bool).index_fill(0, vocab, True)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt", "info": json.dumps(info)})
    config = eagle3_config(draft.target.lm, len(vocab), base)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def _recorded_info(directory: Path) -> dict:
    """The `info` a draft trained here records in its model.safetensors (the file read: no
    pytorch_model.bin beside it); {} for a published one."""
    path = directory / "model.safetensors"
    if (directory / "pytorch_model.bin").is_file() or not path.is_file():
        return {}
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            info = json.loads((f.metadata() or {}).get("info", "{}"))
    except Exception:  # unreadable metadata: read_state has read the tensors; the info is an extra
        return {}
    return info if isinstance(info, dict) else {}


def load_eagle(lm: LM, name: str | Path, check_base: bool = True) -> nn.Module:
    """A published EAGLE-1/2 or EAGLE-3 draft, its layout told by its tensors."""
    key = "decoder.draft_weights"
    directory = checkpoint_dir(name, key, ["config.json", "pytorch_model.bin", "model.safetensors"])
    config = read_config(directory, key)
    state = read_state(directory, ["pytorch_model.bin", "model.safetensors"], key)  # the authors' order
    eagle3 = any(k.startswith("midlayer.") for k in state)
    if not eagle3 and not ("fc.weight" in state and any(k.startswith("layers.0.") for k in state)):
        raise ValueError(f"{key}: {directory} is neither an EAGLE-1/2 draft (fc, layers.0.*) nor an EAGLE-3 one "
                         f"(fc, midlayer.*)")
    hidden = config.get("target_hidden_size", config.get("hidden_size")) if eagle3 else config.get("hidden_size")
    check_target(lm, key, directory, vocab=config.get("vocab_size"), hidden=hidden,
                 base=config.get("base_model_name_or_path"), check_base=check_base)
    try:
        draft = (Eagle3Draft if eagle3 else Eagle1Draft)(lm, config, state, directory)
    except ValueError:  # the tensors against the layout (_load), already one line
        raise
    except Exception as e:  # config.json's values: a list for a size, a missing key, transformers' own checks
        raise ValueError(f"{key}: {directory / 'config.json'} does not describe a draft that can be built "
                         f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
    draft.info = {**_recorded_info(directory), "layout": "eagle3" if eagle3 else "eagle1", "source": str(name)}
    ref = lm.model.get_input_embeddings().weight
    draft.requires_grad_(False)
    return draft.to(device=ref.device, dtype=ref.dtype).eval()


_MEDUSA_KEY = re.compile(r"(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)")


def read_medusa(lm: LM, name: str | Path, check_base: bool = True) -> tuple[dict, str, dict]:
    """Published Medusa-1 heads, read and checked against `lm`: (their shape, as Heads takes it:
    k, layers, own_outputs; the directory; the tensors under Heads' names). The number of heads
    and blocks is read from the tensors: some published config.json files give fewer heads than
    their weights hold. decoders/methods/heads.py builds them."""
    key = "decoder.heads"
    directory = checkpoint_dir(name, key, ["config.json", "medusa_lm_head.safetensors", "medusa_lm_head.pt"])
    config = read_config(directory, key)
    state = read_state(directory, ["medusa_lm_head.safetensors", "medusa_lm_head.pt"], key)
    state = {k.removeprefix("medusa_head."): v for k, v in state.items()}
    bad = [k for k in state if not _MEDUSA_KEY.fullmatch(k)]
    if bad or "0.0.linear.weight" not in state:
        raise ValueError(f"{key}: {directory} is not a Medusa-1 head file (tensors {{head}}.{{block}}.linear.* and "
                         f"{{head}}.{{layers}}.weight; found {(bad or sorted(state))[0]!r})")
    k = 1 + max(int(_MEDUSA_KEY.fullmatch(x).group(1)) for x in state)
    layers = sum(1 for x in state if x.startswith("0.") and x.endswith(".linear.weight"))
    own = f"0.{layers}.weight" in state
    check_target(lm, key, directory, vocab=state[f"0.{layers}.weight"].shape[0] if own else None,
                 hidden=state["0.0.linear.weight"].shape[1], base=config.get("base_model_name_or_path"),
                 check_base=check_base)
    renamed = {}
    for x, v in state.items():
        i, j, part = _MEDUSA_KEY.fullmatch(x).groups()
        if part == "weight":
            renamed[f"outputs.{i}.weight"] = v
        else:
            renamed[f"blocks.{i}.{part}" if layers == 1 else f"blocks.{i}.{j}.{part}"] = v
    return {"k": k, "layers": layers, "own_outputs": own}, directory, renamed
