"""The default metrics sink: one readable console line per logged step."""

from __future__ import annotations

import sys

KEYS = ("reward/mean", "score/mean", "kl/mean", "loss/policy", "loss/value", "response/length_mean")


def format_metrics(step: int, metrics: dict[str, float], split: str) -> str:
    shown = [f"{k}={metrics[k]:.4g}" for k in KEYS if k in metrics]
    if split != "train":
        shown = [f"{k}={v:.4g}" for k, v in sorted(metrics.items())]
    ms = metrics.get("time/step_s")
    tail = f" | step {step} took {ms * 1000:.0f} ms" if ms is not None else ""
    return f"[{split}] step {step}: " + " ".join(shown) + tail


def print_metrics(step: int, metrics: dict[str, float], split: str) -> None:
    print(format_metrics(step, metrics, split), file=sys.stderr, flush=True)
