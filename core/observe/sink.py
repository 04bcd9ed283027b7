"""Metrics sinks as plugins: one sink object per training run, behind the three logging hooks.

A sink has ``metrics(step, metrics, split)`` and ``close(step, status, summary)``. A plugin class
derives from :class:`SinkHooks` (its instance, registered with one plugin manager, holds the run's
sink; the entry point names the class)::

    class MyPlugin(SinkHooks):
        def __init__(self):
            super().__init__(lambda run_dir, dist, config: MySink(run_dir) if dist.is_main else None)

A new sink is built at every train start (a sink left open by a run that died is closed as
``failed`` first), so no state leaks from one run to the next. A plugin module can instead expose
the three functions of :meth:`SinkHooks.hooks`.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Protocol

from rlcore.hookspecs import hookimpl


class Sink(Protocol):
    def metrics(self, step: int, metrics: Mapping[str, Any], split: str) -> None: ...

    def close(self, step: int, status: str, summary: Mapping[str, Any]) -> None: ...


class SinkHooks:
    """Holds the sink of the run in progress.

    :param factory: ``factory(run_dir, dist, config)`` -> a sink, or None to record nothing in this process.
    """

    def __init__(self, factory: Callable[[str, Any, Mapping[str, Any]], Optional[Sink]]):
        self.factory = factory
        self.current: Optional[Sink] = None

    def start(self, run_dir: str, dist: Any, config: Mapping[str, Any]) -> None:
        self.end(0, "failed", {})
        self.current = self.factory(run_dir, dist, config)

    def record(self, step: int, metrics: Mapping[str, Any], split: str) -> None:
        if self.current is not None:
            self.current.metrics(step, metrics, split)

    def end(self, step: int, status: str, summary: Mapping[str, Any]) -> None:
        sink, self.current = self.current, None
        if sink is not None:
            sink.close(step, status, summary)

    @hookimpl
    def rlcore_train_start(self, run_dir: str, dist: Any, config: Mapping[str, Any]) -> None:
        self.start(run_dir, dist, config)

    @hookimpl
    def rlcore_metrics(self, step: int, metrics: Mapping[str, Any], split: str) -> None:
        self.record(step, metrics, split)

    @hookimpl(trylast=True)  # the summary as every other plugin left it
    def rlcore_train_end(self, step: int, status: str, summary: Mapping[str, Any]) -> None:
        self.end(step, status, summary)

    def hooks(self) -> tuple[Callable[..., None], Callable[..., None], Callable[..., None]]:
        """``rlcore_train_start``, ``rlcore_metrics`` and ``rlcore_train_end`` implementations."""

        @hookimpl
        def rlcore_train_start(run_dir, dist, config):
            self.start(run_dir, dist, config)

        @hookimpl
        def rlcore_metrics(step, metrics, split):
            self.record(step, metrics, split)

        @hookimpl
        def rlcore_train_end(step, status, summary):
            self.end(step, status, summary)

        return rlcore_train_start, rlcore_metrics, rlcore_train_end
