"""Metrics as JSON lines: one object per logged step, appended and flushed at once."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Any, Iterator, Mapping, Optional

log = logging.getLogger(__name__)


#: The run record every run writes in its run directory (the built-in ``metrics-file`` plugin).
METRICS_FILE = "metrics.jsonl"

def _clean(value: Any) -> Any:
    """Strict JSON: numbers stay numbers, NaN and infinities become null, tensors become floats."""
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return str(value)


def make_record(step: int, metrics: Mapping[str, Any], split: str, **extra: Any) -> dict[str, Any]:
    record: dict[str, Any] = {"step": int(step), "split": split, "time": round(time.time(), 3)}
    record.update({k: _clean(v) for k, v in extra.items()})
    record.update({k: _clean(v) for k, v in metrics.items()})
    return record


def drop_torn_tail(path: str) -> int:
    """Cut a last line that does not end in a newline (the process was killed mid-write), so the
    next record starts on a line of its own. Returns the number of bytes dropped."""
    try:
        f = open(path, "rb+")
    except FileNotFoundError:
        return 0
    with f:
        end = f.seek(0, os.SEEK_END)
        if end == 0:
            return 0
        f.seek(end - 1)
        if f.read(1) == b"\n":
            return 0
        pos, keep = end, 0
        while pos > 0 and not keep:
            step = min(pos, 1 << 16)
            pos -= step
            f.seek(pos)
            chunk = f.read(step)
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                keep = pos + cut + 1
        f.truncate(keep)
    log.warning("%s: its last line was incomplete (the run was killed while writing it): %d bytes dropped",
                path, end - keep)
    return end - keep


class JsonlWriter:
    """Appends records to ``path`` (a resumed run keeps its earlier lines); ``fresh=True`` starts it anew."""

    def __init__(self, path: str, *, fresh: bool = False):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if not fresh:
            drop_torn_tail(path)
        self._f: Optional[Any] = open(path, "w" if fresh else "a", encoding="utf-8")

    def write(self, record: Mapping[str, Any]) -> None:
        if self._f is None:
            raise ValueError(f"{self.path} is closed")
        self._f.write(json.dumps(record, allow_nan=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def read_jsonl(path: str) -> Iterator[dict[str, Any]]:
    """Records of ``path``; a torn last line (the process was killed mid-write) is skipped."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except ValueError:
                continue
