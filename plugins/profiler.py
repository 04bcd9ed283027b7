"""``profiler`` (built in, always registered): ``trainer.enable_profiling`` through the step hooks.

It records ``trainer.profile_steps`` steps after one warm-up step with ``torch.profiler`` and writes
one Chrome trace per rank under ``<run_dir>/profile/`` (see :mod:`rlcore.observe.profiler`). Its
state is the instance registered with one plugin manager.
"""

from __future__ import annotations

from typing import Any, Optional

from rlcore.config.schema import TrainerConfig
from rlcore.hookspecs import hookimpl
from rlcore.observe.profiler import StepProfiler


class ProfilerPlugin:
    def __init__(self) -> None:
        self.profiler: Optional[StepProfiler] = None

    @hookimpl
    def rlcore_train_start(self, run_dir: str, dist: Any, config: dict[str, Any]) -> None:
        self._close()
        trainer = config.get("trainer") or {}
        if trainer.get("enable_profiling"):
            self.profiler = StepProfiler(True, int(trainer.get("profile_steps", TrainerConfig().profile_steps)),
                                         run_dir, dist.rank)

    @hookimpl(tryfirst=True)  # the step's other hooks are part of the step
    def rlcore_step_start(self, step: int) -> None:
        if self.profiler is not None:
            self.profiler.step_start(step)

    @hookimpl(trylast=True)
    def rlcore_step_end(self, step: int, metrics: dict[str, float]) -> None:
        if self.profiler is not None:
            self.profiler.step_end(step)

    @hookimpl
    def rlcore_train_end(self) -> None:
        self._close()

    def _close(self) -> None:
        if self.profiler is not None:
            self.profiler.close()
            self.profiler = None
