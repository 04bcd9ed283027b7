"""The Arrow cache of tokenized, filtered prompt tables (``data.cache_dir``).

A cache entry is named by a hash of everything that shapes the table: each input file's path, size,
modification time and a hash of its first and last bytes (a parquet footer changes with any
rewrite); the tokenizer's content (vocabulary/model, chat template, special tokens); and the data
options. An entry is written to a temporary file and renamed into place, so ranks building at the
same time, or a crash mid-write, never leave a truncated entry behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from typing import Any, Callable, Optional, Sequence

from rlcore.config.schema import DataConfig
from rlcore.errors import DataError

#: Bump when the table layout changes: every older entry becomes a miss.
CACHE_VERSION = 2  # 2: shards combined without loss (rlcore.data.schema); older entries may hold cast values
_EDGE_BYTES = 64 * 1024
#: A failure marker older than this (seconds) when a rank starts waiting belongs to an earlier run.
STALE_MARKER_S = 120.0


def file_fingerprint(path: str) -> dict[str, Any]:
    """Identity of one input file: absolute path, size, mtime and a hash of its head and tail."""
    st = os.stat(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(4096))
        if st.st_size > 4096:
            f.seek(max(4096, st.st_size - _EDGE_BYTES))
            h.update(f.read(_EDGE_BYTES))
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "edges": h.hexdigest()[:32]}


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of what decides the token ids: the tokenizer's model/vocabulary, chat template and specials."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        h.update(backend.to_str().encode())
    else:
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        h.update(json.dumps(sorted(vocab.items())).encode())
    template = getattr(tokenizer, "chat_template", None)
    h.update(json.dumps(template, sort_keys=True, default=str).encode())
    specials = getattr(tokenizer, "special_tokens_map", {}) or {}
    h.update(json.dumps(specials, sort_keys=True, default=str).encode())
    return h.hexdigest()


def cache_key(paths: Sequence[str], tokenizer: Any, config: DataConfig) -> str:
    options = {"prompt_key": config.prompt_key, "max_prompt_length": int(config.max_prompt_length),
               "filter_overlong_prompts": bool(config.filter_overlong_prompts), "truncation": config.truncation}
    payload = {"version": CACHE_VERSION, "files": [file_fingerprint(p) for p in paths],
               "tokenizer": tokenizer_fingerprint(tokenizer), "options": options}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def entry_paths(cache_dir: str, key: str) -> tuple[str, str]:
    """``(table, stats)`` paths of a cache entry."""
    base = os.path.join(os.path.expanduser(cache_dir), f"rlcore-prompts-{key[:32]}")
    return base + ".arrow", base + ".json"


def atomic_build(final: str, build: Callable[[str], None]) -> None:
    """Run ``build(tmp_path)`` and rename the result to ``final``; leave nothing behind on failure."""
    directory = os.path.dirname(final) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(final) + ".", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        build(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; other users of a shared cache must read it
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def write_json_atomic(path: str, data: dict) -> None:
    def build(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)

    atomic_build(path, build)


def read_json(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def failure_marker(final: str) -> str:
    return final + ".failed"


def wait_for_entry(final: str, timeout_s: float, poll_s: float = 1.0) -> bool:
    """Wait for another process to finish an entry; True once it exists, False on timeout.

    :raises DataError: the building process recorded a failure.
    """
    deadline = time.monotonic() + timeout_s
    marker, since = failure_marker(final), time.time() - STALE_MARKER_S
    while time.monotonic() < deadline:
        if os.path.exists(final):
            return True
        failed = read_json(marker)
        if failed and failed.get("time", 0) >= since:  # older markers are left from earlier runs
            raise DataError(failed.get("error", "building the data cache failed on another rank"))
        time.sleep(poll_s)
    return os.path.exists(final)

