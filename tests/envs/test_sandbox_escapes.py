"""Escapes from the Python tool's sandbox, each run against the guards that claim to stop it, alone
and together: hostile code must not write outside its directory, start processes, reach the network
or outlive the run, and a CPU-time kill must count as a timeout."""

import dis
import os
import signal
import sys
import uuid

import pytest

from rlcore.envs.sandbox import _WRAPPER, LAYERS, SandboxLimits, run_python
from rlcore.envs.sandbox_layout import interpreter

LIMITS = SandboxLimits(timeout_s=5.0, cpu_s=2, memory_mb=256, max_output_bytes=4096)
ALL = LAYERS
AUDIT = ("audit",)
SECCOMP = ("seccomp",)
NAMESPACES = ("namespaces",)


def run(code, layers=ALL, limits=LIMITS):
    return run_python(code, limits, layers=layers)


def require(result, *guards):
    missing = [guard for guard in guards if guard not in result.guards]
    if missing:
        pytest.skip(f"this kernel does not give the sandbox {missing}")


def assert_refused(result, layers, kernel_says: str, hook_says: str, printed: str) -> None:
    """Refused by the guard the run had: seccomp (the kernel's error) or the audit hook (its message);
    the code's line after the refused call never printed."""
    if layers == SECCOMP:
        require(result, "seccomp")
        assert kernel_says in result.output
    else:
        assert hook_says in result.output
    assert not result.ok and printed not in result.output


def processes_running(marker: str) -> list[int]:
    """Ids of processes whose command line holds ``marker``."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(name))
            except OSError:
                pass
    return found


def test_the_hook_reads_no_name_the_code_could_rebind():
    """Every function of the audit hook takes what it uses from its default arguments."""
    def code_objects(code):
        for const in code.co_consts:
            if hasattr(const, "co_code"):
                yield const
                yield from code_objects(const)

    builders = [c for c in code_objects(compile(_WRAPPER, "wrapper", "exec"))
                if c.co_name in ("_install_hook", "_path_checks", "_stand_ins")]
    assert len(builders) == 3
    inner = [c for builder in builders for c in code_objects(builder)]
    assert {"hook", "resolve", "inside", "target", "may_read", "check_open", "checked_open"} <= {c.co_name for c in inner}
    lookups = {(c.co_name, i.argval) for c in inner for i in dis.get_instructions(c)
               if i.opname in ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_CLASSDEREF", "STORE_GLOBAL")}
    assert lookups == set()


def test_rebinding_names_the_code_can_reach_does_not_open_the_hook(tmp_path):
    target = tmp_path / "escaped.txt"
    code = f"""
import builtins, os, posixpath, sys
TARGET = {str(target)!r}
main = sys.modules["__main__"]
print("fresh main:", main.__dict__ is globals())
for name in ("_inside", "_REFUSED", "_foreign_proc", "_hook", "_root", "_install_hook"):
    setattr(main, name, lambda *a, **k: True)
frame = sys._getframe()
while frame is not None:            # the wrapper's own module, through the frames
    if frame.f_globals is not globals():
        for name in list(frame.f_globals):
            if not name.startswith("__"):
                frame.f_globals[name] = lambda *a, **k: True
    frame = frame.f_back
os.path.realpath = posixpath.realpath = lambda *a, **k: os.getcwd()
try:
    open(TARGET, "w")
except Exception as error:
    hook_frame = error.__traceback__
    while hook_frame.tb_next is not None:
        hook_frame = hook_frame.tb_next
    hook_frame = hook_frame.tb_frame  # the hook's own frame: rebind its globals and builtins
    for name in list(hook_frame.f_globals):
        if not name.startswith("__"):
            hook_frame.f_globals[name] = lambda *a, **k: True
saved = dict(vars(builtins))
for name in ("isinstance", "issubclass", "len", "type", "str", "PermissionError", "OSError", "Exception"):
    setattr(builtins, name, lambda *a, **k: True)
