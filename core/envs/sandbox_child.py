"""The script the sandboxed child runs (``python -I -B -u .wrapper.py CONFIG``): namespaces, limits,
seccomp, the audit hook, then the user's ``main.py`` in a fresh ``__main__`` module.

:func:`rlcore.envs.sandbox.run_python` copies this file's source into the run's directory; it is
never imported by rlcore (it imports nothing but the standard library)."""

import json
import os
import resource
import signal
import sys

_NEWNS, _NEWUSER, _NEWPID, _NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000


def _libc():
    try:
        import ctypes
        return ctypes, ctypes.CDLL(None, use_errno=True)
    except Exception:  # noqa: BLE001 - no libc: the guards that need it are skipped
        return None, None


def _readonly_mounts(ctypes, libc, root):
    """In a new mount namespace: every mount read-only (Linux 5.12+), the working directory not."""
    class Attr(ctypes.Structure):
        _fields_ = [(name, ctypes.c_uint64) for name in ("set", "clear", "propagation", "userns")]

    def mount_setattr(path, set_, clear):
        attr = Attr(set_, clear, 0, 0)
        return libc.syscall(ctypes.c_long(442), ctypes.c_long(-100), ctypes.c_char_p(path), ctypes.c_long(0x8000),
                            ctypes.byref(attr), ctypes.c_long(ctypes.sizeof(attr))) == 0

    here = root.encode()
    # MS_REC | MS_PRIVATE first: nothing done here may reach the parent namespace
    if libc.mount(b"none", b"/", None, ctypes.c_ulong(0x4000 | 0x40000), None) != 0:
        return False
    if libc.mount(here, here, None, ctypes.c_ulong(0x1000 | 0x4000), None) != 0:  # MS_BIND | MS_REC
        return False
    if not (mount_setattr(b"/", 1, 0) and mount_setattr(here, 0, 1)):  # MOUNT_ATTR_RDONLY, recursively
        return False
    os.chdir(root)  # the working directory on the new (writable) mount, not the one beneath it
    return True


def _namespaces(ctypes, libc, root):
    for flags in (_NEWUSER | _NEWNET | _NEWNS | _NEWPID, _NEWNET | _NEWNS | _NEWPID, _NEWUSER | _NEWNET | _NEWNS,
                  _NEWNET | _NEWNS, _NEWUSER | _NEWNET, _NEWNET):
        if libc.unshare(flags) == 0:
            break
    else:
        return set()
    held = {"network_namespace"}
    if flags & _NEWUSER:
        held.add("user_namespace")
    if flags & _NEWPID:
        held.add("pid_namespace")
    if flags & _NEWNS and _readonly_mounts(ctypes, libc, root):
        held.add("readonly_mounts")
    return held


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


def _enter_pid_namespace(report):
    """After unshare(CLONE_NEWPID): fork the namespace's init, which forks the worker and waits for
    it; when init exits the kernel kills everything left in the namespace. Returns in the worker
    (False: no fork, the code runs here, outside a PID namespace)."""
    reader, writer = os.pipe()
    try:
        init = os.fork()
    except OSError:  # no process to spare: run without the PID namespace
        os.close(reader)
        os.close(writer)
        return False
    if init:
        os.close(writer)
        os.close(report)
        os.waitpid(init, 0)
        data = os.read(reader, 32)
        _mirror(int(data) if data else 9)  # no word from init: it was killed
    os.close(reader)
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
    return True


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


# syscall numbers: (audit arch, x32 numbers to refuse, refused, socket, clone, clone3, signal calls)
_SYSCALLS = {
    "x86_64": (0xC000003E, True,
               (57, 58, 59, 322, 133, 259, 272, 308, 165, 166, 155, 161, 101, 310, 311, 321, 298, 248, 249, 250,
                425, 428, 429, 430, 431, 432, 442, 246, 175, 313, 323, 200, 424, 434, 438),
               41, 56, 435, (62, 234, 129, 297)),
    "aarch64": (0xC00000B7, False,
                (221, 281, 33, 97, 268, 40, 39, 41, 51, 117, 270, 271, 280, 241, 217, 218, 219,
                 425, 428, 429, 430, 431, 432, 442, 104, 105, 273, 282, 130, 424, 434, 438),
                198, 220, 435, (129, 131, 138, 240)),
}


