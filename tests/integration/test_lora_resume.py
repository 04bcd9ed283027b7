"""A LoRA run with adapter dropout, interrupted and resumed, repeats the uninterrupted run exactly:
nothing draws from the global torch RNG between the checkpoint and the next step's dropout masks
(the data loader's iterator used to draw its workers' seed from it on its first batch)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlcore.errors import EXIT_INTERRUPTED
from rlcore.testing import run_cli

pytest.importorskip("peft")
pytestmark = pytest.mark.slow

ARGS = ["--plugins", "sparse-logging", "trainer.log_steps=1", "trainer.progress=false", "trainer.eval_samples=0",
        "trainer.gpu_monitor=false", "ppo.rollout_batch_size=2", "ppo.generation.n=2", "ppo.mini_batch_size=2",
        "ppo.generation.max_new_tokens=4", "actor.rollout_backend=hf", "trainer.save_steps=1",
        "trainer.max_steps=3", "trainer.export_final=false", "actor.lora.rank=4", "actor.lora.dropout=0.3",
        "actor.lr=1e-2", "trainer.resume=auto"]
COMPARED = ("loss/policy", "kl/mean", "actor/grad_norm", "entropy/mean", "reward/mean")


def _steps(run: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: r.get(k) for k in COMPARED} for r in records if r["split"] == "train"}


def test_lora_with_dropout_resumes_exactly(tmp_path, monkeypatch):
    from rlcore.trainer.checkpoint import GracefulExit

    ref, run = tmp_path / "ref", tmp_path / "run"
    code, _, err = run_cli(["train", *ARGS, f"trainer.output_dir={ref}"])
    assert code == 0, err
    with monkeypatch.context() as m:  # a SIGTERM during step 1: it finishes, saves and stops
        m.setattr(GracefulExit, "requested", property(lambda self: True))
        code, _, err = run_cli(["train", *ARGS, f"trainer.output_dir={run}"])
    assert code == EXIT_INTERRUPTED, err
    code, _, err = run_cli(["train", *ARGS, f"trainer.output_dir={run}"])
    assert code == 0, err
    expected, got = _steps(ref), _steps(run)
    assert sorted(got) == [1, 2, 3]
    for step in (2, 3):
        assert got[step] == expected[step], f"step {step} after the resume differs"
