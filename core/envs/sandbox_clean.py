"""Removing a sandbox run's working directory, whatever the code left in it: no recursion (a tree of
any depth), no path longer than one name (descriptors relative to the directory above), no link
followed, and never an exception."""

from __future__ import annotations

import logging
import os
import stat

log = logging.getLogger(__name__)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
#: Most entries removed before giving up (a bound on the work whatever the tree).
_MAX_STEPS = 10_000_000


def remove_tree(root: str) -> bool:
    """Remove ``root`` and everything under it; True when it is gone. Never raises (what it cannot
    remove is logged and left)."""
    try:
        _remove(root)
    except Exception as error:  # noqa: BLE001 - the caller's promise: a run never raises for what the code did
        log.warning("sandbox: could not remove %s: %s: %s", root, type(error).__name__, error)
    return not os.path.lexists(root)


def _open_dir(name: str, dir_fd: int | None) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except PermissionError:  # a directory the code made unreadable: its owner may open it again
        os.chmod(name, 0o700, dir_fd=dir_fd, follow_symlinks=False)
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)


def _remove(root: str) -> None:
    """Depth first with one open directory at a time: go down into the first subdirectory; a
    directory left empty is removed from its parent, reopened through ``..`` and checked to be the
    one it was (device and inode)."""
    fd = _open_dir(root, None)
    path: list[tuple[str, int, int]] = []  # (name, st_dev, st_ino) of each directory above the current one
    try:
        for _ in range(_MAX_STEPS):
            child = None
            with os.scandir(fd) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        child = entry.name
                        break
                    os.unlink(entry.name, dir_fd=fd)
            if child is not None:
                here = os.fstat(fd)
                inner = _open_dir(child, fd)
                os.close(fd)
                fd = inner
                path.append((child, here.st_dev, here.st_ino))
                continue
            if not path:
                break
            name, dev, ino = path.pop()
            parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = parent
            got = os.fstat(fd)
            if (got.st_dev, got.st_ino) != (dev, ino) or not stat.S_ISDIR(got.st_mode):
                raise OSError(f"the tree changed while it was removed (at {name})")
            os.rmdir(name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(root)
