"""Durable file operations of checkpoints: fsync, atomic replacement, removal through a trash name."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from rlcore.errors import CheckpointError

#: Prefix of a directory being deleted: renamed first, so a kill mid-delete never leaves a
#: half-deleted directory under its real name (resume ignores names that do not match ``step_N``).
TRASH_PREFIX = ".trash-"


def fsync_path(path: Path) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (bottom-up)."""
    for dirpath, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath))


#: Free bytes below which a failed write is put down to a full disk (torch reports it as a bare
#: "file write failed" RuntimeError, without errno).
FULL_DISK_BYTES = 64 * 2**20


def no_space_message(path: Path, err: BaseException) -> Optional[str]:
    """A one-line explanation when ``err`` (or an error it wraps) means the disk is full, else None."""
    where = path.parent if path.parent.exists() else path
    free = free_bytes(str(where))
    full = free is not None and free < FULL_DISK_BYTES
    seen: Optional[BaseException] = err
    while seen is not None and not full:
        text = str(seen).lower()
        full = getattr(seen, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "no space left" in text \
            or "disk quota" in text
        seen = seen.__cause__ or seen.__context__
    if not full:
        return None
    free_txt = f" ({free / 2**20:.0f} MiB free)" if free is not None else ""
    return (f"no space left on the device holding {path}{free_txt}: free space, lower "
            "trainer.save_total_limit or choose another trainer.output_dir")


def save_file(obj: Any, path: Path) -> None:
    """``torch.save`` ``obj`` to ``path`` and fsync it.

    :raises CheckpointError: the write failed (a full disk is named as such, in one line).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(path, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as e:
        why = no_space_message(path, e) or f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        raise CheckpointError(f"could not write {path}: {why}") from e


def remove_tree(path: Path) -> None:
    """Delete directory ``path``: renamed to a trash name first, then removed."""
    if not path.exists():
        return
    trash = path
    if not path.name.startswith(TRASH_PREFIX):
        trash = path.parent / f"{TRASH_PREFIX}{path.name}"
        if trash.exists():
            shutil.rmtree(trash, ignore_errors=True)
        os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def free_bytes(path: str) -> Optional[int]:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def replace_dir(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final`` (replacing an older ``final``) and make the rename durable."""
    fsync_tree(tmp)
    trash = final.parent / f"{TRASH_PREFIX}{final.name}"
    if final.exists():
        remove_tree(trash)
        os.rename(final, trash)
    os.rename(tmp, final)
    fsync_path(final.parent)
    remove_tree(trash)


def write_pointer(path: Path, target: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(target + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def read_pointer(path: Path) -> Optional[str]:
    try:
        name = path.read_text().strip()
    except OSError:
        return None
    return name or None


def inside(path: Path, root: Path) -> bool:
    """Whether ``path`` (links resolved) lies in directory ``root`` (links resolved)."""
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True


def check_inside(path: Path, root: Path, what: str) -> Path:
    """``path`` when it lies inside ``root``; else :class:`CheckpointError` (a pointer or manifest
    entry leading out of the checkpoint directory is never followed)."""
    if not inside(path, root):
        raise CheckpointError(f"{what} leads to {path}, outside {root}: refusing to follow it "
                              "(a checkpoint only refers to files inside its own directory)")
    return path
