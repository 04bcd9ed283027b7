"""The audit's attacks on the Python tool's sandbox, replayed with their families at each level this
host offers (bubblewrap, rlcore's own namespaces, and a host without namespaces: audit hook and
seccomp alone), against a stand-in trainer process (``sandbox_standin.py``) that holds secrets in its
environment, its command line, a 0600 file and an answers file in its working directory.

Containment is checked from outside the sandbox, never from its report: the secrets and the grader's
source never reach the output, the trainer's files are unchanged, the trainer is alive with the same
scheduling policy, nice value, CPU affinity and limits, nothing is left in its temporary directory,
the kernel log has no line from the sandbox, ``/dev/shm`` has no new file, and the machine's shared
memory did not grow by what the code tried to hold."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from rlcore.envs import builtin
from rlcore.envs.sandbox import STRICT_GUARDS, run_python
from rlcore.envs.sandbox_layout import bubblewrap

TOKEN = uuid.uuid4().hex
SECRETS = {where: f"RLSECRET-{where}-{TOKEN}" for where in ("env", "cmdline", "file", "answers")}
#: A line of the grader's source (``rlcore.envs.builtin``): the code must not read it.
GRADER_LINE = "def answers_match(answer: str, expected: Any) -> bool:"
STANDIN = Path(__file__).with_name("sandbox_standin.py")
LEVELS = ["bubblewrap", "namespaces", "weak"]


def _host_has(level: str) -> bool:
    if level == "weak":
        return True
    if level == "bubblewrap" and bubblewrap() is None:
        return False
    return STRICT_GUARDS <= set(run_python("pass", isolation=level).guards)


class Trainer:
    """The stand-in trainer process and what must not change about it."""

    def __init__(self, root: Path, level: str):
        self.level, self.cwd, self.tmp = level, root / "trainer", root / "tmp"
        self.cwd.mkdir()
        self.tmp.mkdir()
        (self.cwd / "secret.txt").write_text(SECRETS["file"])
        os.chmod(self.cwd / "secret.txt", 0o600)
        (self.cwd / "answers.jsonl").write_text(json.dumps({"prompt": "6*7", "ground_truth": SECRETS["answers"]}))
        env = dict(os.environ, RLCORE_STANDIN_SECRET=SECRETS["env"], TMPDIR=str(self.tmp))
        self.proc = subprocess.Popen([sys.executable, str(STANDIN), f"--secret={SECRETS['cmdline']}"], cwd=self.cwd,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     start_new_session=True)
        assert json.loads(self.proc.stdout.readline()) == {"ready": True}
        self.pid = self.proc.pid
        self.before = self.state()

    def state(self) -> dict:
        pid = self.pid
        with open(f"/proc/{pid}/limits") as f:
            limits = f.read()
        files = {p.name: (p.read_bytes(), p.stat().st_mode, p.stat().st_mtime_ns) for p in sorted(self.cwd.iterdir())}
        return {"alive": self.proc.poll() is None, "policy": os.sched_getscheduler(pid),
                "nice": os.getpriority(os.PRIO_PROCESS, pid), "affinity": os.sched_getaffinity(pid),
                "limits": limits, "files": files, "tmp": sorted(os.listdir(self.tmp)),
                "shm": sorted(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else []}

    def run(self, code: str, layers=None) -> dict:
        isolation = "none" if self.level == "weak" else self.level
        request = {"code": self.prelude() + code, "isolation": isolation}
        if layers is not None:
            request["layers"] = list(layers)
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        assert ready, "the stand-in trainer gave no answer"
        line = self.proc.stdout.readline()
        assert line, f"the stand-in trainer died (exit {self.proc.poll()})"
        return json.loads(line)

    def prelude(self) -> str:
        return f'''
import os, re, sys
PID = {self.pid}
CWD = {str(self.cwd)!r}
GRADER = {builtin.__file__!r}
FOUND = re.compile(r"RLSECRET-[a-z]+-[0-9a-f]{{32}}|def answers_match")
def attempt(name, fn):
    try:
        got = fn()
    except BaseException as error:
        print(name, "refused", type(error).__name__, str(error)[:160])
        return
    text = got.decode("utf-8", "replace") if isinstance(got, (bytes, bytearray)) else str(got)
    print(name, "GOT", sorted(set(FOUND.findall(text))), text[:120].replace(chr(10), " "))
'''

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module", params=LEVELS)
def trainer(request, tmp_path_factory):
    if not _host_has(request.param):
        pytest.skip(f"this host does not give the sandbox the {request.param} level (strict guards)")
    standin = Trainer(tmp_path_factory.mktemp(f"standin-{request.param}"), request.param)
    yield standin
    standin.close()


class SharedMemory:
    """The largest growth of the machine's shared memory (memfd, tmpfs, SysV) while it is watched."""

    def __init__(self):
        self.start, self.peak, self.stop = self.read(), 0, threading.Event()
        self.thread = threading.Thread(target=self.watch, daemon=True)

    @staticmethod
    def read() -> int:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("Shmem:"))

    def watch(self):
        while not self.stop.wait(0.02):
            self.peak = max(self.peak, self.read() - self.start)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def kernel_log_has(marker: bytes) -> bool:
    """Whether a kernel log line holds ``marker`` (read from outside; False where the test cannot read
    the log: then the sandbox could not write it either, as the same user)."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    found = False
    try:
        while True:
            try:
                found |= marker in os.read(fd, 8192)
            except BlockingIOError:
                return found
            except OSError:  # a record overwritten while read: go on
                continue
    finally:
        os.close(fd)


def contained(trainer: Trainer, answer: dict) -> str:
    """Assert, from outside, that nothing got out; returns the output."""
    assert "error" not in answer, answer  # run_python never raises for what the code does
    output = answer["output"]
    for where, secret in SECRETS.items():
        assert secret not in output, f"the trainer's {where} secret reached the output:\n{output}"
    assert GRADER_LINE not in output, f"the grader's source reached the output:\n{output}"
    after = trainer.state()
    assert after == trainer.before, {k: (trainer.before[k], after[k]) for k in after if after[k] != trainer.before[k]}
    return output


def test_other_processes_proc_files_through_dir_fd_and_other_paths(trainer):
    output = contained(trainer, trainer.run('''
proc = lambda: os.open("/proc", os.O_RDONLY)
mine = lambda: os.open(f"/proc/{PID}", os.O_RDONLY)
def read_mem():
    data = []
    with open(f"/proc/{PID}/mem", "rb", buffering=0) as mem:
        for line in open(f"/proc/{PID}/maps"):
            if " rw-p " in line:
                low, high = (int(x, 16) for x in line.split()[0].split("-"))
                try:
                    mem.seek(low)
                    data.append(mem.read(min(high - low, 1 << 24)))
                except OSError:
                    pass
    return b"".join(data)
attempt("cmdline dir_fd", lambda: os.read(os.open(f"{PID}/cmdline", os.O_RDONLY, dir_fd=proc()), 65536))
attempt("environ dir_fd", lambda: os.read(os.open("environ", os.O_RDONLY, dir_fd=mine()), 65536))
attempt("cmdline opener", lambda: open(f"{PID}/cmdline", "rb", opener=lambda p, f: os.open(p, f, dir_fd=proc())).read())
attempt("cmdline", lambda: open(f"/proc/{PID}/cmdline", "rb").read())
attempt("environ", lambda: open(f"/proc/{PID}/environ", "rb").read())
attempt("environ via self", lambda: open(f"/proc/self/../{PID}/environ", "rb").read())
attempt("environ via task", lambda: open(f"/proc/{PID}/task/{PID}/environ", "rb").read())
attempt("environ via thread-self", lambda: open(f"/proc/thread-self/../../{PID}/environ", "rb").read())
attempt("environ via parent", lambda: open(f"/proc/{os.getppid()}/environ", "rb").read())
attempt("mem", read_mem)
attempt("readlink cwd", lambda: os.readlink("cwd", dir_fd=mine()))
attempt("fd listing", lambda: os.listdir(f"/proc/{PID}/fd"))
attempt("own environ", lambda: open("/proc/self/environ", "rb").read())
'''))
    assert "own environ GOT" in output  # its own (scrubbed) environment stays readable


def test_devices_through_dir_fd_and_other_paths(trainer):
    marker = f"rlcore-sandbox-kmsg-{uuid.uuid4().hex}".encode()
    shm = f"rlcore-sandbox-{uuid.uuid4().hex}"
    output = contained(trainer, trainer.run(f'''
MARK = {marker!r} + b"\\n"
dev = lambda: os.open("/dev", os.O_RDONLY)
attempt("kmsg dir_fd", lambda: os.write(os.open("kmsg", os.O_WRONLY, dir_fd=dev()), MARK))
attempt("kmsg", lambda: open("/dev/kmsg", "wb").write(MARK))
attempt("kmsg relative", lambda: os.write(os.open("../" * 40 + "dev/kmsg", os.O_WRONLY), MARK))
attempt("kmsg via root link", lambda: open("/proc/self/root/dev/kmsg", "wb").write(MARK))
attempt("kmsg via trainer root", lambda: open(f"/proc/{{PID}}/root/dev/kmsg", "wb").write(MARK))
attempt("kmsg via own root dir_fd", lambda: os.write(os.open("root/dev/kmsg", os.O_WRONLY,
                                                               dir_fd=os.open("/proc/self", os.O_RDONLY)), MARK))
attempt("kmsg node", lambda: (os.mknod("kmsg", 0o20600, os.makedev(1, 11)), open("kmsg", "wb").write(MARK)))
attempt("console", lambda: open("/dev/console", "wb").write(MARK))
attempt("tty", lambda: open("/dev/tty", "wb").write(MARK))
attempt("disk", lambda: open("/dev/vda", "rb").read(512))
attempt("shm", lambda: open("/dev/shm/{shm}", "wb").write(b"x"))
attempt("shm dir_fd", lambda: os.open("{shm}", os.O_CREAT | os.O_WRONLY, dir_fd=os.open("/dev/shm", os.O_RDONLY)))
attempt("null", lambda: open("/dev/null", "wb").write(b"x"))
'''))
    assert not kernel_log_has(marker)
    assert "null GOT" in output
    for device in ("kmsg", "console", "tty", "disk", "shm"):
        assert f"{device} GOT" not in output and f"{device} dir_fd GOT" not in output, output


def test_the_trainers_files_and_the_grader(trainer):
    repo = str(Path(builtin.__file__).resolve().parents[2])
    contained(trainer, trainer.run(f'''
attempt("answers", lambda: open(CWD + "/answers.jsonl").read())
attempt("secret", lambda: open(CWD + "/secret.txt").read())
attempt("answers dir_fd", lambda: os.read(os.open("answers.jsonl", os.O_RDONLY, dir_fd=os.open(CWD, os.O_RDONLY)), 65536))
attempt("answers via proc cwd", lambda: open(f"/proc/{{PID}}/cwd/answers.jsonl").read())
attempt("answers pathlib", lambda: __import__("pathlib").Path(CWD, "answers.jsonl").read_text())
attempt("answers open_code", lambda: __import__("io").open_code(CWD + "/answers.jsonl").read())
attempt("listing", lambda: os.listdir(CWD))
attempt("import rlcore", lambda: __import__("inspect").getsource(__import__("rlcore.envs.builtin", fromlist=["x"])))
sys.path[:0] = {sys.path!r} + [{repo!r}]
attempt("import rlcore from the trainer's path",
        lambda: __import__("inspect").getsource(__import__("rlcore.envs.builtin", fromlist=["x"])))
attempt("import core", lambda: __import__("inspect").getsource(__import__("core.envs.builtin", fromlist=["x"])))
attempt("grader", lambda: open(GRADER).read())
attempt("grader dir_fd", lambda: os.read(os.open(os.path.basename(GRADER), os.O_RDONLY,
                                                 dir_fd=os.open(os.path.dirname(GRADER), os.O_RDONLY)), 1 << 20))
attempt("grader linecache", lambda: "".join(__import__("linecache").getlines(GRADER)))
'''))


def test_writing_the_trainers_directory(trainer):
    contained(trainer, trainer.run('''
trainer_dir = lambda: os.open(f"/proc/{PID}/cwd", os.O_RDONLY)
attempt("via proc cwd", lambda: open(f"/proc/{PID}/cwd/answers.jsonl", "w").write("pwned"))
attempt("create via proc cwd", lambda: open(f"/proc/{PID}/cwd/new.txt", "w").write("pwned"))
attempt("create dir_fd", lambda: os.write(os.open("new.txt", os.O_CREAT | os.O_WRONLY, dir_fd=trainer_dir()), b"x"))
attempt("mkdir dir_fd", lambda: os.mkdir("made", dir_fd=trainer_dir()))
attempt("append", lambda: open(CWD + "/answers.jsonl", "a").write("pwned"))
attempt("truncate", lambda: os.truncate(CWD + "/answers.jsonl", 0))
attempt("chmod", lambda: os.chmod(CWD + "/secret.txt", 0o666))
attempt("unlink", lambda: os.unlink(f"/proc/{PID}/cwd/answers.jsonl"))
attempt("rename in", lambda: (open("mine", "w").close(), os.rename("mine", CWD + "/mine")))
attempt("hard link", lambda: (os.link(CWD + "/answers.jsonl", "linked"), open("linked", "a").write("pwned")))
attempt("utime", lambda: os.utime(CWD + "/answers.jsonl", (0, 0)))
own = lambda: os.open("/proc/self", os.O_RDONLY)
attempt("append via own root dir_fd", lambda: os.write(os.open("root" + CWD + "/answers.jsonl", os.O_WRONLY | os.O_APPEND,
                                                                dir_fd=own()), b"pwned"))
attempt("create via own root dir_fd", lambda: os.open("root" + CWD + "/new.txt", os.O_CREAT | os.O_WRONLY, dir_fd=own()))
'''))


def test_writing_the_standard_library_through_dir_fd(trainer):
    """A directory the code may read is not one it may write in (a name that looks inside the working
    directory, relative to a descriptor of the standard library)."""
    stdlib = Path(os.__file__).resolve().parent
    made = stdlib / f"rlcore_sandbox_{uuid.uuid4().hex}.py"
    try:
        contained(trainer, trainer.run(f'''
attempt("create in the stdlib", lambda: os.open({made.name!r}, os.O_CREAT | os.O_WRONLY,
                                                dir_fd=os.open({str(stdlib)!r}, os.O_RDONLY)))
'''))
        assert not made.exists()
    finally:
        made.unlink(missing_ok=True)


def test_rewriting_the_hook_through_a_traceback_frame(trainer):
    output = contained(trainer, trainer.run('''
target = CWD + "/answers.jsonl"
try:
    open(target, "w")
except Exception as error:
    tb = error.__traceback__
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in frames[1:]:
        for name, value in list(frame.f_locals.items()):
            if hasattr(value, "__code__"):
                attempt("code of " + name, lambda v=value: setattr(v, "__code__", (lambda *a, **k: True).__code__))
                attempt("defaults of " + name, lambda v=value: setattr(v, "__defaults__", None))
        frame.f_globals.clear()
attempt("write after", lambda: open(target, "w").write("pwned"))
attempt("create after", lambda: open(CWD + "/new.txt", "w").write("pwned"))
'''))
    tampering = [line for line in output.splitlines() if line.startswith(("code of", "defaults of"))]
    assert any(line.startswith("code of _open refused") for line in tampering), output  # the hook's helper
    assert not [line for line in tampering if " GOT " in line], output


SIGNALS = '''
import fcntl, signal, struct, resource
r, w = os.pipe()
attempt("F_SETOWN", lambda: fcntl.fcntl(r, fcntl.F_SETOWN, PID))
attempt("F_SETOWN_EX", lambda: fcntl.fcntl(r, 15, struct.pack("ii", 1, PID)))
attempt("FIOSETOWN", lambda: fcntl.ioctl(r, 0x8901, struct.pack("i", PID)))
attempt("F_SETSIG", lambda: fcntl.fcntl(r, 10, signal.SIGKILL))
attempt("O_ASYNC", lambda: fcntl.fcntl(r, fcntl.F_SETFL, os.O_ASYNC | os.O_NONBLOCK))
attempt("SIGIO", lambda: os.write(w, b"x"))
attempt("kill", lambda: os.kill(PID, signal.SIGKILL))
attempt("killpg", lambda: os.killpg(PID, signal.SIGKILL))
attempt("pidfd", lambda: signal.pidfd_send_signal(os.pidfd_open(PID), signal.SIGKILL))
attempt("SCHED_IDLE", lambda: os.sched_setscheduler(PID, os.SCHED_IDLE, os.sched_param(0)))
attempt("SCHED_BATCH", lambda: os.sched_setscheduler(PID, os.SCHED_BATCH, os.sched_param(0)))
attempt("sched_setparam", lambda: os.sched_setparam(PID, os.sched_param(0)))
attempt("renice", lambda: os.setpriority(os.PRIO_PROCESS, PID, 19))
attempt("renice group", lambda: os.setpriority(os.PRIO_PGRP, PID, 19))
attempt("affinity", lambda: os.sched_setaffinity(PID, {0}))
attempt("prlimit", lambda: resource.prlimit(PID, resource.RLIMIT_NOFILE, (3, 3)))
import time; time.sleep(0.2)
'''


@pytest.mark.parametrize("guards", ["all", "seccomp and namespaces"])
def test_signalling_or_renicing_the_trainer(trainer, guards):
    """Also without the audit hook: what stops native code (seccomp, the namespaces) holds alone."""
    contained(trainer, trainer.run(SIGNALS, None if guards == "all" else ("seccomp", "namespaces")))


@pytest.mark.parametrize("guards", ["all", "seccomp and namespaces"])
def test_memory_outside_the_limit(trainer, guards):
    """memfd buffers, SysV and POSIX shared memory, /dev/shm and (with a filesystem of its own) the
    working directory do not hold ~1 GB of RAM outside ``memory_mb``."""
    fill = '''
def fill_directory():
    for index in range(64):
        with open(f"fill{index}", "wb") as f:
            for _ in range(16):
                f.write(bytes(1 << 20))
attempt("working directory", fill_directory)
''' if trainer.level != "weak" else ""  # without one it is the host's disk, not RAM: no quota there
    # without the hook and without namespaces nothing keeps native code out of /dev/shm: that level's
    # guard against it is the hook (see docs/environments.md)
    shm = '''
attempt("posix shm", lambda: __import__("_posixshmem").shm_open("/rlcore-test", os.O_CREAT | os.O_RDWR, 0o600))
''' if trainer.level != "weak" or guards == "all" else ""
    code = '''
import time
def memfds():
    held = []
    for _ in range(61):
        fd = os.memfd_create("x")
        os.ftruncate(fd, 16 << 20)
        os.pwrite(fd, bytes(16 << 20), 0)
        held.append(fd)
    return held
def sysv():
    import ctypes
    libc = ctypes.CDLL(None)
    return libc.shmget(0, 1 << 30, 0o1600)
attempt("memfd", memfds)
attempt("sysv", sysv)
''' + shm + fill + "time.sleep(0.5)\n"
    with SharedMemory() as shared:
        contained(trainer, trainer.run(code, None if guards == "all" else ("seccomp", "namespaces")))
    assert shared.peak < 200 << 20, f"shared memory grew by {shared.peak >> 20} MB"


@pytest.mark.slow
def test_a_deep_tree_is_removed_and_the_run_does_not_raise(trainer):
    """3000 nested directories (made by native calls, the hook is off) do not make the clean-up raise
    or leave the directory behind."""
    code = '''
made = 0
try:
    for _ in range(3000):
        os.mkdir("d")
        os.chdir("d")
        made += 1
finally:
    print("made", made)
'''
    output = contained(trainer, trainer.run(code, ("seccomp", "namespaces")))
    assert "made 3000" in output, output


def test_tool_processes_die_with_a_killed_trainer(tmp_path):
    """Item: a trainer killed with SIGKILL leaves no sandbox process behind, at every level. The
    sandbox's processes are found by a declared path of their own, which their command lines hold."""
    for level in (level for level in LEVELS if _host_has(level)):
        (tmp_path / level).mkdir()
        standin = Trainer(tmp_path / level, level)
        marker = tmp_path / level / f"marker-{uuid.uuid4().hex}"
        marker.mkdir()
        request = {"code": "import time\ntime.sleep(60)", "isolation": "none" if level == "weak" else level,
                   "paths": [str(marker)]}
        standin.proc.stdin.write(json.dumps(request) + "\n")
        standin.proc.stdin.flush()
        deadline = time.monotonic() + 10
        while not _processes_with(marker.name) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _processes_with(marker.name), f"{level}: the sandbox never started"
        time.sleep(0.3)  # past the set-up: the code runs
        os.kill(standin.pid, signal.SIGKILL)
        standin.proc.wait()
        deadline = time.monotonic() + 5
        while _processes_with(marker.name) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = _processes_with(marker.name)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert left == [], f"{level}: sandbox processes outlived the trainer"


