"""The W&B sink (contrib/rlcore-wandb) in offline mode: what a run logs is read back from the offline
run directory with wandb's own reader (its transaction-log reader and record protocol)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from contrib_site import ROOT, install_contrib, subprocess_env
from rlcore.errors import PluginError
from rlcore.protocols import DistInfo

sys.path.insert(0, os.path.join(ROOT, "contrib", "rlcore-wandb"))  # importable without installing
import rlcore_wandb  # noqa: E402

CONFIG = {"trainer": {"max_steps": 3, "resume": "auto"}, "ppo": {"kl_coeff": 0.1},
          "plugin_config": {"wandb": {"project": "rl", "tags": ["ppo", "demo"], "run_name": "first"}}}


@pytest.fixture
def offline(monkeypatch):
    pytest.importorskip("wandb", reason="the W&B client is not installed (pip install -e '.[test]')")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_PROJECT", raising=False)


def read_offline(run_dir) -> list[dict]:
    """Each offline run under ``run_dir/wandb`` (oldest first): its id, project, tags, name, config,
    history rows, summary and exit code, as wandb's reader gives them back."""
    from wandb.proto import wandb_internal_pb2 as pb
    from wandb.sdk.internal.datastore import DataStore

    runs = []
    found = glob.glob(os.path.join(str(run_dir), "wandb", "offline-run-*", "run-*.wandb"))
    for path in sorted(found, key=os.path.getmtime):  # a run's log is written up to its end
        store, out = DataStore(), {"history": [], "summary": {}, "config": {}, "dir": os.path.dirname(path)}
        store.open_for_scan(path)
        while (data := store.scan_data()) is not None:
            record = pb.Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                out.update(id=record.run.run_id, project=record.run.project, tags=list(record.run.tags),
                           name=record.run.display_name)
                out["config"].update({i.key: json.loads(i.value_json) for i in record.run.config.update})
            elif kind == "history":
                out["history"].append({_key(i): json.loads(i.value_json) for i in record.history.item})
            elif kind == "summary":
                out["summary"].update({_key(i): json.loads(i.value_json) for i in record.summary.update})
            elif kind == "exit":
                out["exit_code"] = record.exit.exit_code
        runs.append(out)
    return runs


def _key(item) -> str:
    """A history or summary item's name (kept whole, or as the parts of a nested name)."""
    return item.key or "/".join(item.nested_key)


def series(run: dict, key: str) -> list[tuple[int, float]]:
    return [(row["_step"], row[key]) for row in run["history"] if key in row]


def test_history_config_summary_and_resume_offline(offline, tmp_path):
    run_dir = tmp_path / "run"
    rlcore_wandb.rlcore_train_start(run_dir=str(run_dir), dist=DistInfo(), config=CONFIG)
    rlcore_wandb.rlcore_metrics(step=1, metrics={"reward/mean": 0.25, "note": "x", "bad": float("nan")}, split="train")
    rlcore_wandb.rlcore_metrics(step=2, metrics={"reward/mean": 0.5}, split="train")
    rlcore_wandb.rlcore_train_end(step=2, status="interrupted", summary={"after/reward_mean": 0.5})
    run_id = (run_dir / rlcore_wandb.RUN_ID_FILE).read_text().strip()

    rlcore_wandb.rlcore_train_start(run_dir=str(run_dir), dist=DistInfo(), config=CONFIG)  # trainer.resume=auto
    rlcore_wandb.rlcore_metrics(step=3, metrics={"reward/mean": 0.75}, split="train")
    rlcore_wandb.rlcore_metrics(step=3, metrics={"reward_mean": 0.6}, split="val")
    rlcore_wandb.rlcore_train_end(step=3, status="completed", summary={"after/reward_mean": 0.6})

    first, second = read_offline(run_dir)
    assert first["id"] == second["id"] == run_id  # the resumed training continues the same W&B run
    assert first["project"] == "rl" and first["tags"] == ["ppo", "demo"] and first["name"] == "first"
    assert first["config"]["ppo"] == {"kl_coeff": 0.1} and first["config"]["trainer"]["max_steps"] == 3
    assert series(first, "reward/mean") == [(1, 0.25), (2, 0.5)] and "note" not in first["history"][0]
    assert first["summary"]["status"] == "interrupted" and first["exit_code"] == rlcore_wandb.EXIT_CODES["interrupted"]
    assert series(second, "reward/mean") == [(3, 0.75)] and series(second, "val/reward_mean") == [(3, 0.6)]
    assert second["summary"]["after/reward_mean"] == 0.6 and second["exit_code"] == 0

    fresh = {**CONFIG, "trainer": {"resume": "disable"}}  # a fresh training run starts a new W&B run
    rlcore_wandb.rlcore_train_start(run_dir=str(run_dir), dist=DistInfo(), config=fresh)
    rlcore_wandb.rlcore_train_end(step=0, status="completed", summary={})
    assert read_offline(run_dir)[-1]["id"] != run_id != (run_dir / rlcore_wandb.RUN_ID_FILE).read_text().strip()


