"""Part of the script the sandboxed child runs (see :mod:`rlcore.envs.sandbox_child`): the PEP 578
audit hook, and refusing or checking stand-ins for the functions that raise no audit event. Standard
library only; never imported by rlcore."""

import os
import sys


def _path_checks(root, readable):
    """The path functions of the hook, bound to ``root`` (the working directory) and ``readable``
    (what else the code may read): ``(text, target, resolve, inside, may_read, foreign_proc)``."""
    import posix

    root = os.path.realpath(root)
    own = posix.readlink("/proc/self") if os.path.exists("/proc/self") else str(os.getpid())
    readable = tuple(readable) + (root, "/proc/" + own)

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

    def foreign_proc(path, follow=True, _resolve=resolve, _split=str.split, _isdigit=str.isdigit, _len=len,
                     _own=own):
        parts = _split(_resolve(path, follow), "/")
        return _len(parts) > 2 and parts[1] == "proc" and _isdigit(parts[2]) and parts[2] != _own

    def may_read(path, _resolve=resolve, _readable=readable, _startswith=str.startswith, _len=len):
        """Whether ``path`` lands (links resolved) in the working directory, the standard library, a
        declared path, the process's own ``/proc`` entry or a harmless device."""
        real = _resolve(path, True)
        for allowed in _readable:
            if real == allowed or (_startswith(real, allowed) and real[_len(allowed):_len(allowed) + 1] == "/"):
                return True
        return False

    return text, target, resolve, inside, may_read, foreign_proc, own


def _install_hook(root, confined, readable):
    """Install the audit hook. Its functions read no global or builtin name: all they use is bound
    here, as default arguments, so nothing the code can rebind changes their decisions. ``confined``:
    the run has a filesystem of its own (files the hook cannot see being written land in it)."""
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
    text, target, resolve, inside, may_read, foreign, own = _path_checks(root, readable)

    def check_open(path, flags, dir_fd, _target=target, _foreign=foreign, _may_read=may_read, _inside=inside,
                   _resolve=resolve, _type=type, _int=int, _startswith=str.startswith, _denied=PermissionError,
                   _error=Exception, _writing=os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC,
                   _own_pipe="/proc/%s/fd/pipe:[" % own):
        """Refuse opening ``path`` (relative to ``dir_fd``) with ``flags`` unless it may be read and,
        to write, lands in the working directory (or is ``/dev/null`` or the run's own output).
        Returns the absolute path."""
        try:
            where = _target(path, dir_fd)
            foreign, readable = (False, False) if where is None else (_foreign(where), _may_read(where))
        except _error:
            where, foreign, readable = None, False, False
        if where is None:
            raise _denied("sandbox: open of a path the sandbox cannot place is not allowed")
        if foreign:
            raise _denied("sandbox: reading other processes' files is not allowed: %s" % where)
        if _type(flags) is _int and flags & _writing:
            try:
                real = _resolve(where, True)
                ok = (_inside(where) or (real == "/dev/null" == _resolve(where, False))
                      or _startswith(real, _own_pipe))  # /dev/stdout, /dev/stderr
            except _error:
                ok = False
            if not ok:
                raise _denied("sandbox: writing outside the working directory is not allowed: %s" % where)
        elif not readable:
            raise _denied("sandbox: reading outside the working directory and the standard library is not "
                          "allowed: %s" % where)
        return where

    def check_writes(event, args, spec, _target=target, _inside=inside, _len=len, _denied=PermissionError,
                     _error=Exception):
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

    def check_sqlite(path, _confined=confined, _text=text, _target=target, _inside=inside,
                     _startswith=str.startswith, _denied=PermissionError):
        name = _text(path)
        if not _confined:  # ATTACH DATABASE writes files with no audit event
            raise _denied("sandbox: sqlite3.connect is not allowed without a filesystem of the run's own")
        if name is None or _startswith(name, "file:"):
            raise _denied("sandbox: sqlite3.connect needs a plain path")
        if name != ":memory:" and name != "":
            where = _target(name, None)
            if where is None or not _inside(where):
                raise _denied("sandbox: sqlite3.connect outside the working directory is not allowed: %s" % where)

    def hook(event, args, _refused=refused, _prefixes=prefixes, _writes=writes, _fresh=fresh, _open=check_open,
             _check_writes=check_writes, _sqlite=check_sqlite, _startswith=str.startswith, _type=type, _int=int,
             _str=str, _denied=PermissionError, _exit=os._exit,
             _frozen=frozenset(("__code__", "__defaults__", "__kwdefaults__")), _owner=frozenset((8, 10, 15)),
             _function=type(_path_checks), _script=_path_checks.__code__.co_filename):
        if event in _refused or _startswith(event, _prefixes):
            raise _denied("sandbox: %s is not allowed" % event)
        spec = _writes.get(event)
        if spec is not None:
            _check_writes(event, args, spec)
        elif event == "open":
            if _type(args[0]) is not _int:  # not an already open file descriptor
                _open(args[0], args[2], None)
        elif event == "os.listdir" or event == "os.scandir":
            _open("." if args[0] is None else args[0], 0, None)
        elif event == "object.__setattr__" or event == "object.__delattr__":  # of the wrapper's functions
            if _type(args[0]) is _function and args[1] in _frozen and args[0].__code__.co_filename == _script:
                raise _denied("sandbox: setting %s of the sandbox's functions is not allowed" % args[1])
        elif event == "fcntl.fcntl":
            if args[1] in _owner:  # F_SETOWN, F_SETSIG, F_SETOWN_EX: signals to another process
                raise _denied("sandbox: fcntl command %d is not allowed" % args[1])
        elif event == "import":
            if _type(args[0]) is _str and args[0] in _fresh:
                raise _denied("sandbox: importing a fresh %s is not allowed" % args[0])
        elif event == "sqlite3.connect":
            _sqlite(args[0])
        elif event == "cpython.PyInterpreterState_Clear":
            _exit(1)  # finalization drops the hooks next and would run the code's finalizers unwatched

    def check_link(path, dir_fd, _target=target, _foreign=foreign, _denied=PermissionError, _error=Exception):
        """Refuse reading a link of another process's ``/proc`` entry (its working directory, its files).
        Returns the absolute path."""
        try:
            where = _target(path, dir_fd)
            refuse = where is None or _foreign(where, False)
        except _error:
            where, refuse = None, True
        if refuse:
            raise _denied("sandbox: reading this link is not allowed: %s" % (where or "(unknown path)"))
        return where

    _stand_ins(check_open, check_link)
    sys.addaudithook(hook)