try:
    open(TARGET, "w").write("pwned")
    outcome = "WROTE"
except BaseException as error:
    outcome = "refused: " + saved["str"](error)
vars(builtins).update(saved)
print(outcome)
"""
    result = run(code, AUDIT)
    assert "fresh main: True" in result.output
    assert "refused: sandbox: writing outside" in result.output and "WROTE" not in result.output
    assert not target.exists()


def test_finalizers_do_not_run_after_the_hook_is_gone(tmp_path):
    target = tmp_path / "escaped.txt"
    code = f"""
class Late:
    def __del__(self, open=open):
        open({str(target)!r}, "w").write("pwned")
late = Late()
cycle = Late()
cycle.me = cycle
print("done")
"""
    result = run(code, AUDIT)
    assert result.ok and result.output.strip() == "done"
    assert not target.exists()


@pytest.mark.parametrize("layers", [ALL, AUDIT, SECCOMP, NAMESPACES])
def test_fifo_outside_is_refused(tmp_path, layers):
    target = tmp_path / "fifo"
    result = run(f"import os\nos.mkfifo({str(target)!r})\nprint('made')", layers)
    if layers == NAMESPACES:
        require(result, "private_root")
    elif layers == SECCOMP:
        require(result, "seccomp")
    assert not result.ok and "made" not in result.output
    assert not target.exists()


@pytest.mark.parametrize("layers", [ALL, AUDIT, NAMESPACES])
def test_sqlite_outside_is_refused(tmp_path, layers):
    direct, attached = tmp_path / "direct.db", tmp_path / "attached.db"
    code = f"""
import sqlite3
for how in ("connect", "attach"):
    try:
        if how == "connect":
            db = sqlite3.connect({str(direct)!r})
        else:
            db = sqlite3.connect(":memory:")
            db.execute("ATTACH DATABASE '{attached}' AS other")
            db = db.execute("CREATE TABLE other.t (x)")
        print(how, "WROTE")
    except Exception as error:
        print(how, "refused", error)
"""
    result = run(code, layers)
    if layers == NAMESPACES:
        require(result, "private_root")
    assert "connect refused" in result.output and "attach refused" in result.output, result.output
    assert not direct.exists() and not attached.exists()


def test_file_changes_outside_through_descriptors_and_links_are_refused(tmp_path):
    """With the hook alone: changes named by a descriptor, relative to a directory descriptor or
    through a hard link are judged by where they land."""
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    os.chmod(victim, 0o644)
    before = (victim.stat().st_mode, victim.stat().st_mtime_ns)
    outside = str(tmp_path)
    code = f"""
import os, shutil
ops = {{
    "chmod fd": lambda: os.chmod(os.open({str(victim)!r}, os.O_RDONLY), 0o777),
    "utime fd": lambda: os.utime(os.open({str(victim)!r}, os.O_RDONLY), (0, 0)),
    "truncate": lambda: os.truncate({str(victim)!r}, 0),
    "link in": lambda: os.link({str(victim)!r}, "inside-link"),
    "remove dir_fd": lambda: os.remove("victim.txt", dir_fd=os.open({outside!r}, os.O_RDONLY)),
    "mkdir dir_fd": lambda: os.mkdir("made", dir_fd=os.open({outside!r}, os.O_RDONLY)),
    "open dir_fd": lambda: os.open("made.txt", os.O_CREAT | os.O_WRONLY, dir_fd=os.open({outside!r}, os.O_RDONLY)),
    "rename out": lambda: (open("mine.txt", "w").close(), os.rename("mine.txt", {outside + "/moved.txt"!r})),
    "copy out": lambda: shutil.copyfile("main.py", {outside + "/copied.py"!r}),
    "chdir out": lambda: os.chdir({outside!r}),
}}
for name, op in ops.items():
    try:
        op()
        print(name, "DONE")
    except Exception as error:
        print(name, "refused", type(error).__name__)
