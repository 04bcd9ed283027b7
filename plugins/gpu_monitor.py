"""``gpu-monitor`` (built in, always registered): GPU utilisation and memory through the training steps.

With ``trainer.gpu_monitor`` (on by default) it samples every ``trainer.gpu_monitor_interval``
seconds from the first step to the last (see :mod:`rlcore.observe.gpu`), adds the samples since the
previous logged step to the metrics of each logged step (``gpu/util_mean`` ...) and the whole run's
to the summary; readings taken during a rollout are tagged ``generate``, the rest of a step ``train``,
and summarised apart too (``gpu/util_mean_generate``, ``gpu/util_p10_train``, ``gpu/util_mean_generate_tail``
for the rollout's last quarter). Readings taken outside a step (from ``rlcore_step_end`` to the next
``rlcore_step_start``: evaluation, checkpoint saves, whatever a caller runs between steps) are tagged
``outside``: they are left out of the health keys (``gpu/util_mean``, ``gpu/util_p10``,
``gpu/longest_dip_s`` ...) and reported as ``gpu/util_mean_outside`` and ``gpu/outside_s``. Without a
GPU or NVML it does nothing. Its state is the instance registered with one plugin manager.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from rlcore.config.schema import TrainerConfig
from rlcore.hookspecs import hookimpl
from rlcore.observe.gpu import GENERATE, OUTSIDE, TRAIN, GPUMonitor


class GPUMonitorPlugin:
    def __init__(self) -> None:
        self.monitor: Optional[GPUMonitor] = None
        self.interval_s = 0.0
        self.log_steps, self.max_steps = 1, 0

    @hookimpl
    def rlcore_train_start(self, config: dict[str, Any]) -> None:
        self._stop()
        trainer = {**dataclasses.asdict(TrainerConfig()), **(config.get("trainer") or {})}
        self.interval_s = float(trainer["gpu_monitor_interval"]) if trainer["gpu_monitor"] else 0.0
        self.log_steps, self.max_steps = int(trainer["log_steps"]), int(trainer["max_steps"])
        self.monitor = GPUMonitor(self.interval_s, phase=OUTSIDE)  # not in a step until the first starts

    @hookimpl
    def rlcore_step_start(self, step: int) -> None:
        if self.monitor is not None:
            self.monitor.set_phase(TRAIN)  # before start(): the thread's first reading is in the step
            self.monitor.start()  # once: a started monitor, or one that found no GPU, ignores the call

    @hookimpl
    def rlcore_before_generation(self, step: int) -> None:
        if self.monitor is not None:
            self.monitor.set_phase(GENERATE)

    @hookimpl
    def rlcore_after_generation(self, step: int) -> None:
        if self.monitor is not None:
            self.monitor.set_phase(TRAIN)

    @hookimpl
    def rlcore_step_end(self, step: int, metrics: dict[str, float]) -> None:
        if self.monitor is None:
            return
        if step % self.log_steps == 0 or step == self.max_steps:
            metrics.update(self.monitor.interval_summary())
        self.monitor.set_phase(OUTSIDE)  # until the next step starts: evaluation, checkpoint saves ...
        if step == self.max_steps:  # the final evaluation and save are not training
            self.monitor.stop()

    @hookimpl(tryfirst=True)  # before the sinks record the summary
    def rlcore_train_end(self, summary: dict[str, float]) -> None:
        if self.monitor is not None:
            self.monitor.stop()
            summary.update(self.monitor.summary())
        self._stop()

    def _stop(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()
            self.monitor = None
