"""``metrics-file`` (built in, always registered): every run's record, ``<output_dir>/metrics.jsonl``.

One JSON object per ``rlcore_metrics`` call (step, split, time, every metric; non-finite numbers as
``null``) and a last one with ``split="summary"`` and the run's status. Plugins change how often
metrics are recorded and where else they go, not whether a run has this record. Only the main rank
writes; a run that does not resume (``trainer.resume=disable``) starts the file anew, a resumed run
appends to it.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from rlcore.observe.jsonl import METRICS_FILE, JsonlWriter, make_record
from rlcore.observe.sink import SinkHooks


class JsonlSink:
    def __init__(self, path: str, *, fresh: bool = False):
        self.writer: Optional[JsonlWriter] = JsonlWriter(path, fresh=fresh)

    def metrics(self, step: int, metrics: Mapping[str, Any], split: str) -> None:
        if self.writer is not None:
            self.writer.write(make_record(step, metrics, split))

    def close(self, step: int, status: str, summary: Mapping[str, Any]) -> None:
        if self.writer is not None:
            self.writer.write(make_record(step, summary, "summary", status=status))
            self.writer.close()
            self.writer = None


def _make(run_dir: str, dist: Any, config: Mapping[str, Any]) -> Optional[JsonlSink]:
    if not getattr(dist, "is_main", True):
        return None
    fresh = (config.get("trainer") or {}).get("resume") == "disable"
    return JsonlSink(os.path.join(run_dir, METRICS_FILE), fresh=fresh)


class MetricsFilePlugin(SinkHooks):
    def __init__(self) -> None:
        super().__init__(_make)