def test_other_ranks_stay_silent(offline, tmp_path):
    rlcore_wandb.rlcore_train_start(run_dir=str(tmp_path / "r"), dist=DistInfo(rank=1, world_size=2), config=CONFIG)
    rlcore_wandb.rlcore_metrics(step=1, metrics={"a": 1.0}, split="train")
    rlcore_wandb.rlcore_train_end(step=1, status="completed", summary={})
    assert not (tmp_path / "r").exists()


def test_settings_and_missing_client_are_clear_errors(monkeypatch, tmp_path):
    from rlcore.errors import ConfigError

    bad = {"plugin_config": {"wandb": {"projet": "x"}}}
    with pytest.raises(ConfigError, match=r"plugin_config.wandb.projet.*did you mean 'project'"):
        rlcore_wandb.rlcore_preflight(config=bad, plugins=["wandb"])
    with pytest.raises(PluginError, match="plugin_config.wandb.mode = 'offlne'"):
        rlcore_wandb.rlcore_preflight(config={"plugin_config": {"wandb": {"mode": "offlne"}}}, plugins=["wandb"])
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(PluginError, match=r"needs the W&B client: pip install wandb"):
        rlcore_wandb.rlcore_preflight(config=CONFIG, plugins=["wandb"])


@pytest.mark.slow
def test_train_with_plugins_wandb_logs_and_resumes(offline, tmp_path_factory, tmp_path):
    """``rlcore train --plugins wandb`` on the demo: metrics at their steps, evaluations, the summary and the
    dashboard image; the same command with more steps and ``trainer.resume=auto`` continues the run."""
    pytest.importorskip("matplotlib", reason="the dashboard needs matplotlib (in the test extras)")
    site = install_contrib("rlcore-wandb", "wandb", "rlcore_wandb", str(tmp_path_factory.mktemp("site")), force=True)
    run_dir = tmp_path / "run"
    base = [sys.executable, "-m", "rlcore", "train", "--plugins", "wandb", "trainer.log_steps=1",
            "trainer.progress=false", "trainer.eval_samples=8", f"trainer.output_dir={run_dir}",
            "plugin_config.wandb.project=demo", "trainer.save_steps=1"]
    env = subprocess_env(site, WANDB_MODE="offline", WANDB_SILENT="true")
    for steps in (2, 3):
        proc = subprocess.run(base + [f"trainer.max_steps={steps}", "trainer.resume=auto"], capture_output=True,
                              text=True, cwd=str(tmp_path), env=env, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    first, second = read_offline(run_dir)
    assert first["id"] == second["id"] == (run_dir / rlcore_wandb.RUN_ID_FILE).read_text().strip()
    assert [s for s, _ in series(first, "reward/mean")] == [1, 2] and [s for s, _ in series(second, "reward/mean")] == [3]
    assert [s for s, _ in series(first, "val/reward_mean")] == [0, 2] and series(second, "val/reward_mean")[0][0] == 3
    assert first["config"]["trainer"]["output_dir"] == str(run_dir) and first["config"]["ppo"]["generation"]["n"] == 4
    assert "after/reward_mean" in second["summary"] and second["summary"]["status"] == "completed"
    image = [row for row in second["history"] if row.get("dashboard/_type") == "image-file"]  # a wandb.Image
    assert image and image[0]["_step"] == 3
    assert os.path.isfile(os.path.join(second["dir"], "files", image[0]["dashboard/path"]))