def _stand_ins(check_open, check_link):
    """Replace the functions that raise no audit event (or none that names their ``dir_fd``) by
    refusing ones, and ``os.open``/``os.readlink`` by ones that judge the path their ``dir_fd`` names."""
    import posix

    def refusing(name, _denied=PermissionError):
        def refused(*args, _message="sandbox: %s is not allowed" % name, _denied=_denied, **kwargs):
            raise _denied(_message)
        return refused

    def checked_open(path, flags, mode=0o777, *, dir_fd=None, _check=check_open, _open=posix.open,
                     _fspath=posix.fspath):
        return _open(_check(_fspath(path), flags, dir_fd), flags, mode)  # the path checked, not dir_fd again

    def checked_readlink(path, *, dir_fd=None, _check=check_link, _readlink=posix.readlink, _fspath=posix.fspath,
                         _type=type, _bytes=bytes, _encode=str.encode):
        path = _fspath(path)
        where = _readlink(_check(path, dir_fd))
        return _encode(where, "utf-8", "surrogateescape") if _type(path) is _bytes else where

    replaced = [("posix", ("mkfifo", "mknod", "pidfd_open", "memfd_create", "setpriority", "sched_setscheduler",
                           "sched_setparam", "sched_setaffinity")),
                ("_signal", ("pidfd_send_signal",)), ("_posixsubprocess", ("fork_exec",)),
                ("_posixshmem", ("shm_open", "shm_unlink"))]
    for module_name, names in replaced:
        try:
            module = __import__(module_name)
        except ImportError:
            continue
        for name in names:
            if hasattr(module, name):
                setattr(module, name, refusing(module_name + "." + name))
    mirrors = {"posix": ("os",), "_signal": ("signal",)}
    for module_name, names in replaced[:2]:
        for mirror in mirrors[module_name]:
            for name in names:
                if hasattr(sys.modules.get(mirror), name):
                    setattr(sys.modules[mirror], name, getattr(sys.modules[module_name], name))
    for module in (posix, sys.modules.get("os")):
        if module is not None:
            module.open, module.readlink = checked_open, checked_readlink
