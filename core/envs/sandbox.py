"""Run untrusted Python code in a sandboxed subprocess: the built-in ``python`` tool's executor.

Layers, each enough on its own for some attacks and together for all the tests throw at it:

* a fresh interpreter (``python -I -B``: no user site, no ``PYTHON*`` variables, no bytecode
  files) started in a new session with a **scrubbed environment** (``PATH``, ``HOME``, ``TMPDIR``
  and ``LANG`` only: no secrets of the trainer's environment reach the code);
* **resource limits** set by the child on itself before the code runs: CPU seconds, address space
  (memory), file size, open files, processes (a fork bomb stops at the limit), no core files;
* a **wall-clock timeout**: past it the whole process group is killed;
* **no network**: the child moves into a new user and network namespace where the kernel allows it
  (only a down loopback device inside), and in every case an audit hook refuses sockets;
* **writes confined** to the episode's temporary directory (the working directory): the audit hook
  refuses opening a file for writing, creating, removing or renaming anything outside it, and
  refuses starting processes, ``ctypes`` and other escapes from the hook;
* **output truncated** to ``max_output_bytes``, its beginning and its end (the middle is read and
  dropped, so a flood of output cannot fill memory).

The audit hook cannot be removed once installed (PEP 578), and the code runs after it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Optional

#: The script the child runs: limits, namespaces, the audit hook, then the user's code (``main.py``).
_WRAPPER = r'''
import os, resource, sys
cfg = {cfg!r}
def _limit(kind, value):
    try:
        resource.setrlimit(kind, (value, value))
    except (ValueError, OSError):
        pass
_limit(resource.RLIMIT_CPU, cfg["cpu"])
_limit(resource.RLIMIT_AS, cfg["memory"])
_limit(resource.RLIMIT_FSIZE, cfg["fsize"])
_limit(resource.RLIMIT_NOFILE, 64)
_limit(resource.RLIMIT_CORE, 0)
_limit(resource.RLIMIT_NPROC, cfg["nproc"])
isolated = False
try:
    import ctypes
    _libc = ctypes.CDLL(None, use_errno=True)
    isolated = _libc.unshare(0x10000000 | 0x40000000) == 0  # CLONE_NEWUSER | CLONE_NEWNET
    del _libc, ctypes
except Exception:
    pass
_root = os.path.realpath(cfg["root"])
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_PATH_EVENTS = {{"os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.rename": 2, "os.symlink": 2, "os.link": 2,
                "os.chmod": 1, "os.chown": 1, "os.truncate": 1, "os.utime": 1, "shutil.rmtree": 1,
                "shutil.copyfile": 2, "shutil.move": 2, "os.chdir": 1}}
_REFUSED = ("socket.", "subprocess.", "os.exec", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn",
            "os.system", "os.kill", "os.killpg", "os.setuid", "ctypes.", "sys.addaudithook", "os.putenv",
            "os.unsetenv", "pty.", "resource.setrlimit", "mmap.", "os.startfile", "webbrowser.", "urllib.",
            "http.", "ftplib.", "smtplib.", "import_module_from_spec")
def _inside(path):
    if isinstance(path, int):
        return True
    try:
        real = os.path.realpath(os.fsdecode(path))
    except Exception:
        return False
    return real == _root or real.startswith(_root + os.sep)
def _foreign_proc(path):
    parts = os.path.abspath(path).split(os.sep)
    return len(parts) > 2 and parts[1] == "proc" and parts[2] not in ("self", "thread-self", str(os.getpid()))
def _hook(event, args):
    if event.startswith(_REFUSED) or event in ("os.exec", "os.fork"):
        raise PermissionError(f"sandbox: {{event}} is not allowed")
    if event == "open":
        path, mode, flags = args
        if isinstance(path, (str, bytes)) and _foreign_proc(os.fsdecode(path)):
            raise PermissionError(f"sandbox: reading other processes' files is not allowed: {{path}}")
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (isinstance(flags, int) and flags & _WRITE)
        if writing and not _inside(path):
            raise PermissionError(f"sandbox: writing outside the working directory is not allowed: {{path}}")
    elif event in _PATH_EVENTS:
        for path in args[:_PATH_EVENTS[event]]:
            if path is not None and not _inside(path):
                raise PermissionError(f"sandbox: {{event}} outside the working directory is not allowed: {{path}}")
sys.addaudithook(_hook)
del _hook, _limit
sys.argv = ["main.py"]
_source = open(os.path.join(_root, "main.py"), encoding="utf-8").read()
_globals = {{"__name__": "__main__", "__builtins__": __builtins__}}
del cfg
try:
    exec(compile(_source, "main.py", "exec"), _globals)
except SystemExit:
    raise
except BaseException as error:  # the user's frames only
    import traceback
    sys.stderr.write("".join(traceback.format_exception(type(error), error, error.__traceback__.tb_next)))
    sys.stderr.flush()
    os._exit(1)
'''


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
    """What a run printed (stdout and stderr interleaved, truncated) and how it ended."""

    output: str
    exit_code: Optional[int]
    timed_out: bool = False
    truncated: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def describe(self) -> str:
        """The output, with a last line saying why the run stopped when it did not finish cleanly."""
        text = self.output
        if self.truncated:
            text += "\n[output truncated]"
        if self.timed_out:
            text += "\n[timed out]"
        elif self.exit_code and self.exit_code < 0:
            name = signal.Signals(-self.exit_code).name if -self.exit_code in signal.valid_signals() else "signal"
            text += f"\n[killed by {name}" + (": CPU time limit]" if name == "SIGXCPU" else "]")
        elif self.exit_code:
            text += f"\n[exit code {self.exit_code}]"
        return text.strip("\n")


def _scrubbed_env(root: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": root, "TMPDIR": root, "LANG": "C.UTF-8"}


def _drain(stream, keep: int, sink: list, flags: dict) -> None:
    """Read ``stream`` to its end, keeping its first and last ``keep // 2`` bytes (an error
    message at the end of a long output survives)."""
    head, tail, half, total = bytearray(), bytearray(), max(1, keep // 2), 0
    while True:
        chunk = stream.read(65536)
        if not chunk:
            break
        total += len(chunk)
        room = half - len(head)
        if room > 0:
            head += chunk[:room]
            chunk = chunk[room:]
        tail = (tail + chunk)[-(keep - half):]
    stream.close()
    flags["truncated"] = total > len(head) + len(tail)
    sink.append(bytes(head) + (b"\n[...]\n" if flags["truncated"] else b"") + bytes(tail))


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), *, python: Optional[str] = None) -> SandboxResult:
    """Run ``code`` in a fresh sandboxed interpreter (see the module docstring) in a temporary
    directory removed afterwards; never raises for anything the code does."""
    start = time.perf_counter()
    root = tempfile.mkdtemp(prefix="rlcore-sandbox-")
    try:
        with open(os.path.join(root, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        cfg = {"cpu": int(limits.cpu_s), "memory": int(limits.memory_mb) << 20, "fsize": int(limits.max_file_mb) << 20,
               "nproc": int(limits.max_processes), "root": root}
        wrapper = os.path.join(root, ".wrapper.py")
        with open(wrapper, "w", encoding="utf-8") as f:
            f.write(_WRAPPER.format(cfg=cfg))
        proc = subprocess.Popen([python or sys.executable, "-I", "-B", wrapper], cwd=root, env=_scrubbed_env(root),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        chunks: list[bytes] = []
        flags: dict = {}
        reader = threading.Thread(target=_drain, args=(proc.stdout, limits.max_output_bytes, chunks, flags),
                                  daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_group(proc)
        reader.join(timeout=2.0)
        output = b"".join(chunks).decode("utf-8", errors="replace")
        # the wrapper's own frames are not the user's business
        output = output.replace(f'File "{wrapper}"', 'File "<sandbox>"')
        return SandboxResult(output=output, exit_code=None if timed_out else proc.returncode, timed_out=timed_out,
                             truncated=bool(flags.get("truncated")), seconds=time.perf_counter() - start)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the run's whole process group (children it started included) and reap the leader."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:  # pragma: no cover - a SIGKILLed process always goes
        pass