def _seccomp(ctypes, libc):
    import struct
    table = _SYSCALLS.get(os.uname().machine)
    if table is None or libc is None:
        return False
    arch, x32, refused, socket_nr, clone_nr, clone3_nr, signal_nrs = table
    load, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, errno = 0x7FFF0000, 0x00050000
    program, labels = [], {}

    def emit(code, k, jt=0, jf=0):
        program.append([code, jt, jf, k])

    emit(load, 4)                      # seccomp_data.arch
    emit(jeq, arch, 0, "enosys")
    emit(load, 0)                      # seccomp_data.nr
    if x32:
        emit(jge, 0x40000000, "enosys", 0)
    for number in refused:
        emit(jeq, number, "eperm", 0)
    emit(jeq, socket_nr, "eacces", 0)
    emit(jeq, clone3_nr, "enosys", 0)  # the C library falls back to clone, whose flags can be read
    emit(jeq, clone_nr, "clone", 0)
    for number in signal_nrs:
        emit(jeq, number, "signal", 0)
    emit(ret, allow)
    labels["clone"] = len(program)
    emit(load, 16)                     # args[0], low half: the clone flags
    emit(jset, 0x7E020000, "eperm", 0)  # CLONE_NEW*: no namespaces, not even for a thread
    emit(jset, 0x00010000, "allow", "eperm")  # CLONE_THREAD: a thread, not a process
    labels["signal"] = len(program)
    emit(load, 16)                     # args[0]: the target process
    emit(jeq, os.getpid(), "allow", "eperm")
    for name, value in (("allow", allow), ("eperm", errno | 1), ("eacces", errno | 13), ("enosys", errno | 38)):
        labels[name] = len(program)
        emit(ret, value)
    for index, ins in enumerate(program):
        for slot in (1, 2):
            if isinstance(ins[slot], str):
                ins[slot] = labels[ins[slot]] - index - 1
    blob = b"".join(struct.pack("HBBI", *ins) for ins in program)
    buffer = ctypes.create_string_buffer(blob, len(blob))

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = Program(len(program), ctypes.cast(buffer, ctypes.c_void_p))
    ulong = ctypes.c_ulong
    if libc.prctl(38, ulong(1), ulong(0), ulong(0), ulong(0)) != 0:  # PR_SET_NO_NEW_PRIVS
        return False
    return libc.prctl(22, ulong(2), ctypes.byref(prog), ulong(0), ulong(0)) == 0  # PR_SET_SECCOMP, FILTER


