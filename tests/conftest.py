import os
import subprocess
from pathlib import Path

import pytest
import torch

from bench.models import PretrainedModel
import helpers
from helpers import CACHE_DIR, DATA_DIR, gemma3_270m, smollm2

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
helpers.BASE_ENV = dict(os.environ)  # what every test starts from: run_python's fork server starts in it

@pytest.hookimpl(tryfirst=True)  # before pytest-xdist starts its workers: they find the library built
def pytest_sessionstart(session):
    """model.fast_path=kernel's extension (decoders/core/kernels.py) is built, once per machine (a few
    seconds of g++), before any test: a test that built it would start a compiler, which the slow-mark
    check below counts. Where it cannot build, test_kernels.py skips saying why and the path falls back.
    On an AVX-512 CPU the AVX2 build too: test_kernels.py runs it there with the CPU's flags less AVX-512's."""
    from decoders.core import kernels

    if kernels.dtype_supported(torch.float32) is None and kernels.isa() == "avx512":
        kernels._build("avx2")


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


# `slow` marks every test that starts a subprocess or loads a real model (SmolLM2, Gemma 3), so that
# `pytest -m "not slow"` is quick. The marks cannot drift: a test that asks for the `smollm` fixture
# is marked here, and one that starts a process or loads a model of SmolLM2's size otherwise (run_cli,
# a script, a run of the default model in-process, a module fixture doing either) fails unless marked.
# One exception: `cuda` tests (skipped where CUDA is not) may start processes unmarked, since the GPU
# check (scripts/gpu/check.sh) runs `-m "cuda and not slow"`: there `slow` keeps SmolLM2 out, which
# cannot travel to the GPU machine, and the CLI runs and training scripts on tiny-random are what it checks.
SLOW_FIXTURES = {"smollm", "gemma3"}
QUICK_TOOLS = {"git", "nvidia-smi", "uname"}  # bench/provenance.py's queries (uname: platform.platform()), ms each
REAL_MODEL_PARAMS = 100_000_000  # SmolLM2-135M has 135M; the suite's tiny models, thousands


@pytest.hookimpl(tryfirst=True)  # before -m selects by the marks
def pytest_collection_modifyitems(config, items):
    """Tests using SmolLM2's fixture are `slow`; `cuda` tests run where CUDA is, elsewhere each is
    skipped, saying why."""
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def _slow_work(item):
    """Runs a test phase, noting every process it starts (but QUICK_TOOLS; helpers.run_python's from the fork
    server too) and every real-sized model it loads; a test not marked `slow` that did either fails, saying what."""
    done = []
    popen_init, load = subprocess.Popen.__init__, PretrainedModel.load

    def noting_popen(self, args, *rest, **kwargs):
        program = args if isinstance(args, (str, bytes, os.PathLike)) else args[0]
        program = os.fsdecode(program).split()[0] if kwargs.get("shell") else os.fsdecode(program)
        if Path(program).name not in QUICK_TOOLS and "cuda" not in item.keywords:
            done.append(f"started {Path(program).name}")
        popen_init(self, args, *rest, **kwargs)

    def noting_load(spec, *args, **kwargs):
        lm = load(spec, *args, **kwargs)
        if sum(p.numel() for p in lm.model.parameters()) >= REAL_MODEL_PARAMS:
            done.append(f"loaded {spec.name} ({spec.path})")
        return lm

    subprocess.Popen.__init__, PretrainedModel.load = noting_popen, noting_load
    helpers.started.clear()
    try:
        result = yield
    finally:
        subprocess.Popen.__init__, PretrainedModel.load = popen_init, load
    if "cuda" not in item.keywords:  # a process from the fork server (helpers.run_python)
        done += [f"started python {argv}" for argv in helpers.started]
    if done and "slow" not in item.keywords:
        pytest.fail(f"{item.nodeid} is not marked slow but {'; '.join(sorted(set(done)))}: mark it "
                    "@pytest.mark.slow (pyproject.toml's markers)", pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _slow_work(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _slow_work(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """A test (or a library it ran in this process) that leaves a variable in os.environ fails, saying
    which: run_python compares a call's environment with the one every test starts from, so every
    later call on this worker would start a process from nothing (minutes over the suite)."""
    result = yield
    base = helpers.BASE_ENV
    left = sorted(k for k in {*os.environ, *base} if os.environ.get(k) != base.get(k)
                  and not helpers.CALL_TIME_ENV.match(k))
    for name in left:  # put back, so that the tests after it start from the same environment
        if name in base:
            os.environ[name] = base[name]
        else:
            del os.environ[name]
    if left:
        pytest.fail(f"{item.nodeid} left {', '.join(left)} changed in os.environ: restore it (monkeypatch), or "
                    "add it to helpers.CALL_TIME_ENV if the harness reads it only when it runs", pytrace=False)
    return result


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


@pytest.fixture(scope="session")
def gemma3():
    """The second real model (Gemma 3 270M, the base model: fp32, CPU), loaded once."""
    return gemma3_270m()
