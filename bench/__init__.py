"""The benchmark harness: Hydra entry, runner, models, datasets, metrics, reports."""
