"""rlcore-mlflow: send rlcore's metrics to an MLflow tracking server.

Select with ``--plugins mlflow``. Settings live under ``plugin_config.mlflow``:

* ``tracking_uri`` - server or store (default: MLflow's own default / ``MLFLOW_TRACKING_URI``);
* ``experiment`` - experiment name (default ``rlcore``);
* ``run_name`` - run name (default: the run directory's name);
* ``tags`` - extra run tags, a mapping.

At train start the resolved config is logged as parameters (flattened, dotted keys) and the run
id is written to ``<output_dir>/mlflow_run_id``, so a resumed training run continues the same
MLflow run. Each metrics call becomes one ``log_metrics`` at the step (evaluations under
``val/``); the end status maps to FINISHED / KILLED / FAILED. Only the main rank talks to MLflow.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Iterator, Mapping, Optional

from rlcore.errors import PluginError
from rlcore.hookspecs import hookimpl
from rlcore.observe.sink import SinkHooks

__version__ = "0.1.0"
RUN_ID_FILE = "mlflow_run_id"
MAX_PARAM_LEN = 500
BATCH = 100
STATUS = {"completed": "FINISHED", "interrupted": "KILLED", "failed": "FAILED"}
_BAD_CHARS = re.compile(r"[^0-9A-Za-z_\-. /]")


def metric_name(name: str) -> str:
    """A name MLflow accepts (letters, digits, ``_ - . /`` and spaces)."""
    return _BAD_CHARS.sub("_", name)


def flatten(tree: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    """``(dotted.key, text)`` for every leaf of a nested mapping; long texts are cut to MLflow's limit."""
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from flatten(v, f"{prefix}{k}.")
        return
    yield prefix[:-1], str(tree)[:MAX_PARAM_LEN]


def numeric(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[metric_name(prefix + k)] = float(v)
    return out


def _import_mlflow() -> Any:
    try:
        import mlflow
    except ImportError as e:
        raise PluginError("plugin 'mlflow' (rlcore-mlflow) needs the MLflow client: "
                          "pip install mlflow-skinny (or mlflow)") from e
    return mlflow


class MlflowSink:
    """The MLflow run of one training run: a sink of :mod:`rlcore.observe.sink`."""

    def __init__(self, run_dir: str, config: Mapping[str, Any], settings: Mapping[str, Any]):
        self.mlflow = _import_mlflow()
        self.run_dir = run_dir
        if settings.get("tracking_uri"):
            self.mlflow.set_tracking_uri(str(settings["tracking_uri"]))
        self.mlflow.set_experiment(str(settings.get("experiment") or "rlcore"))
        previous = self._previous_run_id()
        if previous is not None:
            self.run = self.mlflow.start_run(run_id=previous)
        else:
            name = settings.get("run_name") or os.path.basename(os.path.abspath(run_dir))
            self.run = self.mlflow.start_run(run_name=str(name))
            self._log_params(config)
            self._remember_run_id()
        tags = {"rlcore.run_dir": os.path.abspath(run_dir), **dict(settings.get("tags") or {})}
        self.mlflow.set_tags({k: str(v) for k, v in tags.items()})

    def _previous_run_id(self) -> Optional[str]:
        try:
            with open(os.path.join(self.run_dir, RUN_ID_FILE)) as f:
                return f.read().strip() or None
        except OSError:
            return None

    def _remember_run_id(self) -> None:
        os.makedirs(self.run_dir, exist_ok=True)
        with open(os.path.join(self.run_dir, RUN_ID_FILE), "w") as f:
            f.write(self.run.info.run_id + "\n")

    def _log_params(self, config: Mapping[str, Any]) -> None:
        params = dict(flatten(config))
        keys = sorted(params)
        for i in range(0, len(keys), BATCH):
            self.mlflow.log_params({k: params[k] for k in keys[i:i + BATCH]})

    def metrics(self, step: int, metrics: Mapping[str, Any], split: str) -> None:
        values = numeric(metrics, "" if split == "train" else f"{split}/")
        if values:
            self.mlflow.log_metrics(values, step=int(step))

    def close(self, step: int, status: str, summary: Mapping[str, Any]) -> None:
        values = numeric(summary, "summary/")
        if values:
            self.mlflow.log_metrics(values, step=int(step))
        self.mlflow.end_run(status=STATUS.get(status, "FAILED"))


def _make(run_dir: str, dist: Any, config: Mapping[str, Any]) -> Optional[MlflowSink]:
    if not getattr(dist, "is_main", True):
        return None
    settings = dict((config.get("plugin_config") or {}).get("mlflow") or {})
    return MlflowSink(run_dir, config, settings)


#: The MLflow run in progress (rebuilt at every train start); the hooks delegate to it.
RUN = SinkHooks(_make)
rlcore_train_start, rlcore_metrics, rlcore_train_end = RUN.hooks()


@hookimpl
def rlcore_preflight(config: Mapping[str, Any], plugins: list[str]) -> None:
    """The MLflow client must import before a run is started (``rlcore validate`` checks it too)."""
    _import_mlflow()
