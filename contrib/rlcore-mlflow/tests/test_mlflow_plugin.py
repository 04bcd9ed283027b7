"""The mlflow plugin: name and config functions always; the MLflow round trip only when the client is installed."""

from __future__ import annotations

import sys

import pytest

import rlcore_mlflow
from rlcore.errors import PluginError
from rlcore.protocols import DistInfo

CONFIG = {"trainer": {"max_steps": 3, "output_dir": "x"}, "ppo": {"kl_coeff": 0.1, "generation": {"n": 4}},
          "plugins": ["mlflow"], "data": {"train_files": ["a" * 900]}}


def test_names_params_and_values():
    assert rlcore_mlflow.metric_name("reward/mean") == "reward/mean"
    assert rlcore_mlflow.metric_name("score/exact@1(x)") == "score/exact_1_x_"
    params = dict(rlcore_mlflow.flatten(CONFIG))
    assert params["ppo.generation.n"] == "4" and params["plugins"] == "['mlflow']"
    assert len(params["data.train_files"]) == rlcore_mlflow.MAX_PARAM_LEN
    assert rlcore_mlflow.numeric({"a": 1, "b": float("nan"), "c": "x", "d": True}, "val/") == {"val/a": 1.0}


def test_missing_client_is_a_clear_plugin_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(PluginError, match=r"needs the MLflow client: pip install mlflow-skinny"):
        rlcore_mlflow.rlcore_train_start(run_dir=str(tmp_path), dist=DistInfo(), config=CONFIG)
    with pytest.raises(PluginError, match="plugin 'mlflow'"):  # before anything loads (rlcore validate too)
        rlcore_mlflow.rlcore_preflight(config=CONFIG, plugins=["mlflow"])


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow", reason="the MLflow client is not installed")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a local file store, no server or database
    uri = (tmp_path / "mlruns").as_uri()
    yield mlflow, uri
    if mlflow.active_run() is not None:
        mlflow.end_run()


def _config(uri, run_dir):
    return {**CONFIG, "plugin_config": {"mlflow": {"tracking_uri": uri, "experiment": "rl", "tags": {"team": "x"}}},
            "trainer": {"output_dir": str(run_dir)}}


def test_run_params_metrics_status_and_resume(mlflow_store, tmp_path):
    mlflow, uri = mlflow_store
    run_dir = tmp_path / "run"
    cfg = _config(uri, run_dir)
    rlcore_mlflow.rlcore_train_start(run_dir=str(run_dir), dist=DistInfo(), config=cfg)
    rlcore_mlflow.rlcore_metrics(step=1, metrics={"reward/mean": 0.25, "time/step_s": 1.5}, split="train")
    rlcore_mlflow.rlcore_metrics(step=2, metrics={"reward/mean": 0.5}, split="train")
    rlcore_mlflow.rlcore_train_end(step=2, status="interrupted", summary={"after/reward_mean": 0.5})
    run_id = (run_dir / rlcore_mlflow.RUN_ID_FILE).read_text().strip()

    rlcore_mlflow.rlcore_train_start(run_dir=str(run_dir), dist=DistInfo(), config=cfg)  # resumed training
    rlcore_mlflow.rlcore_metrics(step=3, metrics={"reward/mean": 0.75}, split="train")
    rlcore_mlflow.rlcore_metrics(step=3, metrics={"reward_mean": 0.6}, split="val")
    rlcore_mlflow.rlcore_train_end(step=3, status="completed", summary={})

    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["team"] == "x"
    assert run.data.params["ppo.generation.n"] == "4"
    history = client.get_metric_history(run_id, "reward/mean")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert run.data.metrics["val/reward_mean"] == 0.6 and run.data.metrics["summary/after/reward_mean"] == 0.5
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_other_ranks_stay_silent(mlflow_store, tmp_path):
    mlflow, uri = mlflow_store
    rlcore_mlflow.rlcore_train_start(run_dir=str(tmp_path / "r"), dist=DistInfo(rank=1, world_size=2),
                                     config=_config(uri, tmp_path / "r"))
    rlcore_mlflow.rlcore_metrics(step=1, metrics={"a": 1.0}, split="train")
    rlcore_mlflow.rlcore_train_end(step=1, status="completed", summary={})
    assert mlflow.active_run() is None and not (tmp_path / "r" / rlcore_mlflow.RUN_ID_FILE).exists()
