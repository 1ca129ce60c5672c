"""The measurement quoted in README.md: SmolLM2-135M's forward on the kernel path, transformers' sdpa
against decoders/core/attention.py's grouped_sdpa, interleaved in one process (each round visits
both attentions and every size in a fresh random order). Run from the repository root:

    python results/reference/attention/probe.py DTYPE [inductor]

Eager: both attentions in one process, alternating per round. With `inductor` the graph is traced
with one attention, so that run times grouped_sdpa only (the other is a second process:
`BENCH_HF_SDPA=1 python ... DTYPE inductor`). Prints the median and IQR of the autoregressive step
(k=0, one token, no mask) and of a masked forward of k new tokens after 256 cached, in ms, and the
ratio to the autoregressive step."""
import os
import random
import statistics
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

sys.path.insert(0, ".")
from decoders.core import attention  # noqa: E402
from decoders.tuning.profile import forward_samples  # noqa: E402

dtype, compiled = sys.argv[1], "inductor" in sys.argv[2:]
torch.set_num_threads(2)
with initialize_config_dir(config_dir=str(Path("conf").resolve()), version_base="1.3"):
    cfg = compose("config", overrides=[f"dtype={dtype}", "threads=2"])
lm = instantiate(cfg.model, fast_path="kernel", compile="none").load()
lm.set_fast_path("kernel")
functions = {"transformers": sdpa_attention_forward, "grouped": attention.grouped_sdpa}
if compiled:
    name = "transformers" if os.environ.get("BENCH_HF_SDPA") else "grouped"
    functions = {name: functions[name]}
    AttentionInterface.register("sdpa", functions[name])
    print("compile", lm.set_compile("inductor"), f"{lm.compile_seconds:.1f} s", flush=True)
sizes = [0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
samples = {name: {k: [] for k in sizes} for name in functions}
rng = random.Random(0)
for round_ in range(21):
    for name in rng.sample(list(functions), len(functions)):
        AttentionInterface.register("sdpa", functions[name])
        got = forward_samples(lm, 32, 256, repeats=1, seed=round_)
        for k in sizes:
            samples[name][k] += got[k]
print(f"{torch.__version__}, {dtype}, kernel path, {'inductor' if compiled else 'eager'}, 2 threads, 256 cached")
for name, by_k in samples.items():
    step = statistics.quantiles(by_k[0], n=4)[1]
    row = []
    for k in sizes:
        q1, med, q3 = statistics.quantiles(by_k[k], n=4)
        row.append(f"{k}: {med * 1e3:.1f} ({(q3 - q1) * 1e3:.1f}) {med / step:.2f}")
    print(f"{name:>12}  " + " | ".join(row), flush=True)
