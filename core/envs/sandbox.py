"""Run untrusted Python code in a sandboxed subprocess: the built-in ``python`` tool's executor.

The code runs in a fresh interpreter (``python -I -B -u``: unbuffered, so what it printed before a
kill is kept) started in a new session with a **scrubbed environment** (``PATH``, ``HOME``,
``TMPDIR`` and ``LANG`` only), in a temporary working directory removed afterwards, under
**resource limits** (CPU seconds, address space, file size, open files, processes, no core dumps),
a **wall-clock timeout** and **output truncation** (its beginning and its end are kept). Three
guards, each of which can be turned off (``layers``) so that tests can check the others hold on
their own:

* ``"audit"`` — a PEP 578 audit hook, installed before the code runs and not removable, refuses
  starting processes, sockets, ``ctypes``, ``mmap``, sub-interpreters, trace functions, reaching
  objects through ``gc``, and writing, creating, removing, renaming or changing files outside the
  working directory (``open``, ``os.*``, ``shutil.*``, ``sqlite3.connect`` ...); functions that
  raise no audit event (``os.mkfifo``, ``os.mknod``, ``_posixsubprocess.fork_exec``, ``pidfd``
  signals, POSIX shared memory) are replaced by refusing ones. Everything the hook decides with is
  bound when it is installed (default arguments of functions the code cannot reach), and the code
  runs in a fresh ``__main__`` module, so rebinding names it can reach changes nothing. The process
  ends with ``os._exit`` (interpreter finalization, which drops audit hooks, never runs the code's
  finalizers). The hook alone is no boundary against code that corrupts the interpreter's memory
  or rebuilds a native module (``_imp``) to reach a function with no audit event: the other
  guards are.
* ``"seccomp"`` — on Linux x86-64 and AArch64, a seccomp filter: no new processes (only threads),
  no ``execve``, no ``socket`` (``socketpair`` stays), no ``mknod``, no namespace, mount, ``ptrace``
  or ``bpf`` calls, signals only to itself. It holds for native code and for root.
* ``"namespaces"`` — where the kernel allows it, new user, network, mount and PID namespaces: no
  network device but a down loopback, every mount read-only except the working directory, and the
  code's process tree dies with the namespace's init (nothing outlives the run).

``SandboxResult.guards`` says which guards held in a run. A CPU-time kill counts as a timeout.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Iterable, Optional

#: The guards :func:`run_python` can use (all by default); see the module docstring.
LAYERS = ("audit", "seccomp", "namespaces")

#: After the run's process exits: how long to wait for the end of its output.
_GRACE_S = 0.25
#: How often to look at the process where the kernel gives no descriptor to wait on.
_POLL_S = 0.02

#: The script the child runs (:mod:`rlcore.envs.sandbox_child`, copied into the run's directory).
_WRAPPER = (Path(__file__).resolve().parent / "sandbox_child.py").read_text(encoding="utf-8")


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run. ``memory_mb`` bounds the address space (so also what the interpreter maps)."""

    timeout_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 512
    max_output_bytes: int = 4096
    max_file_mb: int = 16
    max_processes: int = 64

    def __post_init__(self) -> None:
        for name in ("timeout_s", "cpu_s", "memory_mb", "max_output_bytes", "max_file_mb", "max_processes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox limit {name} must be > 0, got {getattr(self, name)!r}")


@dataclass
class SandboxResult:
    """What a run printed (stdout and stderr interleaved, truncated) and how it ended.

    ``cancelled``: killed because the caller's ``cancel`` event was set (``timed_out`` is set too).
    ``timed_out`` is set by the wall-clock timeout (``exit_code`` is then ``None``) and by the CPU
    limit (``cpu_exceeded``; ``exit_code`` is the signal that ended it, negated). ``guards`` names the
    guards that held: ``audit``, ``seccomp``, ``network_namespace``, ``user_namespace``,
    ``pid_namespace``, ``readonly_mounts``."""

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


def _scrubbed_env(root: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": root, "TMPDIR": root, "LANG": "C.UTF-8"}


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


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), *, python: Optional[str] = None,
               layers: Iterable[str] = LAYERS, cancel: Optional[threading.Event] = None) -> SandboxResult:
    """Run ``code`` in a fresh sandboxed interpreter (see the module docstring) in a temporary
    directory removed afterwards; never raises for anything the code does. ``layers``: the guards to
    use (a subset of :data:`LAYERS`; fewer only to test that each holds on its own). ``cancel``: once
    set, the run is killed as at its timeout (``cancelled`` in the result), e.g. when the episode
    that asked for it has ended."""
    layers = tuple(layers)
    unknown = set(layers) - set(LAYERS)
    if unknown:
        raise ValueError(f"sandbox layers: unknown {sorted(unknown)}, expected a subset of {LAYERS}")
    start = time.perf_counter()
    root = os.path.realpath(tempfile.mkdtemp(prefix="rlcore-sandbox-"))
    report_r, report_w = os.pipe()
    proc = None
    try:
        with open(os.path.join(root, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        wrapper = os.path.join(root, ".wrapper.py")
        with open(wrapper, "w", encoding="utf-8") as f:
            f.write(_WRAPPER)
        cfg = {"cpu": int(limits.cpu_s), "memory": int(limits.memory_mb) << 20, "fsize": int(limits.max_file_mb) << 20,
               "nproc": int(limits.max_processes), "root": root, "layers": list(layers), "report": report_w}
        proc = subprocess.Popen([python or sys.executable, "-I", "-B", "-u", wrapper, json.dumps(cfg)], cwd=root,
                                env=_scrubbed_env(root), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True, pass_fds=(report_w,))
        os.close(report_w)
        report_w = -1
        out = _Output(limits.max_output_bytes)
        status, usage, wall = _supervise(proc, limits.timeout_s, out, cancel)
        cancelled = wall and cancel is not None and cancel.is_set()
        os.set_blocking(report_r, False)
        try:
            guards = tuple(name for name in os.read(report_r, 4096).decode().split(",") if name)
        except BlockingIOError:
            guards = ()
        exit_code = os.waitstatus_to_exitcode(status)
        cpu = usage.ru_utime + usage.ru_stime if usage is not None else 0.0
        cpu_exceeded = not wall and (exit_code == -signal.SIGXCPU or (exit_code == -signal.SIGKILL
                                                                        and cpu >= limits.cpu_s))
        # the wrapper's own frames are not the user's business
        output = out.text().replace(f'File "{wrapper}"', 'File "<sandbox>"')
        return SandboxResult(output=output, exit_code=None if wall else exit_code, timed_out=wall or cpu_exceeded,
                             truncated=out.truncated, seconds=time.perf_counter() - start,
                             cpu_exceeded=cpu_exceeded, guards=guards, cancelled=cancelled)
    finally:
        for fd in (report_r, report_w):
            if fd >= 0:
                os.close(fd)
        if proc is not None and proc.stdout is not None:
            proc.stdout.close()
        shutil.rmtree(root, ignore_errors=True)
