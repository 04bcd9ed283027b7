"""``trainer.enable_profiling``: torch.profiler over a few steps, one Chrome trace per rank.

The first step seen is a warm-up (recorded but discarded), the next ``profile_steps`` steps are
recorded and written to ``<run_dir>/profile/rank<R>.steps<A>-<B>.pt.trace.json``. Read a trace in
Perfetto / ``chrome://tracing`` or summarise it with ``rlcore profile-report``.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch

log = logging.getLogger(__name__)


def trace_path(run_dir: str, rank: int, first: int, last: int) -> str:
    return os.path.join(run_dir, "profile", f"rank{rank}.steps{first}-{last}.pt.trace.json")


class StepProfiler:
    """Calls from the loop: :meth:`step_start` and :meth:`step_end` around every step, :meth:`close` at the end.

    :param enabled: ``trainer.enable_profiling``; when False every call is a no-op.
    :param profile_steps: steps recorded after the warm-up step.
    :param run_dir: the run directory; traces go to ``run_dir/profile/``.
    :param rank: global rank (names the trace file).
    """

    def __init__(self, enabled: bool, profile_steps: int, run_dir: str, rank: int = 0):
        self.enabled = bool(enabled) and int(profile_steps) > 0
        self.profile_steps = int(profile_steps)
        self.run_dir = run_dir
        self.rank = int(rank)
        self.paths: list[str] = []
        self._prof: Optional[Any] = None
        self._first: Optional[int] = None
        self._last = 0
        self._done = False

    def _activities(self) -> list[Any]:
        from torch.profiler import ProfilerActivity

        acts = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(ProfilerActivity.CUDA)
        return acts

    def _on_ready(self, prof: Any) -> None:
        first = (self._first or 0) + 1
        path = trace_path(self.run_dir, self.rank, first, self._last)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        prof.export_chrome_trace(path)
        self.paths.append(path)
        log.info("profiler trace written: %s", path)

    def step_start(self, step: int) -> None:
        if not self.enabled or self._done or self._prof is not None:
            return
        from torch.profiler import profile, schedule

        self._first = step
        self._prof = profile(activities=self._activities(),
                             schedule=schedule(wait=0, warmup=1, active=self.profile_steps, repeat=1),
                             on_trace_ready=self._on_ready, record_shapes=False, with_stack=False)
        self._prof.__enter__()

    def step_end(self, step: int) -> None:
        if self._prof is None:
            return
        self._last = step
        self._prof.step()
        if self._first is not None and step - self._first >= self.profile_steps:
            self.close()

    def close(self) -> None:
        """Stop recording; a partly recorded window is still written."""
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)
            self._done = True