"""
    result = run(code, AUDIT)
    lines = result.output.strip().splitlines()
    assert len(lines) == 10 and all(" refused " in line for line in lines), result.output
    assert victim.read_text() == "original"
    assert (victim.stat().st_mode, victim.stat().st_mtime_ns) == before and victim.stat().st_nlink == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["victim.txt"]


@pytest.mark.parametrize("layers", [ALL, AUDIT])
def test_output_pipes_and_dev_null_can_be_written_not_a_file_reopened_through_proc(tmp_path, layers):
    """A file the code may read (a declared path) is not writable through ``/proc/self/fd``."""
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    code = f"""
print("via /dev/stdout", file=open("/dev/stdout", "w"))
open("/dev/null", "w").write("dropped")
readable = open({str(victim)!r})
print("read:", readable.read())
try:
    open(f"/proc/self/fd/{{readable.fileno()}}", "w").write("pwned")
    print("WROTE")
except OSError as error:
    print("refused:", error)
"""
    result = run_python(code, LIMITS, layers=layers, paths=[str(victim)])
    lines = result.output.strip().splitlines()
    assert lines[:2] == ["via /dev/stdout", "read: original"], result.output
    assert lines[2].startswith("refused:") and "WROTE" not in result.output, result.output
    assert victim.read_text() == "original"


def test_os_open_writes_where_its_path_lands(tmp_path):
    """``os.open`` is judged with its ``dir_fd``: relative to the working directory it writes, relative
    to a directory outside it is refused."""
    code = f"""
import os
os.close(os.open('made.txt', os.O_CREAT | os.O_WRONLY))
print(os.path.exists('made.txt'))
os.open('made.txt', os.O_CREAT | os.O_WRONLY, dir_fd=os.open({str(tmp_path)!r}, os.O_RDONLY))
"""
    for layers in (AUDIT, ALL):
        result = run(code, layers)
        assert result.output.startswith("True\n") and "not allowed" in result.output, result.output
        assert list(tmp_path.iterdir()) == []


FORK_EXEC = """
import _posixsubprocess, os
def spawn(argv, setsid=False):
    read, write = os.pipe()
    return _posixsubprocess.fork_exec([a.encode() for a in argv], [argv[0].encode()], True, (write,), None, None,
                                      -1, -1, -1, -1, -1, -1, read, write, True, setsid, -1, None, None, None, -1,
                                      None, False)
"""
needs_311_fork_exec = pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="fork_exec's 3.11 arguments")


@needs_311_fork_exec
@pytest.mark.parametrize("layers", [ALL, AUDIT, SECCOMP])
def test_posixsubprocess_fork_exec_is_refused(tmp_path, layers):
    marker = tmp_path / "shell-ran"
    result = run(FORK_EXEC + f"spawn(['/bin/sh', '-c', 'echo ran > {marker}'])\nprint('spawned')", layers)
    assert_refused(result, layers, "Operation not permitted", "fork_exec is not allowed", "spawned")
    assert not marker.exists()


@pytest.mark.parametrize("layers", [ALL, AUDIT, SECCOMP])
def test_fork_loop_gets_no_process(layers):
    code = """
import os
started, errors = 0, set()
for attempt in range(200):
    try:
        pid = os.fork() if attempt % 2 else os.posix_spawn("/bin/true", ["true"], {})
    except OSError as error:
        errors.add(str(error) if error.errno is None else f"errno {error.errno}")
        continue
    if pid == 0:
        os._exit(0)
    started += 1
    os.waitpid(pid, 0)
print("started", started)
print(sorted(errors))
"""
    result = run(code, layers)
    if layers == SECCOMP:
        require(result, "seccomp")
        expected = ["errno 1"]  # EPERM from the kernel
    else:
        expected = ["sandbox: os.fork is not allowed", "sandbox: os.posix_spawn is not allowed"]
    assert result.ok and result.output.splitlines() == ["started 0", repr(expected)]


SETSID_CHILD = """
import os, time
os.posix_spawn({python!r}, [{python!r}, "-c", "print('from-the-child', flush=True); import time; time.sleep({marker})"],
               {{}}, setsid=True)
