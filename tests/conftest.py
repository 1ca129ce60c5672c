import os
from pathlib import Path

import pytest
import torch

from helpers import CACHE_DIR, DATA_DIR, smollm2

# Tests must see the data copies and the model cache the README's commands set up.
os.environ.setdefault("BENCH_DATA_DIR", str(DATA_DIR))
os.environ.setdefault("BENCH_CACHE_DIR", CACHE_DIR)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("WANDB_MODE", "offline")
# The models' model.compile default (auto) would compile the target in every CLI run of a real model,
# minutes each; the compiled path is tested in test_compile.py, its auto choice there too.
os.environ.setdefault("BENCH_COMPILE", "none")
# Under pytest-xdist each worker gets its share of the cores, and so do the CLI runs it starts
# (OMP_NUM_THREADS, which torch reads): two workers at two threads each on two cores spin
# against each other. Tests that set threads themselves still do.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, min(2, (os.cpu_count() or 1) // WORKERS))
if WORKERS > 1:  # one process (-n 0) keeps torch's default
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
    torch.set_num_threads(THREADS)

# Test files run whole on one xdist worker: SLURM's single-node cluster (one per machine: ports,
# daemons), and files whose module fixture is a costly run every worker would otherwise repeat.
# (A scheduler, not xdist_group marks: xdist 3.8 renames grouped tests through a node attribute
# pytest 9 no longer reads, so --dist loadgroup groups nothing.)
ONE_WORKER = {"test_slurm.py", "test_leaderboard.py"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Tests spread one by one over the workers, except ONE_WORKER's files, each sent whole."""
    from xdist.scheduler import LoadScopeScheduling

    class OneWorkerFiles(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            path = nodeid.split("::", 1)[0]
            return path if Path(path).name in ONE_WORKER else nodeid

    return OneWorkerFiles(config, log)


def pytest_collection_modifyitems(config, items):
    """`cuda` tests run where CUDA is; elsewhere each is skipped, saying why."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def data_dir():
    if not (DATA_DIR / "mt_bench" / "question.jsonl").is_file() or not (DATA_DIR / "gsm8k" / "test.jsonl").is_file():
        pytest.fail(f"MT-Bench/GSM8K copies not found under {DATA_DIR}; set BENCH_DATA_DIR to a directory holding "
                    "mt_bench/question.jsonl and gsm8k/{test,train}.jsonl")
    return DATA_DIR


@pytest.fixture(scope="session")
def smollm():
    """The real default model (SmolLM2-135M-Instruct, fp32, CPU), loaded once."""
    return smollm2()
