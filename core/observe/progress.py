"""A training progress bar (tqdm) showing the step's key numbers."""

from __future__ import annotations

from typing import Any


class ProgressBar:
    def __init__(self, start: int, total: int, enabled: bool = True):
        self._bar: Any = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=start, desc="rlcore", unit="step", dynamic_ncols=True)

    def update(self, metrics: dict[str, float]) -> None:
        if self._bar is None:
            return
        shown = {"reward": metrics.get("reward/mean"), "kl": metrics.get("kl/mean"),
                 "s/step": metrics.get("time/step_s")}
        self._bar.set_postfix({k: f"{v:.3f}" for k, v in shown.items() if v is not None}, refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
