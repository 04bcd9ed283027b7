"""``sparse-logging``: metrics of logged steps to JSONL, TensorBoard and one console line each.

Select it with ``--plugins sparse-logging``. The trainer calls the metrics hook only every
``trainer.log_steps`` steps (and at evaluations), so steps in between cost no I/O at all. For
each call this plugin

* appends one JSON object to ``<output_dir>/metrics.jsonl`` (step, split, time, every metric);
* adds every finite metric to TensorBoard under ``<output_dir>/tensorboard`` when
  ``torch.utils.tensorboard`` can be imported;
* prints one line to stdout ending with ``step N took Xms``, so
  ``grep "step.*took" train.log | awk '{print $NF}' | sed 's/ms//g'`` lists step times in ms.

While it runs, the default console line (logger ``rlcore.metrics``) is quieted so each step is
printed once. Only the main rank writes. Per-run state lives in a :class:`SparseLogger` created
at train start; the hook functions below delegate to it.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Mapping, Optional, TextIO

from rlcore.observe.console import LOGGER_NAME, format_metrics
from rlcore.observe.jsonl import JsonlWriter, make_record
from rlcore.observe.sink import SinkHooks

METRICS_FILE = "metrics.jsonl"
#: Metrics shown on the console line (the JSONL holds all of them).
CONSOLE_KEYS = ("reward/mean", "score/mean", "kl/mean", "entropy/mean", "loss/policy", "loss/value",
                "actor/grad_norm", "actor/lr", "response/length_mean", "perf/tokens_per_s", "perf/mfu",
                "gpu/util_mean", "memory/peak_gb")


class SparseLogger:
    """The sinks of one run.

    :param run_dir: where ``metrics.jsonl`` and ``tensorboard/`` go.
    :param is_main: only the main rank writes; other ranks keep a do-nothing logger.
    :param tensorboard: open a TensorBoard writer when the package is installed.
    :param stream: where the console line goes (default stdout).
    :param fresh: truncate an existing metrics file instead of appending to it.
    """

    def __init__(self, run_dir: str, *, is_main: bool = True, tensorboard: bool = True,
                 stream: Optional[TextIO] = None, fresh: bool = False):
        self.run_dir = run_dir
        self.is_main = is_main
        self.stream = stream
        self.jsonl: Optional[JsonlWriter] = None
        self.tb: Any = None
        console = logging.getLogger(LOGGER_NAME)
        self._console_level: Optional[int] = console.level
        console.setLevel(logging.WARNING)
        if not is_main:
            return
        self.jsonl = JsonlWriter(os.path.join(run_dir, METRICS_FILE), fresh=fresh)
        if tensorboard:
            from rlcore.observe.tensorboard import open_tensorboard

            self.tb = open_tensorboard(os.path.join(run_dir, "tensorboard"))

    def metrics(self, step: int, metrics: Mapping[str, Any], split: str) -> None:
        if not self.is_main:
            return
        if self.jsonl is not None:
            self.jsonl.write(make_record(step, metrics, split))
        if self.tb is not None:
            self.tb.write(step, metrics, split)
        stream = self.stream or sys.stdout
        stream.write(format_metrics(step, metrics, split, keys=CONSOLE_KEYS) + "\n")
        stream.flush()

    def close(self, step: int, status: str, summary: Mapping[str, Any]) -> None:
        if self.jsonl is not None:
            self.jsonl.write(make_record(step, summary, "summary", status=status))
            self.jsonl.close()
            self.jsonl = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self._console_level is not None:
            logging.getLogger(LOGGER_NAME).setLevel(self._console_level)
            self._console_level = None


def _make(run_dir: str, dist: Any, config: Mapping[str, Any]) -> SparseLogger:
    # A run that does not resume (trainer.resume=disable) starts its metrics file anew.
    fresh = (config.get("trainer") or {}).get("resume") == "disable"
    return SparseLogger(run_dir, is_main=bool(getattr(dist, "is_main", True)), fresh=fresh)


#: The logger of the run in progress (rebuilt at every train start); the hooks delegate to it.
RUN = SinkHooks(_make)
rlcore_train_start, rlcore_metrics, rlcore_train_end = RUN.hooks()
