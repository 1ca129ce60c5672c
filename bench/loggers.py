"""Optional experiment logging (logger=wandb). Default logger=none logs nothing."""
from __future__ import annotations

import netrc
import os
from dataclasses import dataclass, field
from urllib.parse import urlparse

from omegaconf import OmegaConf

from .errors import BenchError

MODES = ("offline", "online", "disabled")

# Per-record numbers worth a wandb chart.
_NUMERIC = ["new_tokens", "steps", "tokens_per_step", "latency_s", "ttft_s", "tokens_per_s", "acceptance_rate",
            "target_flops", "quality_score"]


@dataclass
class NoLogger:
    name: str = "none"

    def start(self, cfg, run_dir) -> None:
        pass

    def log_record(self, record: dict) -> None:
        pass

    def log_summary(self, summary) -> None:
        pass

    def finish(self) -> None:
        pass


@dataclass
class WandbLogger:
    """Weights & Biases. mode=offline (default) writes under the run directory and needs no
    network; `wandb sync` uploads later. mode=online needs a login."""

    name: str = "wandb"
    project: str = "decoding-bench"
    entity: str | None = None
    mode: str = "offline"
    tags: list = field(default_factory=list)
    _run: object = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"logger.mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode == "online" and not _logged_in():  # now, before the model loads; else wandb.init would prompt
            raise BenchError("logger.mode=online needs a wandb login (`wandb login`, or WANDB_API_KEY); "
                             "use logger.mode=offline and `wandb sync` the run directory later")

    def start(self, cfg, run_dir) -> None:
        import wandb

        try:
            self._run = wandb.init(project=self.project, entity=self.entity, mode=self.mode, dir=str(run_dir),
                                   tags=list(self.tags), config=OmegaConf.to_container(cfg, resolve=True),
                                   name=f"{cfg.decoder.name}-{cfg.model.name}-{cfg.dataset.name}")
        except Exception as e:  # wandb's own errors (network, a rejected key): one line, nothing run yet
            raise BenchError(f"logger=wandb (mode {self.mode}) could not start: {' '.join(str(e).split())[:300]}; "
                             "logger=none runs without it") from None

    def log_record(self, record: dict) -> None:
        if record.get("status") == "ok":
            self._run.log({k: record[k] for k in _NUMERIC if record.get(k) is not None})

    def log_summary(self, summary) -> None:
        import wandb

        self._run.log({"summary": wandb.Table(dataframe=summary.astype(str))})
        for key, value in summary.iloc[0].items():
            self._run.summary[key] = value

    def finish(self) -> None:
        if self._run is not None:
            self._run.finish()


def _logged_in() -> bool:
    """A wandb API key in the environment, or in ~/.netrc for the wandb host (what `wandb login` writes)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False
