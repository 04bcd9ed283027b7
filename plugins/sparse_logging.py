"""``sparse-logging``: metrics of logged steps to TensorBoard and one console line each.

Select it with ``--plugins sparse-logging``. The trainer calls the metrics hook only every
``trainer.log_steps`` steps (and at evaluations), so steps in between cost no I/O at all (every
run's ``metrics.jsonl`` is written by the built-in ``metrics-file`` plugin). For each call this plugin

* adds every finite metric to TensorBoard under ``<output_dir>/tensorboard`` when
  ``torch.utils.tensorboard`` can be imported;
* prints one line to stdout ending with ``step N took Xms``, so
  ``grep "step.*took" train.log | awk '{print $NF}' | sed 's/ms//g'`` lists step times in ms.

While it runs, the default console line (logger ``rlcore.metrics``) is quieted so each step is
printed once. Only the main rank writes. Per-run state lives in a :class:`SparseLogger` created
at train start and held by the :class:`SparseLoggingPlugin` instance registered with one plugin manager.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Mapping, Optional, TextIO

from rlcore.observe.console import LOGGER_NAME, format_metrics
from rlcore.observe.sink import SinkHooks
#: Metrics shown on the console line (the JSONL holds all of them).
CONSOLE_KEYS = ("reward/mean", "score/mean", "kl/mean", "entropy/mean", "loss/policy", "loss/value",
                "actor/grad_norm", "actor/lr", "response/length_mean", "perf/tokens_per_s", "perf/mfu",
                "gpu/util_mean", "memory/peak_gb")


class SparseLogger:
    """The sinks of one run.

    :param run_dir: where ``tensorboard/`` goes.
    :param is_main: only the main rank writes; other ranks keep a do-nothing logger.
    :param tensorboard: open a TensorBoard writer when the package is installed.
    :param stream: where the console line goes (default stdout).
    """

    def __init__(self, run_dir: str, *, is_main: bool = True, tensorboard: bool = True,
                 stream: Optional[TextIO] = None):
        self.run_dir = run_dir
        self.is_main = is_main
        self.stream = stream
        self.tb: Any = None
        console = logging.getLogger(LOGGER_NAME)
        self._console_level: Optional[int] = console.level
        console.setLevel(logging.WARNING)
        if not is_main:
            return
        if tensorboard:
            from rlcore.observe.tensorboard import open_tensorboard

            self.tb = open_tensorboard(os.path.join(run_dir, "tensorboard"))

    def metrics(self, step: int, metrics: Mapping[str, Any], split: str) -> None:
        if not self.is_main:
            return
        if self.tb is not None:
            self.tb.write(step, metrics, split)
        stream = self.stream or sys.stdout
        stream.write(format_metrics(step, metrics, split, keys=CONSOLE_KEYS) + "\n")
        stream.flush()

    def close(self, step: int, status: str, summary: Mapping[str, Any]) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self._console_level is not None:
            logging.getLogger(LOGGER_NAME).setLevel(self._console_level)
            self._console_level = None


def _make(run_dir: str, dist: Any, config: Mapping[str, Any]) -> SparseLogger:
    return SparseLogger(run_dir, is_main=bool(getattr(dist, "is_main", True)))


class SparseLoggingPlugin(SinkHooks):
    """The plugin: one instance per plugin manager holds the logger of the run in progress."""

    def __init__(self) -> None:
        super().__init__(_make)
