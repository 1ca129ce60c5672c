"""Adding a method is one Python file and one YAML (bench/registry.py): the manual's example
(docs/adding-a-method.md), kept outside the checkout as DIR/decoders/methods/repeat_last.py and
DIR/conf/decoder/repeat_last.yaml, runs from the command line, is lossless, is found and tested by the
greedy-equality tests, and gets a leaderboard entry, with nothing else edited."""
from __future__ import annotations

import os
import re

import pytest

from helpers import REPO, run_cli, run_python

PAGE = (REPO / "docs" / "adding-a-method.md").read_text()
METHOD = re.search(r"```python\n(.*?)```", PAGE, re.S).group(1)  # the manual's example, run as written
CONFIG = re.search(r"```yaml\n(.*?)```", PAGE, re.S).group(1)


@pytest.fixture
def method_dir(tmp_path, monkeypatch):
    """DIR with the method's file and YAML; PYTHONPATH=DIR for the processes the test starts."""
    (tmp_path / "decoders" / "methods").mkdir(parents=True)
    (tmp_path / "decoders" / "methods" / "repeat_last.py").write_text(METHOD)
    (tmp_path / "conf" / "decoder").mkdir(parents=True)
    (tmp_path / "conf" / "decoder" / "repeat_last.yaml").write_text(CONFIG)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")]))
    return tmp_path


@pytest.mark.slow
def test_a_new_method_runs_lossless(method_dir):
    out = run_cli("decoder=repeat_last", "model=tiny-random", f"hydra.searchpath=[file://{method_dir}/conf]",
                  "dataset=gsm8k", "dataset.limit=2", "gen.max_new_tokens=8", "check_lossless=true", "quality=false",
                  f"hydra.run.dir={method_dir / 'run'}")
    assert out.returncode == 0, out.stderr[-3000:]
    records = (method_dir / "run" / "records.jsonl").read_text().splitlines()
    assert len(records) == 2 and all('"decoder": "repeat_last"' in r and '"lossless": true' in r for r in records)


@pytest.mark.slow
def test_the_greedy_equality_tests_find_and_pass_a_new_method(method_dir):
    env = dict(os.environ, BENCH_TEST_CONF_DIRS=str(method_dir / "conf"))
    out = run_python("-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={method_dir / 'pt'}",
                     "tests/test_greedy_equality.py", "tests/test_layout.py", "-k", "repeat_last", env=env)
    assert out.returncode == 0, out.stdout[-3000:]
    passed = re.search(r"(\d+) passed", out.stdout)
    assert passed and int(passed[1]) >= 40, out.stdout[-500:]  # its tiny and EOS cases, and its config's layout test


@pytest.mark.slow
def test_the_leaderboard_lists_a_new_method(method_dir):
    from bench.leaderboard import compose_all

    _, labels, runs = compose_all(["model=tiny-random", f"hydra.searchpath=[file://{method_dir}/conf]",
                                   "leaderboard.datasets=[gsm8k]"])
    assert labels[-1] == "repeat_last" and runs["gsm8k", "repeat_last"].decoder.name == "repeat_last"
    _, labels, _ = compose_all(["model=tiny-random", "leaderboard.datasets=[gsm8k]"])
    assert "repeat_last" not in labels  # not without its search path


@pytest.mark.slow
def test_a_yaml_named_other_than_its_file_is_refused(tmp_path):
    (tmp_path / "conf" / "decoder").mkdir(parents=True)
    (tmp_path / "conf" / "decoder" / "repeat_last.yaml").write_text(CONFIG.replace("name: repeat_last", "name: repeat"))
    out = run_cli("decoder=autoregressive", "model=tiny-random", f"hydra.searchpath=[file://{tmp_path}/conf]",
                  f"hydra.run.dir={tmp_path / 'run'}")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "repeat_last.yaml: name: 'repeat'; it must be 'repeat_last'" in out.stderr
