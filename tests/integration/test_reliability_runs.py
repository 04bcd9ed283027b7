"""Whole ``rlcore train`` runs on CPU (the demo task, tiny settings) that must not report success
wrongly: a diverged run fails without saving or exporting NaN weights, an interrupted run has its own
exit code, a step's metrics are on disk before its checkpoint, and a resume names the overrides it
ignores. Each fails on the code before issue 21 was fixed."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch

from rlcore.errors import EXIT_ERROR, EXIT_INTERRUPTED
from rlcore.testing import run_cli

pytestmark = pytest.mark.slow

ARGS = ["--plugins", "sparse-logging", "trainer.log_steps=1", "trainer.progress=false", "trainer.eval_samples=4",
        "trainer.gpu_monitor=false", "ppo.rollout_batch_size=2", "ppo.generation.n=2", "ppo.mini_batch_size=2",
        "ppo.generation.max_new_tokens=4", "actor.rollout_backend=hf"]


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_diverging_run_fails_and_keeps_its_last_finite_checkpoint(tmp_path, caplog):
    run = tmp_path / "run"
    with caplog.at_level(logging.WARNING):
        code, _, err = run_cli(["train", *ARGS, f"trainer.output_dir={run}", "trainer.max_steps=10",
                                "trainer.save_steps=1", "trainer.save_total_limit=1", "actor.lr=1e5",
                                "trainer.max_nonfinite_steps=3", "trainer.resume=disable"])
    assert code == EXIT_ERROR, err
    assert "training diverged" in err and "trainer.max_nonfinite_steps=3" in err
    assert "skipping an optimizer step" in caplog.text
    assert not (run / "final").exists()
    (ckpt,) = [p for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")]
    weights = torch.load(ckpt / "actor.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in weights.values()), f"{ckpt.name} holds non-finite weights"
    train = [r for r in _records(run) if r["split"] == "train"]
    assert sum(r["train/nonfinite_steps"] for r in train) > 0
    summary = _records(run)[-1]
    assert summary["split"] == "summary" and summary["status"] == "failed"


def test_metrics_are_written_before_the_checkpoint_and_an_interrupted_run_exits_75(tmp_path, monkeypatch):
    from rlcore.trainer.checkpoint import DefaultCheckpointPolicy, GracefulExit

    run = tmp_path / "run"
    seen: dict[int, bool] = {}
    original = DefaultCheckpointPolicy.save

    def save(self, step, state):
        path = run / "metrics.jsonl"
        seen[step] = path.exists() and any(r["step"] == step and r["split"] == "train" for r in _records(run))
        return original(self, step, state)

    monkeypatch.setattr(DefaultCheckpointPolicy, "save", save)
    monkeypatch.setattr(GracefulExit, "requested", property(lambda self: self.signal_name is None
                                                            and len(seen) >= 2))
    code, out, err = run_cli(["train", *ARGS, f"trainer.output_dir={run}", "trainer.max_steps=10",
                              "trainer.save_steps=1", "trainer.resume=disable"])
    assert code == EXIT_INTERRUPTED, err
    assert "run interrupted at step" in out
    assert seen and all(seen.values()), f"a checkpoint came before its step's metrics: {seen}"
    code, out, _ = run_cli(["train", "--help"])
    assert code == 0 and "exit codes:" in out and f"{EXIT_INTERRUPTED}" in out


def test_resume_names_the_overrides_it_ignores(tmp_path, caplog):
    run = tmp_path / "run"
    code, _, err = run_cli(["train", *ARGS, f"trainer.output_dir={run}", "trainer.max_steps=1",
                            "trainer.export_final=false", "trainer.resume=disable"])
    assert code == 0, err
    with caplog.at_level(logging.WARNING):
        code, _, err = run_cli(["train", *ARGS, f"trainer.output_dir={run}", "trainer.max_steps=2",
                                "trainer.export_final=false", "trainer.resume=auto", "actor.lr=0.5",
                                "trainer.seed=7"])
    assert code == 0, err
    assert "differ from the checkpoint's and are ignored" in caplog.text
    assert "actor.lr=0.5 (the checkpoint's" in caplog.text and "trainer.seed=7" in caplog.text
    assert math.isfinite(_records(run)[-1]["step"])