time.sleep(0.5)
print("parent done", flush=True)
"""
#: The interpreter's own executable (what the sandbox's filesystem holds besides the standard library).
PYTHON = interpreter(sys.executable)["executable"]


def test_setsid_child_is_refused_with_every_guard():
    marker = f"{40 + uuid.uuid4().int % 1000 / 1000:.3f}"
    result = run(SETSID_CHILD.format(marker=marker, python=PYTHON))
    assert not result.ok and "posix_spawn is not allowed" in result.output
    assert processes_running(f"time.sleep({marker})") == []


def test_setsid_child_dies_with_the_pid_namespace():
    marker = f"{40 + uuid.uuid4().int % 1000 / 1000:.3f}"
    result = run(SETSID_CHILD.format(marker=marker, python=PYTHON), NAMESPACES)
    require(result, "pid_namespace")
    leftover = processes_running(f"time.sleep({marker})")
    for pid in leftover:
        os.kill(pid, signal.SIGKILL)
    assert result.ok and "from-the-child" in result.output and "parent done" in result.output
    assert result.seconds < 4.0
    assert leftover == []


def test_a_child_holding_the_pipe_does_not_hold_the_run():
    """No guard at all: a child in its own session keeps the output pipe open; the run still ends
    when its process does and keeps what was printed."""
    marker = f"{40 + uuid.uuid4().int % 1000 / 1000:.3f}"
    try:
        result = run(SETSID_CHILD.format(marker=marker, python=PYTHON), ())
    finally:
        for pid in processes_running(f"time.sleep({marker})"):
            os.kill(pid, signal.SIGKILL)
    assert result.guards == ()
    assert result.ok and "from-the-child" in result.output and "parent done" in result.output
    assert result.seconds < 3.0


@pytest.mark.parametrize("ignore_sigxcpu", [False, True])
def test_cpu_time_kill_is_a_timeout(ignore_sigxcpu):
    code = ("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\n" if ignore_sigxcpu else "") + \
        "print('before the loop')\nwhile True:\n    pass"
    result = run(code, limits=SandboxLimits(timeout_s=30.0, cpu_s=1))
    assert result.timed_out and result.cpu_exceeded and not result.ok
    expected = -signal.SIGKILL if ignore_sigxcpu else -signal.SIGXCPU  # ignored: the hard limit a second later
    assert result.exit_code == expected
    assert result.describe().endswith("[timed out: CPU time limit]")
    assert result.output.strip() == "before the loop"  # printed before the kill, kept
    assert result.seconds < 25.0


def test_sleeping_past_the_wall_clock_is_a_timeout_not_a_cpu_kill():
    result = run("import time\ntime.sleep(30)", limits=SandboxLimits(timeout_s=1.0, cpu_s=5))
    assert result.timed_out and not result.cpu_exceeded and result.exit_code is None
    assert result.describe().endswith("[timed out]")


@pytest.mark.parametrize("layers", [("audit", "seccomp"), AUDIT, SECCOMP])
def test_sockets_are_refused_without_the_network_namespace(layers):
    result = run("import socket\ns = socket.socket()\nprint('made a socket')", layers)
    assert "network_namespace" not in result.guards
    assert_refused(result, layers, "Permission denied", "socket.__new__ is not allowed", "made a socket")


def test_threads_still_work():
    code = """
import threading
out = []
threads = [threading.Thread(target=out.append, args=(n,)) for n in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(sorted(out))
"""
    result = run(code)
    assert result.ok and result.output.strip() == "[0, 1, 2, 3]"


def test_unknown_layers_are_refused():
    with pytest.raises(ValueError, match="unknown"):
        run_python("print(1)", layers=("audit", "chroot"))
