"""Logits processing shared by every decoder: temperature, top-k, top-p.

The warpers are transformers' own, applied in generate()'s order, so our decoders and the
hf_* peers sample from the same distribution by construction.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from . import kernels


# Logits divided by a temperature below this overflow float32 (1e-300 made every row inf, then NaN):
# a temperature this small is greedy in all but name.
MIN_TEMPERATURE = 1e-6


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0

    def __post_init__(self):
        if not (self.temperature == 0 or self.temperature >= MIN_TEMPERATURE):
            raise ValueError(f"gen.temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, "
                             f"got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"gen.top_p must be in (0, 1], got {self.top_p}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"gen.top_k must be an integer >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def warpers(self) -> LogitsProcessorList:
        warpers = LogitsProcessorList()
        if self.greedy:
            return warpers
        if self.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k > 0:
            warpers.append(TopKLogitsWarper(self.top_k))
        if self.top_p < 1.0:
            warpers.append(TopPLogitsWarper(self.top_p))
        return warpers

    def generator(self, device) -> torch.Generator | None:
        """A fresh RNG seeded from `seed` (None when greedy: nothing is drawn)."""
        if self.greedy:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)


class NonFiniteLogits(ValueError):
    """Logits that hold NaN or inf where a token is read from them: broken weights (every token would
    be 0 and every output "lossless"), or a dtype that overflowed. `step`: the generation's step, where
    the caller knows it (0: the prefill)."""

    def __init__(self, value: float, step: int | None = None):
        self.value, self.step = value, step
        where = "" if step is None else f" at step {step} (0: the prefill)"
        super().__init__(f"logits are not finite ({value}){where}")


def _finite(values) -> None:
    """argmax and max both land on a NaN or +inf wherever a row holds one (and a row all -inf has
    nothing else), so the chosen entries' values tell whether the rows were finite: no extra pass
    over the vocabulary, and on a GPU no extra read."""
    for value in values:
        if not math.isfinite(value):
            raise NonFiniteLogits(value)


@dataclass(frozen=True)
class PanelMaxima:
    """Each logits row's largest value per panel of `panel` columns and its column in the panel, as the
    kernel readout wrote them beside the row (kernels.keep_panel_maxima): values (..., P) float32, where
    (..., P) int32, P = ceil(V / panel). A row's argmax reads these, then nothing of the row: a 262,144-token
    row is 1 MB, 17-77 us to scan (warm or not), its maxima 1/32 of it."""

    values: torch.Tensor
    where: torch.Tensor
    panel: int

    def __getitem__(self, rows) -> "PanelMaxima":
        return PanelMaxima(self.values[rows], self.where[rows], self.panel)

    @functools.cached_property
    def _arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """values and where as numpy (rows, P): views, made once."""
        width = self.values.shape[-1]
        return self.values.numpy().reshape(-1, width), self.where.numpy().reshape(-1, width)

    def argmax(self, start: int = 0, stop: int | None = None):
        """argmax() of the rows these maxima are of (of rows start:stop, of a 2-D PanelMaxima): numpy's
        argmax over a row's maxima is the first panel holding its first largest value (or first NaN),
        `where` the column in it."""
        if self.values.dim() == 1:
            return self.row_argmax(0)
        values, where = (a[start:stop] for a in self._arrays)
        panel = values.argmax(-1)
        rows = np.arange(len(values))
        _finite(values[rows, panel].tolist())
        index = panel * self.panel + where[rows, panel]
        return (index.reshape(self.values.shape[:-1]) if self.values.dim() > 2 else index).tolist()

    def row_argmax(self, i: int) -> int:
        """argmax() of row i alone (of a 2-D PanelMaxima): a few numpy scalar reads, no copies."""
        values, where = self._arrays
        row = values[i]
        panel = int(row.argmax())
        _finite((float(row[panel]),))
        return panel * self.panel + int(where[i, panel])


def argmax(logits: torch.Tensor, maxima: PanelMaxima | None = None):
    """Each row's largest entry's index (the first on ties, as torch.argmax and transformers), as Python
    ints: an int for a 1-D tensor, a list for 2-D; NonFiniteLogits where a row is not finite. On a CPU
    numpy finds it: torch's CPU argmax took 44 us for one 49,152-logit row against numpy's 4 (float32;
    other dtypes widen exactly to it first). `maxima`: the rows' panel maxima, read instead of the rows.
    On a GPU the chosen values come in the indices' read."""
    if logits.device.type != "cpu":
        return argmax_in_one_read(logits)
    if maxima is not None:
        return maxima.argmax()
    rows = logits.detach().to(torch.float32).numpy()
    if rows.ndim == 1:  # scalar reads: numpy's take_along_axis costs 10 us
        index = int(rows.argmax())
        _finite((float(rows[index]),))
        return index
    index = rows.argmax(-1)
    _finite(np.take_along_axis(rows, np.expand_dims(index, -1), -1).ravel().tolist())
    return index.tolist()


