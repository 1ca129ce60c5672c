"""`slow` (pyproject.toml's markers) marks every test that starts a subprocess or loads SmolLM2:
tests/conftest.py marks those using the `smollm` fixture and fails any other that does either
unmarked. Its guard, checked here, can fail."""
import subprocess
from types import SimpleNamespace

import pytest
import torch

from bench.models import PretrainedModel
from conftest import _slow_work


def phase(keywords: dict, work) -> None:
    """`work` run as a test phase is run under the guard, for a test with these `keywords` (marks)."""
    guard = _slow_work(SimpleNamespace(nodeid="tests/test_x.py::test_x", keywords=keywords))
    next(guard)
    work()
    with pytest.raises(StopIteration):
        guard.send(None)


@pytest.mark.slow  # it starts `true`
def test_an_unmarked_test_that_starts_a_process_fails():
    with pytest.raises(pytest.fail.Exception, match="test_x is not marked slow but started true"):
        phase({}, lambda: subprocess.run(["true"], check=True))
    with pytest.raises(pytest.fail.Exception, match="started sh"):
        phase({}, lambda: subprocess.run("sh -c true", shell=True, check=True))
    phase({"slow": True}, lambda: subprocess.run(["true"], check=True))  # marked: it passes
    phase({}, lambda: subprocess.run(["git", "--version"], capture_output=True))  # provenance's git: quick
    phase({"cuda": True}, lambda: subprocess.run(["true"], check=True))  # the GPU check's CLI runs (conftest.py)


def test_an_unmarked_test_that_loads_a_real_sized_model_fails():
    real_sized = SimpleNamespace(model=SimpleNamespace(parameters=lambda: [torch.empty(135_000_000, device="meta")]))
    tiny = SimpleNamespace(model=SimpleNamespace(parameters=lambda: [torch.empty(4096, device="meta")]))
    spec = PretrainedModel(name="smollm2-135m", path="/models/smollm2")
    load = PretrainedModel.load  # the guard of this test's own phase; put back before that phase ends
    try:
        PretrainedModel.load = lambda spec: real_sized
        with pytest.raises(pytest.fail.Exception, match=r"loaded smollm2-135m \(/models/smollm2\)"):
            phase({}, lambda: spec.load())
        phase({"slow": True}, lambda: spec.load())
        PretrainedModel.load = lambda spec: tiny
        phase({}, lambda: spec.load())
    finally:
        PretrainedModel.load = load


def test_quick_work_passes():
    phase({}, lambda: sum(range(10)))
