"""Part of the script the sandboxed child runs (see :mod:`rlcore.envs.sandbox_child`): new namespaces
and a filesystem of the run's own, built from the layout the trainer computed
(:func:`rlcore.envs.sandbox_layout.layout`). Standard library only; never imported by rlcore."""

import os

_NEWNS, _NEWIPC, _NEWUSER, _NEWPID, _NEWNET = 0x00020000, 0x08000000, 0x10000000, 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT = 1, 2, 4, 8, 32
_MS_BIND, _MS_REC, _MS_PRIVATE = 0x1000, 0x4000, 0x40000
#: syscall numbers: pivot_root, capset, mount_setattr
_FS_CALLS = {"x86_64": (155, 126, 442), "aarch64": (41, 91, 442)}


def _namespaces(libc):
    """New mount, PID, network and IPC namespaces, in a new user namespace where the kernel allows one
    (else as root with ``CAP_SYS_ADMIN``). Returns the guards that hold (empty: none could be made)."""
    uid, gid = os.getuid(), os.getgid()
    base = _NEWNS | _NEWPID | _NEWNET | _NEWIPC
    for flags in (base | _NEWUSER, base):
        if libc.unshare(flags) == 0:
            break
    else:
        return set()
    if flags & _NEWUSER:  # the same ids inside: files keep their owners, the working directory is ours
        maps = (("setgroups", "deny"), ("uid_map", "%d %d 1" % (uid, uid)), ("gid_map", "%d %d 1" % (gid, gid)))
        for name, text in maps:
            try:
                with open("/proc/self/" + name, "w") as f:
                    f.write(text)
            except OSError:
                pass
    held = {"network_namespace", "mount_namespace", "ipc_namespace", "pid_namespace"}
    if flags & _NEWUSER:
        held.add("user_namespace")
    return held


def _mount(ctypes, libc, source, target, fstype, flags, data=None):
    def enc(text):
        return None if text is None else text.encode()
    return libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) == 0


def _read_only(ctypes, libc, path):
    """Make the mount at ``path`` (and those under it) read-only, no devices, no set-id."""
    calls = _FS_CALLS.get(os.uname().machine)

    class Attr(ctypes.Structure):
        _fields_ = [(name, ctypes.c_uint64) for name in ("set", "clear", "propagation", "userns")]

    if calls is not None:
        attr = Attr(0x1 | 0x2 | 0x4, 0, 0, 0)  # MOUNT_ATTR_RDONLY | NOSUID | NODEV, recursively (AT_RECURSIVE)
        if libc.syscall(ctypes.c_long(calls[2]), ctypes.c_long(-100), path.encode(), ctypes.c_long(0x8000),
                        ctypes.byref(attr), ctypes.c_long(ctypes.sizeof(attr))) == 0:
            return True
    # before Linux 5.12: a remount that keeps the flags the kernel locks (those the mount has)
    got = os.statvfs(path).f_flag
    keep = got & (_MS_NOSUID | _MS_NODEV | _MS_NOEXEC | 1024 | 2048) | (0x200000 if got & 4096 else 0)
    return _mount(ctypes, libc, None, path, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV | keep)


def _mountpoint(new, path, directory):
    where = new + path
    os.makedirs(where if directory else os.path.dirname(where), exist_ok=True)
    if not directory and not os.path.exists(where):
        os.close(os.open(where, os.O_CREAT | os.O_WRONLY, 0o644))
    return where


def _private_root(ctypes, libc, fs, new, inner, disk, with_proc):
    """Pivot into a fresh root, assembled on ``new`` (the run's own empty host directory, under no
    path of the layout): a small read-only tmpfs holding read-only binds of ``fs["binds"]``
    (the standard library and the libraries the interpreter loads), the symbolic links that lead to
    them, empty directories over ``fs["hide"]`` (installed packages), ``fs["declared"]``, the devices
    ``fs["devices"]`` and the links ``fs["device_links"]``, a ``/proc`` of the run's PID namespace
    (``with_proc``), and at ``inner`` a tmpfs of ``disk`` bytes, the working directory. Returns whether
    it was built."""
    calls = _FS_CALLS.get(os.uname().machine)
    if calls is None:
        return False
    if not _mount(ctypes, libc, "none", "/", None, _MS_REC | _MS_PRIVATE):  # nothing reaches the parent namespace
        return False
    if not _mount(ctypes, libc, "tmpfs", new, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=0755"):
        return False
    for link, target in fs["links"]:
        os.makedirs(os.path.dirname(new + link), exist_ok=True)
        os.symlink(target, new + link)
    for path, directory in fs["binds"]:
        where = _mountpoint(new, path, directory)
        if not (_mount(ctypes, libc, path, where, None, _MS_BIND | _MS_REC) and _read_only(ctypes, libc, where)):
            return False
    for path in fs["hide"]:
        if not _mount(ctypes, libc, "tmpfs", new + path, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=4k,mode=0555"):
            return False
    for path, directory in fs["declared"]:
        where = _mountpoint(new, path, directory)
        if not (_mount(ctypes, libc, path, where, None, _MS_BIND | _MS_REC) and _read_only(ctypes, libc, where)):
            return False
    for path in fs["hide"]:
        if not _read_only(ctypes, libc, new + path):
            return False
    for name in fs["devices"]:
        _mount(ctypes, libc, "/dev/" + name, _mountpoint(new, "/dev/" + name, False), None, _MS_BIND)
    for link, target in fs["device_links"]:
        os.symlink(target, new + link)
    os.makedirs(new + inner, exist_ok=True)
    if not _mount(ctypes, libc, "tmpfs", new + inner, "tmpfs", _MS_NOSUID | _MS_NODEV,
                  "size=%d,mode=0700,nr_inodes=65536" % disk):
        return False
    if with_proc:  # refused where the host's /proc is partly covered (containers): then there is none
        os.makedirs(new + "/proc", exist_ok=True)
        _mount(ctypes, libc, "proc", new + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    os.chdir(new)
    if libc.syscall(ctypes.c_long(calls[0]), b".", b".") != 0:  # pivot_root(".", "."): the old root on top
        return False
    if libc.umount2(b".", ctypes.c_int(2)) != 0:  # MNT_DETACH: the host's tree is gone from here
        return False
    os.chdir("/")
    if not _mount(ctypes, libc, None, "/", None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV):
        return False
    os.chdir(inner)
    return True


def _drop_capabilities(ctypes, libc):
    """No capability left, in any namespace (the process keeps its user id)."""
    calls = _FS_CALLS.get(os.uname().machine)
    if calls is None:
        return False
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()
    return libc.syscall(ctypes.c_long(calls[1]), ctypes.byref(header), ctypes.byref(data)) == 0


def _other_user(uid):
    """Root without namespaces: become ``uid`` (owner of nothing but the working directory), which
    leaves every capability behind."""
    try:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    except OSError:
        return False
    return os.geteuid() == uid
