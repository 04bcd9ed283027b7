"""rlcore-wandb: send rlcore's metrics to Weights & Biases.

Select with ``--plugins wandb``. Settings live under ``plugin_config.wandb`` (:class:`WandbSettings`):
``project``, ``entity``, ``run_name``, ``tags``, ``group``, ``notes``, ``mode`` (online, offline,
disabled) and ``dir``.

At train start the resolved config becomes the run's config and the run id is written to
``<output_dir>/wandb_run_id``, so a resumed training run (``trainer.resume`` other than ``disable``)
continues the same W&B run. Each metrics call becomes one ``log`` at the trainer's step (evaluations under ``val/``);
at the end the run summary gets the training summary and the end status, and the dashboard image
(``rlcore plot``, when matplotlib is installed) is logged. Only the main rank talks to W&B.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from rlcore.errors import PluginError, RLCoreError
from rlcore.hookspecs import hookimpl
from rlcore.observe.sink import SinkHooks
from rlcore.plugin_settings import parse_settings

__version__ = "0.1.0"
RUN_ID_FILE = "wandb_run_id"
#: The run's end status -> the exit code W&B records (0: finished; anything else: failed).
EXIT_CODES = {"completed": 0, "interrupted": 75, "failed": 1}
MODES = ("online", "offline", "disabled")

log = logging.getLogger(__name__)


@dataclass
class WandbSettings:
    """``plugin_config.wandb``."""

    #: W&B project (null: ``WANDB_PROJECT``, else ``rlcore``).
    project: Optional[str] = None
    #: Team or user that owns the project (null: ``WANDB_ENTITY`` / the logged-in user's default).
    entity: Optional[str] = None
    #: Display name of the run (null: the run directory's name).
    run_name: Optional[str] = None
    #: Tags of the run.
    tags: list[str] = field(default_factory=list)
    #: Group of the run (e.g. one sweep's runs).
    group: Optional[str] = None
    #: Free-text notes of the run.
    notes: Optional[str] = None
    #: online, offline (written under ``dir``, synced later with ``wandb sync``) or disabled (null: ``WANDB_MODE``,
    #: else online).
    mode: Optional[str] = None
    #: Where W&B writes its local files (null: the run directory).
    dir: Optional[str] = None


settings_schema = WandbSettings


def numeric(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numbers of ``metrics`` (booleans and texts left out), their names prefixed."""
    return {prefix + k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError as e:
        raise PluginError("plugin 'wandb' (rlcore-wandb) needs the W&B client: pip install wandb") from e
    return wandb


def _check_mode(settings: WandbSettings) -> None:
    if settings.mode is not None and settings.mode not in MODES:
        raise PluginError(f"plugin_config.wandb.mode = {settings.mode!r}: must be one of {', '.join(MODES)}")


class WandbSink:
    """The W&B run of one training run: a sink of :mod:`rlcore.observe.sink`."""

    def __init__(self, run_dir: str, config: Mapping[str, Any], settings: WandbSettings):
        self.wandb = _import_wandb()
        _check_mode(settings)
        self.run_dir = run_dir
        os.makedirs(run_dir, exist_ok=True)
        # a resumed training run continues its W&B run; a fresh one (trainer.resume=disable) starts a new one
        fresh = str((config.get("trainer") or {}).get("resume", "auto")) == "disable"
        previous = None if fresh else self._previous_run_id()
        wandb_dir = settings.dir or run_dir
        os.makedirs(wandb_dir, exist_ok=True)
        self.run = self.wandb.init(
            project=settings.project or os.environ.get("WANDB_PROJECT") or "rlcore", entity=settings.entity,
            name=settings.run_name or os.path.basename(os.path.abspath(run_dir)), tags=list(settings.tags) or None,
            group=settings.group, notes=settings.notes, mode=settings.mode, dir=wandb_dir,
            id=previous, resume="allow" if previous else None, config=dict(config))
        if previous is None:
            self._remember_run_id()
        else:
            log.info("wandb: continuing run %s (%s)", previous, os.path.join(run_dir, RUN_ID_FILE))

    def _previous_run_id(self) -> Optional[str]:
        try:
            with open(os.path.join(self.run_dir, RUN_ID_FILE), encoding="utf-8") as f:
                return f.read().strip() or None
        except OSError:
            return None

    def _remember_run_id(self) -> None:
        with open(os.path.join(self.run_dir, RUN_ID_FILE), "w", encoding="utf-8") as f:
            f.write(self.run.id + "\n")

    def metrics(self, step: int, metrics: Mapping[str, Any], split: str) -> None:
        values = numeric(metrics, "" if split == "train" else f"{split}/")
        if values:
            self.run.log(values, step=int(step))

    def close(self, step: int, status: str, summary: Mapping[str, Any]) -> None:
        try:
            for key, value in numeric(summary).items():
                self.run.summary[key] = value
            self.run.summary["status"] = status
            image = self._dashboard() if status != "failed" else None
            if image is not None:
                self.run.log({"dashboard": self.wandb.Image(image)}, step=int(step))
        finally:
            self.run.finish(exit_code=EXIT_CODES.get(status, 1))

    def _dashboard(self) -> Optional[str]:
        """``dashboard.png`` drawn from the run's ``metrics.jsonl``; None (logged) when it cannot be drawn."""
        from rlcore.observe.plot import plot_run

        try:
            return plot_run(self.run_dir)
        except RLCoreError as e:  # no matplotlib, or no metrics file
            log.info("wandb: no dashboard image logged: %s", e)
            return None


def _settings(config: Mapping[str, Any]) -> WandbSettings:
    return parse_settings("wandb", WandbSettings, (config.get("plugin_config") or {}).get("wandb"))


def _make(run_dir: str, dist: Any, config: Mapping[str, Any]) -> Optional[WandbSink]:
    if not getattr(dist, "is_main", True):
        return None
    return WandbSink(run_dir, config, _settings(config))


#: The W&B run in progress (rebuilt at every train start); the hooks delegate to it.
RUN = SinkHooks(_make)
rlcore_train_start, rlcore_metrics, rlcore_train_end = RUN.hooks()


@hookimpl
def rlcore_preflight(config: Mapping[str, Any], plugins: list[str]) -> None:
    """The W&B client must import and the mode be known before a run starts (``rlcore validate`` checks it too)."""
    _check_mode(_settings(config))
    _import_wandb()
