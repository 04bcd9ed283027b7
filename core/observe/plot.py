"""``rlcore plot RUN_DIR``: a PNG dashboard drawn from ``RUN_DIR/metrics.jsonl``.

Panels: reward (train mean with min/max band, held-out evaluations), KL, response length and the
share clipped at ``max_new_tokens``, the step-time breakdown by phase, GPU utilisation against
the 85-95% band, and throughput with MFU. matplotlib is an optional dependency
(``pip install matplotlib``, or the ``plot`` extra of an rlcore checkout).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional, Sequence

from rlcore.errors import RLCoreError
from rlcore.observe.jsonl import METRICS_FILE, read_jsonl

#: Stacked in the step-time panel (disjoint parts of ``time/step_s``).
PHASE_KEYS = tuple(f"time/{p}_s" for p in ("generate", "reward", "ref_logprob", "old_logprob", "values",
                                           "advantages", "update_actor", "update_critic", "reshard",
                                           "checkpoint"))
DASHBOARD_FILE = "dashboard.png"

log = logging.getLogger(__name__)


def load_metrics(run_dir: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train records, val records) of ``run_dir/metrics.jsonl``; the last record of a step wins."""
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        raise RLCoreError(f"no {METRICS_FILE} in {run_dir}: not a run directory, or its run has not "
                          "logged a step yet")
    by_split: dict[str, dict[int, dict[str, Any]]] = {"train": {}, "val": {}}
    for rec in read_jsonl(path):
        split = rec.get("split", "train")
        if split in by_split and isinstance(rec.get("step"), int):
            by_split[split][rec["step"]] = rec  # a resumed run rewrites steps after its checkpoint
    return ([by_split["train"][s] for s in sorted(by_split["train"])],
            [by_split["val"][s] for s in sorted(by_split["val"])])


