"""The script the sandboxed child runs (``python -I -S -B -u -c BOOT SCRIPT CONFIG``): namespaces and a
filesystem of its own, limits, seccomp, the audit hook, then the user's code as ``main.py`` in a fresh
``__main__`` module.

:func:`rlcore.envs.sandbox.run_python` runs :mod:`rlcore.envs.sandbox_fs`,
:mod:`rlcore.envs.sandbox_hook` and this file, in that order, as one script; they are never imported
by rlcore (they import nothing but the standard library)."""
# ruff: noqa: F821 - the functions of sandbox_fs.py and sandbox_hook.py are defined above this file in the script

import json
import os
import resource
import signal
import sys

_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE = 1, 4


def _libc():
    try:
        import ctypes
        return ctypes, ctypes.CDLL(None, use_errno=True)
    except Exception:  # noqa: BLE001 - no libc: the guards that need it are skipped
        return None, None


def _mirror(status):
    """End this process as the worker ended (its exit code, or killed by the same signal)."""
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            signal.signal(number, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
        os.kill(os.getpid(), number)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def _enter_pid_namespace(report, setup, die):
    """After unshare(CLONE_NEWPID): fork the namespace's init, which runs ``setup()`` (the filesystem:
    its ``/proc`` is the new namespace's), forks the worker and waits for it; when init exits the
    kernel kills everything left in the namespace. Returns in the worker: whether it is in the PID
    namespace (False: no fork, the code runs here, outside one) and what ``setup()`` returned."""
    reader, writer = os.pipe()
    try:
        init = os.fork()
    except OSError:  # no process to spare: run without the PID namespace
        os.close(reader)
        os.close(writer)
        return False, False
    if init:
        os.close(writer)
        os.close(report)
        os.waitpid(init, 0)
        data = os.read(reader, 32)
        _mirror(int(data) if data else 9)  # no word from init: it was killed
    os.close(reader)
    die()  # init dies with the process that started it, and the namespace with init
    try:
        built = setup()
    except OSError:
        built = False
    try:
        worker = os.fork()
    except OSError:
        os.write(2, b"sandbox: no process to run the code in\n")
        os.write(writer, b"256")  # a wait status: exit code 1
        os._exit(0)
    if worker:
        os.close(report)
        status = 9  # a wait status: killed by SIGKILL
        while True:
            try:
                pid, got = os.waitpid(-1, 0)  # orphans of the namespace come here too
            except ChildProcessError:
                break
            if pid == worker:
                status = got
                break
        os.write(writer, str(status).encode())
        os._exit(0)
    os.close(writer)
    return True, built


def _limits(cfg):
    def limit(kind, soft, hard):
        try:
            _, ceiling = resource.getrlimit(kind)
            if ceiling != resource.RLIM_INFINITY:
                hard = min(hard, ceiling)
            resource.setrlimit(kind, (min(soft, hard), hard))
        except (ValueError, OSError):
            pass
    limit(resource.RLIMIT_CPU, cfg["cpu"], cfg["cpu"] + 1)  # SIGXCPU at the soft limit, SIGKILL a second later
    limit(resource.RLIMIT_AS, cfg["memory"], cfg["memory"])
    limit(resource.RLIMIT_FSIZE, cfg["fsize"], cfg["fsize"])
    limit(resource.RLIMIT_NOFILE, 64, 64)
    limit(resource.RLIMIT_CORE, 0, 0)
    limit(resource.RLIMIT_NPROC, cfg["nproc"], cfg["nproc"])


# syscall numbers per machine: refused outright; allowed only on the process itself (args[0] 0 or its
# own id: scheduling, limits, memory policy; signals: its own id only); fcntl and ioctl, whose commands
# that make another process the target of SIGIO are refused (F_SETOWN, F_SETSIG, F_SETOWN_EX,
# FIOSETOWN, SIOCSPGRP); socket, clone and clone3.
_SYSCALLS = {
    "x86_64": {"arch": 0xC000003E, "x32": True,
               "refused": (57, 58, 59, 322, 133, 259, 272, 308, 165, 166, 155, 161, 101, 310, 311, 321, 298, 248,
                           249, 250, 425, 428, 429, 430, 431, 432, 442, 246, 175, 313, 323, 200, 424, 434, 438,
                           319, 447, 303, 304, 29, 141, 251, 312, 440, 448),
               "self": (142, 144, 203, 314, 302, 256, 279), "signal": (62, 234, 129, 297),
               "fcntl": 72, "ioctl": 16, "socket": 41, "clone": 56, "clone3": 435},
    "aarch64": {"arch": 0xC00000B7, "x32": False,
                "refused": (221, 281, 33, 97, 268, 40, 39, 41, 51, 117, 270, 271, 280, 241, 217, 218, 219,
                            425, 428, 429, 430, 431, 432, 442, 104, 105, 273, 282, 130, 424, 434, 438,
                            279, 447, 264, 265, 194, 140, 30, 272, 440, 448),
                "self": (118, 119, 122, 274, 261, 238, 239), "signal": (129, 131, 138, 240),
                "fcntl": 25, "ioctl": 29, "socket": 198, "clone": 220, "clone3": 435},
}


def _seccomp(ctypes, libc):
    import struct
    table = _SYSCALLS.get(os.uname().machine)
    if table is None or libc is None:
        return False
    load, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, errno = 0x7FFF0000, 0x00050000
    program, labels = [], {}

    def emit(code, k, jt=0, jf=0):
        program.append([code, jt, jf, k])

    emit(load, 4)                      # seccomp_data.arch
    emit(jeq, table["arch"], 0, "enosys")
    emit(load, 0)                      # seccomp_data.nr
    if table["x32"]:
        emit(jge, 0x40000000, "enosys", 0)
    for number in table["refused"]:
        emit(jeq, number, "eperm", 0)
    emit(jeq, table["socket"], "eacces", 0)
    emit(jeq, table["clone3"], "enosys", 0)  # the C library falls back to clone, whose flags can be read
    for name in ("clone", "fcntl", "ioctl"):
        emit(jeq, table[name], name, 0)
    for name in ("signal", "self"):
        for number in table[name]:
            emit(jeq, number, name, 0)
    emit(ret, allow)
    labels["clone"] = len(program)
    emit(load, 16)                     # args[0], low half: the clone flags
    emit(jset, 0x7E020000, "eperm", 0)  # CLONE_NEW*: no namespaces, not even for a thread
    emit(jset, 0x00010000, "allow", "eperm")  # CLONE_THREAD: a thread, not a process
    labels["self"] = len(program)
    emit(load, 16)                     # args[0]: the target process, 0 for this one
    emit(jeq, 0, "allow", 0)
    labels["signal"] = len(program)
    emit(load, 16)                     # args[0]: the target process
    emit(jeq, os.getpid(), "allow", "eperm")
    for name, commands in (("fcntl", (8, 10, 15)), ("ioctl", (0x8901, 0x8902))):
        labels[name] = len(program)
        emit(load, 24)                 # args[1]: the command
        for command in commands:
            emit(jeq, command, "eperm", 0)
        emit(ret, allow)
    for name, value in (("allow", allow), ("eperm", errno | 1), ("eacces", errno | 13), ("enosys", errno | 38)):
        labels[name] = len(program)
        emit(ret, value)
    for index, ins in enumerate(program):
        for slot in (1, 2):
            if isinstance(ins[slot], str):
                ins[slot] = labels[ins[slot]] - index - 1
                if ins[slot] > 255:  # a jump past what BPF can say: no filter rather than a wrong one
                    return False
    blob = b"".join(struct.pack("HBBI", *ins) for ins in program)
    buffer = ctypes.create_string_buffer(blob, len(blob))

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = Program(len(program), ctypes.cast(buffer, ctypes.c_void_p))
    ulong = ctypes.c_ulong
    if libc.prctl(38, ulong(1), ulong(0), ulong(0), ulong(0)) != 0:  # PR_SET_NO_NEW_PRIVS
        return False
    return libc.prctl(22, ulong(2), ctypes.byref(prog), ulong(0), ulong(0)) == 0  # PR_SET_SECCOMP, FILTER


def _exit_status(code):
    if code is None:
        return 0
    if type(code) is int:
        return code
    try:
        sys.stderr.write(str(code) + "\n")
    except Exception:  # noqa: BLE001 - stderr itself is gone: nothing left to tell
        pass
    return 1


def _run(root, _exit=os._exit, _type=type, _int=int, _sys=sys, _join=os.path.join):
    """Run main.py in a fresh ``__main__`` module, then end with ``os._exit`` whatever happens (what
    the wrapper needs after the code ran is bound here: its module's names can be rebound)."""
    status = 1
    try:
        import atexit
        import traceback
        import types
        module = types.ModuleType("__main__")
        module.__builtins__ = __builtins__
        _sys.modules["__main__"] = module
        _sys.argv = ["main.py"]
        try:
            with open(_join(root, "main.py"), encoding="utf-8") as f:
                source = f.read()
            exec(compile(source, "main.py", "exec"), module.__dict__)
            status = 0
        except SystemExit as error:
            status = _exit_status(error.code)
        except BaseException as error:  # noqa: BLE001 - anything the user's code raises: its frames only
            _sys.stderr.write("".join(traceback.format_exception(type(error), error, error.__traceback__.tb_next)))
            status = 1
        try:
            threading = _sys.modules.get("threading")
            if threading is not None:
                threading._shutdown()  # non-daemon threads finish, as at a normal exit
            atexit._run_exitfuncs()
        finally:
            for stream in (_sys.stdout, _sys.stderr):
                try:
                    stream.flush()
                except BaseException:  # noqa: BLE001 - a stream the user's code broke
                    pass
    finally:
        try:
            _exit(status if _type(status) is _int else 1)
        finally:
            _exit(1)


def _prctl(ctypes, libc, option, value):
    ulong = ctypes.c_ulong
    return libc.prctl(option, ulong(value), ulong(0), ulong(0), ulong(0)) == 0


def _isolate(cfg, ctypes, libc, report):
    """The OS layer: namespaces and a filesystem of the run's own (``isolation`` ``namespaces``), or,
    where there is none and the trainer is root, another user. Returns (guards, working directory)."""
    root, guards = cfg["root"], set()
    if cfg["isolation"] == "namespaces":
        guards = _namespaces(libc)
    if "pid_namespace" in guards:
        entered, built = _enter_pid_namespace(report, lambda: _private_root(
            ctypes, libc, cfg["fs"], root, cfg["inner"], cfg["disk"], True),
            lambda: _prctl(ctypes, libc, _PR_SET_PDEATHSIG, 9))
        if not entered:
            guards.discard("pid_namespace")
        elif built and _drop_capabilities(ctypes, libc):
            guards.add("private_root")
            root = cfg["inner"]
        else:  # half built: the host's tree as it was, or nothing at all
            libc.umount2(root.encode(), ctypes.c_int(2))
    if "private_root" not in guards:
        os.chdir(root)
        if cfg.get("uid") is not None and os.geteuid() == 0 and _other_user(cfg["uid"]):
            guards.add("separate_user")
        _prctl(ctypes, libc, _PR_SET_PDEATHSIG, 9)  # a change of user clears it
        if "pid_namespace" not in guards and os.getppid() != cfg["parent"]:  # the trainer died before it was set
            os._exit(1)
    return guards, root


def _main():
    cfg = json.loads(sys.argv[-1])
    layers, report = set(cfg["layers"]), cfg["report"]
    with open(cfg["code"], encoding="utf-8") as f:  # a descriptor: the trainer wrote the code there
        source = f.read()
    ctypes, libc = _libc()
    guards, root = set(), cfg["root"]
    if libc is not None:
        _prctl(ctypes, libc, _PR_SET_DUMPABLE, 0)
        _prctl(ctypes, libc, _PR_SET_PDEATHSIG, 9)  # SIGKILL when the trainer's thread that started it ends
        if "namespaces" in layers and cfg["isolation"] != "bubblewrap":
            guards, root = _isolate(cfg, ctypes, libc, report)
    with open(os.path.join(root, "main.py"), "w", encoding="utf-8") as f:
        f.write(source)
    _limits(cfg)
    if cfg["isolation"] == "bubblewrap":  # the namespace's init: the kernel's SIGXCPU would be ignored
        signal.signal(signal.SIGXCPU, lambda *_: os._exit(128 + signal.SIGXCPU))
    if "seccomp" in layers and _seccomp(ctypes, libc):
        guards.add("seccomp")
    if "audit" in layers:
        guards.add("audit")
    os.write(report, ",".join(sorted(guards)).encode())
    os.close(report)
    sys.path.extend(path for path, directory in cfg["fs"]["declared"] if directory)  # importable, as declared
    if "audit" in layers:
        confined = "private_root" in guards or cfg["isolation"] == "bubblewrap"
        _install_hook(root, confined, cfg["fs"]["readable"])
    _run(root)


if __name__ == "__main__":
    _main()