def _install_hook(root, confined):
    """Install the audit hook. Its functions read no global or builtin name: all they use is bound
    here, as default arguments, so nothing the code can rebind changes their decisions."""
    import posix
    from types import MappingProxyType

    refused = frozenset((
        "os.fork", "os.forkpty", "os.system", "os.startfile", "os.kill", "os.killpg", "subprocess.Popen",
        "_posixsubprocess.fork_exec", "signal.pthread_kill", "os.symlink",
        "os.setxattr", "os.removexattr", "os.chflags", "os.lchflags", "os.add_dll_directory", "sys.addaudithook",
        "sys.settrace", "sys.setprofile", "sys._current_frames", "sys._current_exceptions",
        "fcntl.ioctl", "cpython.PyInterpreterState_New", "sqlite3.enable_load_extension",
        "sqlite3.load_extension"))
    prefixes = ("socket.", "ctypes.", "mmap.", "os.exec", "os.spawn", "os.posix_spawn", "gc.get_", "resource.",
                "pty.", "webbrowser.", "urllib.", "http.", "ftplib.", "smtplib.", "poplib.", "imaplib.",
                "nntplib.", "telnetlib.")
    # event -> (index of a path argument, index of its dir_fd argument or None), for events that change files
    writes = MappingProxyType({
        "os.chmod": ((0, 2),), "os.chown": ((0, 3),), "os.link": ((0, 2), (1, 3)), "os.mkdir": ((0, 2),),
        "os.remove": ((0, 1),), "os.rename": ((0, 2), (1, 3)), "os.rmdir": ((0, 1),), "os.truncate": ((0, None),),
        "os.utime": ((0, 3),), "os.chdir": ((0, None),), "shutil.copyfile": ((1, None),),
        "shutil.copymode": ((1, None),), "shutil.copystat": ((1, None),), "shutil.copytree": ((1, None),),
        "shutil.move": ((0, None), (1, None)), "shutil.rmtree": ((0, 1),), "shutil.chown": ((0, None),),
        "shutil.make_archive": ((0, None),), "shutil.unpack_archive": ((1, None),),
        "tempfile.mkstemp": ((0, None),), "tempfile.mkdtemp": ((0, None),)})
    # modules whose native functions raise no audit event: a fresh copy may not be imported
    fresh = frozenset(("posix", "_posixsubprocess", "_posixshmem", "_signal", "_xxsubinterpreters",
                       "_xxinterpchannels", "_testcapi", "_testinternalcapi", "_testmultiphase", "_testbuffer",
                       "_testsinglephase", "_testimportmultiple", "_cffi_backend"))
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    root = os.path.realpath(root)
    own = posix.readlink("/proc/self") if os.path.exists("/proc/self") else str(os.getpid())

    def text(path, _type=type, _str=str, _bytes=bytes, _sub=issubclass, _join=str.join, _bjoin=bytes.join,
             _decode=bytes.decode):
        kind = _type(path)
        if kind is _str:
            return path
        if kind is _bytes:
            return _decode(path, "utf-8", "surrogateescape")
        if _sub(kind, _str):
            return _join("", (path,))  # the characters the C code saw, whatever the subclass overrides
        if _sub(kind, _bytes):
            return _decode(_bjoin(b"", (path,)), "utf-8", "surrogateescape")
        return None

    def fd_path(fd, _readlink=posix.readlink, _startswith=str.startswith, _error=Exception):
        try:
            where = _readlink("/proc/self/fd/%d" % fd)
        except _error:
            return None
        return where if _startswith(where, "/") else None

    def target(path, dir_fd, _type=type, _int=int, _text=text, _fd_path=fd_path, _getcwd=posix.getcwd,
               _startswith=str.startswith):
        """The absolute path an event's argument names (``None``: unknown)."""
        if _type(path) is _int:
            return _fd_path(path)
        name = _text(path)
        if name is None:
            return None
        if _startswith(name, "/"):
            return name
        if dir_fd is None or (_type(dir_fd) is _int and dir_fd < 0):
            base = _getcwd()
        elif _type(dir_fd) is _int:
            base = _fd_path(dir_fd)
        else:
            return None
        return None if base is None else base + "/" + name

    def resolve(path, follow, _lstat=posix.lstat, _readlink=posix.readlink, _split=str.split, _join=str.join,
                _startswith=str.startswith, _error=OSError):
        """``path`` (absolute) with symbolic links resolved (the last one only if ``follow``)."""
        todo = _split(path, "/")
        todo.reverse()
        out, hops = [], 0
        while todo:
            name = todo.pop()
            if name == "" or name == ".":
                continue
            if name == "..":
                if out:
                    out.pop()
                continue
            if not todo and not follow:
                out.append(name)
                break
            here = "/" + _join("/", out + [name])
            try:
                mode = _lstat(here)[0]
            except _error:
                out.append(name)
                continue
            if mode & 0o170000 == 0o120000:
                hops += 1
                if hops > 40:
                    raise _error("too many symbolic links")
                link = _readlink(here)
                if _startswith(link, "/"):
                    out = []
                more = _split(link, "/")
                more.reverse()
                todo += more
                continue
            out.append(name)
        return "/" + _join("/", out)

    def inside(path, _resolve=resolve, _root=root, _prefix=root + "/", _startswith=str.startswith):
        for follow in (True, False):
            real = _resolve(path, follow)
            if real != _root and not _startswith(real, _prefix):
                return False
        return True

    def foreign_proc(path, _resolve=resolve, _split=str.split, _isdigit=str.isdigit, _len=len, _own=own):
        parts = _split(_resolve(path, True), "/")
        return _len(parts) > 2 and parts[1] == "proc" and _isdigit(parts[2]) and parts[2] != _own

    def hook(event, args, _refused=refused, _prefixes=prefixes, _writes=writes, _fresh=fresh, _writing=writing,
             _confined=confined, _target=target, _text=text, _inside=inside, _resolve=resolve, _foreign=foreign_proc,
             _startswith=str.startswith, _type=type, _int=int, _str=str, _len=len,
             _own_pipe="/proc/%s/fd/pipe:[" % own, _denied=PermissionError, _error=Exception, _exit=os._exit):
        if event in _refused or _startswith(event, _prefixes):
            raise _denied("sandbox: %s is not allowed" % event)
        spec = _writes.get(event)
        if spec is not None:
            for index, dir_index in spec:
                if index >= _len(args) or args[index] is None:
                    continue
                dir_fd = args[dir_index] if dir_index is not None and dir_index < _len(args) else None
                try:
                    where = _target(args[index], dir_fd)
                    ok = where is not None and _inside(where)
                except _error:
                    where, ok = None, False
                if not ok:
                    raise _denied("sandbox: %s outside the working directory is not allowed: %s"
                                  % (event, where or "(unknown path)"))
        elif event == "open":
            path, mode, flags = args
            if _type(path) is _int:
                return  # an already open file descriptor
            try:
                where = _target(path, None)
                foreign = where is not None and _foreign(where)
            except _error:
                where, foreign = None, False
            if where is None:
                raise _denied("sandbox: open of a path the sandbox cannot place is not allowed")
            if foreign:
                raise _denied("sandbox: reading other processes' files is not allowed: %s" % where)
            if _type(flags) is _int and flags & _writing:
                name = _text(path)
                if mode is None and not _confined and not _startswith(name, "/"):
                    raise _denied("sandbox: os.open needs an absolute path to write (dir_fd is not checked)")
                try:
                    real = _resolve(where, True)
                    ok = (_inside(where) or (real == "/dev/null" == _resolve(where, False))
                          or _startswith(real, _own_pipe))  # /dev/stdout, /dev/stderr
                except _error:
                    ok = False
                if not ok:
                    raise _denied("sandbox: writing outside the working directory is not allowed: %s" % where)
        elif event == "import":
            name = args[0]
            if _type(name) is _str and name in _fresh:
                raise _denied("sandbox: importing a fresh %s is not allowed" % name)
        elif event == "sqlite3.connect":
            name = _text(args[0])
            if not _confined:  # ATTACH DATABASE writes files with no audit event
                raise _denied("sandbox: sqlite3.connect is not allowed without the read-only mount layer")
            if name is None or _startswith(name, "file:"):
                raise _denied("sandbox: sqlite3.connect needs a plain path")
            if name != ":memory:" and name != "":
                where = _target(name, None)
                if where is None or not _inside(where):
                    raise _denied("sandbox: sqlite3.connect outside the working directory is not allowed: %s"
                                  % where)
        elif event == "cpython.PyInterpreterState_Clear":
            _exit(1)  # finalization drops the hooks next and would run the code's finalizers unwatched

    def refusing(name, _denied=PermissionError):
        def refused(*args, _message="sandbox: %s is not allowed" % name, _denied=_denied, **kwargs):
            raise _denied(_message)
        return refused

    replaced = [("posix", ("mkfifo", "mknod", "pidfd_open")), ("os", ("mkfifo", "mknod", "pidfd_open")),
                ("_signal", ("pidfd_send_signal",)), ("signal", ("pidfd_send_signal",)),
                ("_posixsubprocess", ("fork_exec",)), ("_posixshmem", ("shm_open", "shm_unlink"))]
    for module_name, names in replaced:
        try:
            module = __import__(module_name)
        except ImportError:
            continue
        for name in names:
            if hasattr(module, name):
                setattr(module, name, refusing(module_name + "." + name))
    sys.addaudithook(hook)


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


def _main():
    cfg = json.loads(sys.argv[1])
    layers, report = set(cfg["layers"]), cfg["report"]
    ctypes, libc = _libc()
    if libc is not None:
        libc.prctl(4, ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))  # not dumpable
    guards = set()
    if "namespaces" in layers and libc is not None:
        guards = _namespaces(ctypes, libc, cfg["root"])
        if "pid_namespace" in guards and not _enter_pid_namespace(report):
            guards.discard("pid_namespace")
    _limits(cfg)
    if "seccomp" in layers and _seccomp(ctypes, libc):
        guards.add("seccomp")
    if "audit" in layers:
        guards.add("audit")
    os.write(report, ",".join(sorted(guards)).encode())
    os.close(report)
    if "audit" in layers:
        _install_hook(cfg["root"], "readonly_mounts" in guards)
    _run(cfg["root"])


if __name__ == "__main__":
    _main()
