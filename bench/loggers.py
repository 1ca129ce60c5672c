"""Optional experiment logging (logger=wandb). Default logger=none logs nothing."""
from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import OmegaConf

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

    def start(self, cfg, run_dir) -> None:
        import wandb

        self._run = wandb.init(project=self.project, entity=self.entity, mode=self.mode, dir=str(run_dir),
                               tags=list(self.tags), config=OmegaConf.to_container(cfg, resolve=True),
                               name=f"{cfg.decoder.name}-{cfg.model.name}-{cfg.dataset.name}")

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
