"""The manifest of a checkpoint (written last): step, world size, format, size and sha256 of every file."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Mapping

import torch

from rlcore.errors import CheckpointError
from rlcore.trainer.store.files import inside

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def sha256_of(path: Path, chunk: int = 8 * 2**20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _hash_all(root: Path, files: list[Path]) -> dict[str, str]:
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(8, len(files)))) as pool:
        digests = list(pool.map(sha256_of, files))
    return {str(p.relative_to(root)): d for p, d in zip(files, digests)}


def write_manifest(root: Path, *, step: int, world_size: int, fmt: str, kinds: Mapping[str, str]) -> None:
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)
    digests = _hash_all(root, files)
    from rlcore import __version__

    manifest = {
        "format_version": FORMAT_VERSION, "step": int(step), "world_size": int(world_size), "format": fmt,
        "kinds": dict(kinds), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rlcore_version": __version__,
        "torch_version": torch.__version__,
        "files": {rel: {"bytes": (root / rel).stat().st_size, "sha256": d} for rel, d in digests.items()},
    }
    with open(root / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(path: Path) -> dict[str, Any]:
    try:
        with open(path / MANIFEST) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path / MANIFEST}: {e}") from e


def verify(path: Path) -> list[str]:
    """Problems that make checkpoint ``path`` unusable (empty list: complete and intact)."""
    if not path.is_dir():
        return [f"{path} does not exist"]
    if not (path / MANIFEST).is_file():
        return [f"no {MANIFEST} (the save did not finish)"]
    try:
        manifest = read_manifest(path)
        files = dict(manifest["files"])
        for key in ("step", "world_size", "format", "kinds"):
            manifest[key]
    except (CheckpointError, KeyError, TypeError, ValueError) as e:
        return [f"{MANIFEST} is unreadable or incomplete: {e}"]
    problems, present = [], []
    for rel, meta in sorted(files.items()):
        p = path / rel
        if not inside(p, path):
            problems.append(f"{MANIFEST} lists {rel!r}, a path outside the checkpoint directory")
        elif not p.is_file():
            problems.append(f"{rel} is missing")
        elif p.stat().st_size != int(meta["bytes"]):
            problems.append(f"{rel} is truncated or altered: {p.stat().st_size} bytes, expected {meta['bytes']}")
        else:
            present.append(p)
    if problems:
        return problems
    digests = _hash_all(path, present)
    return [f"{rel} fails its sha256 check" for rel, d in sorted(digests.items()) if d != files[rel]["sha256"]]