def _processes_with(marker: str) -> list[int]:
    """Processes whose command line holds ``marker``."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(name))
            except OSError:
                pass
    return found


def test_declared_paths_are_readable_and_importable_and_nothing_else(tmp_path):
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "helper.py").write_text("ANSWER = 42\n")
    (tmp_path / "answers.txt").write_text(SECRETS["answers"])
    code = f"import helper\nprint(helper.ANSWER)\nprint(open({str(tmp_path / 'answers.txt')!r}).read())"
    for level in (level for level in LEVELS if _host_has(level)):
        result = run_python(code, isolation="none" if level == "weak" else level, paths=[str(tools)])
        assert result.output.startswith("42\n") and SECRETS["answers"] not in result.output, (level, result.output)


SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.mark.skipif(os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK),
                    reason="needs root and an interpreter every user may run, at /usr/bin/python3")
def test_a_root_trainer_without_namespaces_runs_the_code_as_another_user(tmp_path):
    """Root on a host without namespaces: the run is another user, so even native code (the hook
    off) cannot read a 0600 file of the trainer or write its directory."""
    from rlcore.envs.sandbox_layout import layout

    if not layout(SYSTEM_PYTHON)["open_to_all"]:
        pytest.skip(f"{SYSTEM_PYTHON}'s standard library is not readable by every user here")
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRETS["file"])
    os.chmod(secret, 0o600)
    os.chmod(tmp_path, 0o755)
    code = f'''
for what, action in (("read", lambda: open({str(secret)!r}).read()), ("write", lambda: open({str(tmp_path / "new")!r}, "w"))):
    try:
        print(what, action())
    except OSError as error:
        print(what, "refused", error.errno)
'''
    result = run_python(code, python=SYSTEM_PYTHON, isolation="none", layers=("seccomp", "namespaces"))
    assert "read refused 13" in result.output and "write refused 13" in result.output, result.output
    assert SECRETS["file"] not in result.output and sorted(p.name for p in tmp_path.iterdir()) == ["secret.txt"]
