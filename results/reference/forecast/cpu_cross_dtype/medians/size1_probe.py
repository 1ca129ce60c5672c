"""The probe quoted in ../README.md: inductor's graphs for one new token and for several (SmolLM2,
bfloat16, our kernel path, 2 threads). Run from the repository root:

    python results/reference/forecast/cpu_cross_dtype/medians/size1_probe.py

Prints the compile's seconds, the median ms of the autoregressive step (0) and of a masked forward
of k = 1..8 new tokens after 256 cached (decoders.tuning.profile.forward_samples), and how many
graphs dynamo built."""
import statistics
import sys
from pathlib import Path

import torch
import torch._dynamo.utils as dynamo_utils
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

sys.path.insert(0, ".")
from decoders.tuning.profile import forward_samples  # noqa: E402

torch.set_num_threads(2)
with initialize_config_dir(config_dir=str(Path("conf").resolve()), version_base="1.3"):
    cfg = compose("config", overrides=["dtype=bfloat16", "threads=2"])
lm = instantiate(cfg.model, fast_path="kernel", compile="none").load()
lm.set_fast_path("kernel")
print("compile", lm.set_compile("inductor"), f"{lm.compile_seconds:.1f} s")
samples = forward_samples(lm, 8, 256, repeats=9, seed=1)
print({k: round(statistics.median(v) * 1e3, 1) for k, v in samples.items()})
print("unique graphs", dynamo_utils.counters["stats"]["unique_graphs"])