def series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of ``key`` where it is a number."""
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def _require_matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError as e:
        raise RLCoreError("rlcore plot needs matplotlib: pip install matplotlib") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _line(ax: Any, records: Sequence[dict[str, Any]], key: str, label: Optional[str] = None, **kw: Any) -> bool:
    xs, ys = series(records, key)
    if xs:
        ax.plot(xs, ys, label=label or key, **kw)
    return bool(xs)


def _legend(ax: Any, **kw: Any) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kw)


def _empty(ax: Any, what: str, why: str = "") -> None:
    ax.text(0.5, 0.5, f"no {what} recorded{why}", ha="center", va="center", transform=ax.transAxes, color="gray")


def _reward(ax: Any, train: Sequence[dict], val: Sequence[dict]) -> None:
    ax.set_title("reward")
    drawn = _line(ax, train, "reward/mean", "train mean")
    xs, lo = series(train, "reward/min")
    xs2, hi = series(train, "reward/max")
    if xs and xs == xs2:
        ax.fill_between(xs, lo, hi, alpha=0.2, label="train min-max")
    drawn |= _line(ax, val, "reward_mean", "held-out", marker="o")
    if not drawn:
        _empty(ax, "reward")
    _legend(ax, fontsize=7)


def _twin_line(ax: Any, train: Sequence[dict], key: str, label: str, *, color: str, alpha: float,
               scale: float = 1.0, ylim: Optional[tuple] = None) -> None:
    """``key`` on a second y axis of ``ax`` (legend upper right), when the rows have it."""
    xs, values = series(train, key)
    if not xs:
        return
    twin = ax.twinx()
    twin.plot(xs, [scale * v for v in values], color=color, alpha=alpha, label=label)
    if ylim is not None:
        twin.set_ylim(*ylim)
    _legend(twin, fontsize=7, loc="upper right")


def _kl(ax: Any, train: Sequence[dict]) -> None:
    ax.set_title("KL to reference")
    if not _line(ax, train, "kl/mean", "kl/mean"):
        _empty(ax, "KL")
    _legend(ax, fontsize=7, loc="upper left")
    _twin_line(ax, train, "entropy/mean", "entropy/mean", color="tab:orange", alpha=0.6)


def _length(ax: Any, train: Sequence[dict]) -> None:
    ax.set_title("response length")
    drawn = _line(ax, train, "response/length_mean", "mean")
    drawn |= _line(ax, train, "response/length_max", "max", alpha=0.6)
    if not drawn:
        _empty(ax, "response length")
    _legend(ax, fontsize=7, loc="upper left")
    _twin_line(ax, train, "response/clip_frac", "clipped share", color="tab:red", alpha=0.5, ylim=(0, 1))


def _times(ax: Any, train: Sequence[dict]) -> None:
    ax.set_title("step time by phase (s)")
    steps = [r["step"] for r in train]
    stacks, labels = [], []
    for key in PHASE_KEYS:
        values = [float(r.get(key) or 0.0) for r in train]
        if any(values):
            stacks.append(values)
            labels.append(key.split("/", 1)[1][:-2])
    if steps and stacks:
        ax.stackplot(steps, stacks, labels=labels, alpha=0.8)
        _line(ax, train, "time/step_s", "total", color="black", linewidth=1)
        _legend(ax, fontsize=6, loc="upper left", ncol=2)
    else:
        _empty(ax, "step time")


def _gpu(ax: Any, train: Sequence[dict]) -> None:
    ax.set_title("GPU utilisation (%)")
    ax.axhspan(85, 95, color="tab:green", alpha=0.1, label="healthy 85-95%")
    ax.axhline(70, color="tab:red", linestyle="--", linewidth=0.8, label="dip line 70%")
    drawn = _line(ax, train, "gpu/util_mean", "mean")
    drawn |= _line(ax, train, "gpu/util_p10", "p10", alpha=0.7)
    if not drawn:
        _empty(ax, "GPU utilisation", "\n(no GPU, or trainer.gpu_monitor=false)")
    ax.set_ylim(0, 105)
    _legend(ax, fontsize=7)


def _throughput(ax: Any, train: Sequence[dict]) -> None:
    ax.set_title("throughput")
    if not _line(ax, train, "perf/tokens_per_s", "tokens/s"):
        _empty(ax, "throughput")
    _legend(ax, fontsize=7, loc="upper left")
    _twin_line(ax, train, "perf/mfu", "MFU %", color="tab:purple", alpha=0.6, scale=100.0)


def plot_run(run_dir: str, out: Optional[str] = None) -> str:
    """Draw the dashboard of ``run_dir``; return the PNG path (default ``run_dir/dashboard.png``)."""
    train, val = load_metrics(run_dir)
    if not train and not val:
        raise RLCoreError(f"{os.path.join(run_dir, METRICS_FILE)} holds no metrics yet")
    plt = _require_matplotlib()
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    _reward(axes[0][0], train, val)
    _kl(axes[0][1], train)
    _length(axes[0][2], train)
    _times(axes[1][0], train)
    _gpu(axes[1][1], train)
    _throughput(axes[1][2], train)
    for ax in [a for row in axes for a in row]:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(f"rlcore run: {os.path.abspath(run_dir)}", fontsize=10)
    fig.tight_layout()
    path = out or os.path.join(run_dir, DASHBOARD_FILE)
    tmp = f"{path}.tmp.png"
    try:  # written aside, then moved: a failed write (a full disk) leaves no torn PNG
        fig.savefig(tmp, dpi=90)
        os.replace(tmp, path)
    except OSError:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    finally:
        plt.close(fig)
    return path


def dashboard_line(run_dir: str) -> Optional[str]:
    """One line for the end-of-run summary: where the dashboard is, or why it was not drawn.

    None when the run wrote no ``metrics.jsonl`` (no file sink was selected).
    """
    if not os.path.isfile(os.path.join(run_dir, METRICS_FILE)):
        return None
    try:
        return f"dashboard: {plot_run(run_dir)}"
    except RLCoreError as e:
        return f"dashboard not drawn: {e}"
    except OSError as e:  # a full disk, say: the run itself is not at fault
        log.warning("the dashboard of %s could not be written: %s", run_dir, e)
        return f"dashboard not drawn: {e.strerror or e}"