BLOCK = 256  # top_k_rows' block: its maxima are a 1/256 read of the rows, its candidates k blocks


def top_k_rows(rows: torch.Tensor, k: int, maxima: PanelMaxima | None = None) -> torch.Tensor:
    """(n, V) -> (n, k) each row's k largest tokens' ids, largest first: torch.topk's values exactly
    (ids may differ among equal values). On a CPU torch.topk over a 262,144-token row costs about
    1.5 ms a row; here each row's block maxima are taken first (one pass, as fast as a max; none where
    `maxima` holds them, its panels the blocks), and the top k tokens lie in the k blocks with the
    largest maxima: each of those blocks holds a value at least the k-th largest maximum, which every
    top-k value is at least. With `maxima` the kernel library does both in one call (kernels.cpp top_k:
    torch.topk over a tree's 31 rows of 8,192 maxima cost 0.17-0.3 ms on a 2-core Zen 4)."""
    n, V = rows.shape
    if maxima is not None and rows.device.type == "cpu":  # the kernel readout wrote them: its library is loaded
        ids = kernels.extension().top_k(rows, maxima.values, maxima.panel, k)
        if ids is not None:
            return ids
    block = maxima.panel if maxima is not None else BLOCK
    if rows.device.type != "cpu" or V % block or V < 16 * k * block:
        return torch.topk(rows, k).indices
    blocks = rows.reshape(n, V // block, block)  # (n, V/B, B)
    # (n, k) the blocks with the k largest maxima (a NaN anywhere: torch.topk's own order of NaNs decides)
    best = torch.topk(maxima.values if maxima is not None else blocks.amax(-1), k).indices
    candidates = blocks[torch.arange(n).unsqueeze(1), best]  # (n, k, B)
    order = torch.topk(candidates.reshape(n, k * block), k).indices  # (n, k) into the candidates
    return best.gather(1, order // block) * block + order % block


class ArgmaxRows:
    """The argmax of (n, V) `rows`, each row read when first asked for (rows[i], or a slice). On a CPU
    only the rows asked for are read: a tree's greedy walk reaches a few of its rows, and the argmax of
    all of them, each over the whole vocabulary, cost 0.2-0.6 ms a step. On a GPU every row at the first
    ask, kept: each read makes the host wait, and verification and a proposer's commit would each read.
    `top_k` > 0: each row's top_k tokens are wanted too (top()); `also`: a 1-D tensor whose values are wanted
    (also()): on a GPU both come in the same read. `maxima`: the rows' panel maxima, where the readout
    kept them: a row's argmax and top k read those first."""

    def __init__(self, rows: torch.Tensor, top_k: int = 0, also: torch.Tensor | None = None,
                 maxima: PanelMaxima | None = None):
        self.rows, self.top_k, self.also_rows = rows, min(top_k, rows.shape[-1]), also
        self.maxima = maxima
        self.on_host = rows.device.type == "cpu"
        self._all: list[int] | None = None
        self._top: list[list[int]] | None = None
        self._also: list[float] | None = None
        self._row: dict[int, int] = {}

    def _every_row(self) -> list[int]:
        if self._all is None:
            if self.on_host or not (self.top_k or self.also_rows is not None):
                self._all = argmax(self.rows, self.maxima)
                return self._all
            # One read: (n, 2 + top_k) the argmax, its logit (finite?), then the top tokens; then `also`
            # (float64 holds every id)
            index = torch.argmax(self.rows, -1, keepdim=True)
            table = torch.cat([index, top_k_rows(self.rows, self.top_k)], 1) if self.top_k else index
            chosen = self.rows.gather(-1, index).view(-1).double()
            cut, width = table.numel(), table.shape[1]
            also = [] if self.also_rows is None else [self.also_rows.to(table.device).double()]
            both = torch.cat([table.view(-1).double(), chosen, *also]).tolist()
            _finite(both[cut:cut + len(index)])
            ids, self._also = [int(v) for v in both[:cut]], both[cut + len(index):] if also else None
            read = [ids[i:i + width] for i in range(0, cut, width)]
            self._all = [row[0] for row in read]
            self._top = [row[1:] for row in read] if self.top_k else None
        return self._all

    def also(self) -> list[float]:
        """The values of `also` (a tree still on the device: loop.settled); on a GPU in the rows' read."""
        if self._also is None:
            if self.on_host:
                self._also = self.also_rows.tolist()
            else:
                self._every_row()
        return self._also

    def __getitem__(self, i: int) -> int:
        if not self.on_host:
            return self._every_row()[i]
        if i not in self._row:
            self._row[i] = self.maxima.row_argmax(i) if self.maxima is not None else argmax(self.rows[i])
        return self._row[i]

    def slice(self, start: int = 0, stop: int | None = None) -> list[int]:
        if not self.on_host:
            return self._every_row()[start:stop]
        return self.maxima.argmax(start, stop) if self.maxima is not None else argmax(self.rows[start:stop])

    def top(self) -> list[list[int]]:
        """Each row's top_k token ids, largest first (ties in topk's order)."""
        if self._top is None:
            if self.on_host:
                self._top = top_k_rows(self.rows, self.top_k, self.maxima).tolist()
            else:
                self._every_row()
        return self._top


def probs(logits: torch.Tensor, sampling: Sampling, warpers: LogitsProcessorList | None = None) -> torch.Tensor:
    """Rows of logits (n, V) -> rows of the sampling distribution (float32)."""
    warpers = sampling.warpers() if warpers is None else warpers
    scores = logits.float()
    if len(warpers):
        # The warpers ignore input_ids; an empty tensor keeps their signature happy.
        scores = warpers(scores.new_empty((scores.shape[0], 0), dtype=torch.long), scores)
    return torch.softmax(scores, dim=-1)


def argmax_in_one_read(logits: torch.Tensor):
    """argmax's way on a GPU, where each read makes the host wait: the indices and their values in one."""
    index = torch.argmax(logits, dim=-1, keepdim=True)
    read = torch.cat([index.reshape(-1).double(), logits.gather(-1, index).reshape(-1).double()]).tolist()
    n = len(read) // 2
    _finite(read[n:])
    return np.array(read[:n], dtype=np.int64).reshape(index.shape[:-1]).tolist()


def draw(p: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token drawn from the distribution `p` (V,); NonFiniteLogits where p is not one (logits that
    held NaN or inf). torch refuses such a p on a CPU; on a GPU the drawn token's probability comes in
    the token's read and says it."""
    if p.device.type == "cpu":
        try:
            return int(torch.multinomial(p, 1, generator=generator))
        except RuntimeError:
            bad = p[~torch.isfinite(p)]
            if len(bad):
                raise NonFiniteLogits(float(bad[0])) from None
            raise
    return draw_in_one_read(p, generator)


def draw_in_one_read(p: torch.Tensor, generator: torch.Generator | None) -> int:
    """draw's way on a GPU: the token and its probability in one read."""
    token = torch.multinomial(p, 1, generator=generator)
    index, chance = torch.cat([token.double(), p[token].double()]).tolist()
    _finite([chance])
    return int(index)


def next_token(logits_row: torch.Tensor, sampling: Sampling, generator: torch.Generator | None,
               warpers: LogitsProcessorList | None = None, maxima: PanelMaxima | None = None) -> int:
    """Greedy argmax (first index on ties, as transformers) or one sample. `maxima`: the row's panel maxima."""
    if sampling.greedy:
        return argmax(logits_row, maxima)
    return draw(probs(logits_row[None], sampling, warpers)[0], generator)


class Sampler:
    """One generation's draws: its settings, their warpers, and the one seeded generator that every
    draw takes from (drafts and verification alike, in the order they happen)."""

    def __init__(self, sampling: Sampling, device):
        self.sampling = sampling
        self.greedy = sampling.greedy
        self.warpers = sampling.warpers()
        self.generator = sampling.generator(device)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return probs(logits, self.sampling, self.warpers)

    def next_token(self, logits_row: torch.Tensor) -> int:
        return next_token(logits_row, self.sampling, self.generator, self.warpers)
