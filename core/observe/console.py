"""The default metrics sink: one short console line per logged step, through the ``rlcore.metrics`` logger.

A line looks like ``[train] step 10: reward/mean=0.25 kl/mean=0.0012 | step 10 took 1142ms``; its
last whitespace-separated field is the step time in milliseconds, so
``grep "step.*took" train.log | awk '{print $NF}' | sed 's/ms//g'`` extracts it. The
``sparse-logging`` plugin prints a fuller line of its own and quiets this logger while it runs.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

#: The logger of the default console line; raise its level to silence it.
LOGGER_NAME = "rlcore.metrics"
log = logging.getLogger(LOGGER_NAME)

KEYS = ("reward/mean", "score/mean", "kl/mean", "loss/policy", "loss/value", "response/length_mean",
        "perf/tokens_per_s")


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def took_suffix(step: int, metrics: Mapping[str, Any]) -> str:
    """`` | step N took Xms`` when the step time is known, else an empty string."""
    seconds = metrics.get("time/step_s")
    return f" | step {step} took {seconds * 1000:.0f}ms" if isinstance(seconds, (int, float)) else ""


def format_metrics(step: int, metrics: Mapping[str, Any], split: str, keys: Any = KEYS) -> str:
    """One line: the ``keys`` present in ``metrics`` (every metric for a non-train split), then the step time."""
    if split == "train" and keys is not None:
        shown = [f"{k}={_fmt(metrics[k])}" for k in keys if k in metrics]
    else:
        shown = [f"{k}={_fmt(v)}" for k, v in sorted(metrics.items()) if k != "time/step_s"]
    return f"[{split}] step {step}: " + " ".join(shown) + took_suffix(step, metrics)


def _is_main() -> bool:
    from rlcore.distributed.init import is_main_process

    return is_main_process()


def print_metrics(step: int, metrics: Mapping[str, Any], split: str) -> None:
    """Log the line of :func:`format_metrics` at INFO on the ``rlcore.metrics`` logger (main rank only)."""
    if log.isEnabledFor(logging.INFO) and _is_main():
        log.info(format_metrics(step, metrics, split))
