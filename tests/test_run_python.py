"""helpers.run_python, the suite's way to run `python SCRIPT` or `python -m MODULE`: a child of the fork
server (imports done once) that behaves as a process started from nothing, and one started from
nothing where the server's imports could have read another environment."""
import multiprocessing.forkserver
import os
import sys

import pytest

from helpers import run_python

pytestmark = pytest.mark.slow

SCRIPT = """\
import os, sys
import huggingface_hub.constants as hub
server = open(f"/proc/{os.getppid()}/environ", "rb").read().split(b"\\0")  # as the parent was started
print(os.getcwd(), os.environ.get("BENCH_PROBE"), hub.HF_HUB_OFFLINE, "torch" in sys.modules, sys.argv[1:],
      b"BENCH_TEST_CHANGED=1" in server)
print("to stderr", file=sys.stderr)
sys.exit(3)
"""


def run_probe(tmp_path, leave_out=("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"), **env):
    """SCRIPT run with this process's environment less `leave_out`, plus `env`."""
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    environ = {k: v for k, v in os.environ.items() if k not in leave_out}
    return run_python(script, "a", "b", cwd=tmp_path, env={**environ, **env}, timeout=120)


def test_a_child_of_the_server_is_a_process_of_its_own(tmp_path, monkeypatch):
    """Its cwd, environment, arguments, exit code, stdout and stderr; the hub's offline switch as its
    environment says (the server read it at import); and it is the server's child (torch already
    imported), not a process started from nothing, in every test (each has its PYTEST_CURRENT_TEST), and
    after a compiled model ran in this process (inductor leaves the address below in os.environ)."""
    monkeypatch.setenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "140599565667360")
    for test, offline in (("first", None), ("second", "1"), ("third", None)):
        monkeypatch.setenv("PYTEST_CURRENT_TEST", test)
        out = run_probe(tmp_path, BENCH_PROBE=test, **({"HF_HUB_OFFLINE": offline} if offline else {}))
        assert out.returncode == 3 and out.stderr == "to stderr\n"
        assert out.stdout.split() == [str(tmp_path), test, str(bool(offline)), "True", "['a',", "'b']", "False"]


def test_a_variable_read_at_import_takes_a_process_started_from_nothing(tmp_path):
    out = run_probe(tmp_path, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    assert out.returncode == 3 and out.stdout.split()[3] == "False", out.stdout


def test_the_server_starts_in_the_environment_every_test_starts_from(tmp_path, monkeypatch):
    """Started while os.environ holds a change (a test's monkeypatch, or a variable a library set in the
    worker) that the call's own `env` lacks, the server does not hold it (its imports would read it), and
    the call is still its child: a server started in the change would send every later call elsewhere."""
    multiprocessing.forkserver._forkserver._stop()  # this worker's server, if any: the call below starts one
    monkeypatch.setenv("BENCH_TEST_CHANGED", "1")
    out = run_probe(tmp_path, leave_out=("BENCH_TEST_CHANGED",)).stdout.split()
    assert out[3] == "True" and out[-1] == "False", out
    assert run_probe(tmp_path, BENCH_TEST_CHANGED="1").stdout.split()[3] == "False"  # the call's own change
