"""A fresh run (``trainer.resume=disable``, the demo's setting) in a directory that holds an earlier
run keeps the earlier run's files: they are moved to ``previous-runs/``, not overwritten or pruned."""

from __future__ import annotations

import json

from rlcore.testing import run_cli

ARGS = ["trainer.progress=false", "trainer.eval_samples=4", "trainer.gpu_monitor=false", "trainer.log_steps=1",
        "trainer.resume=disable"]


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_demo_twice_in_one_directory_keeps_the_first_run(tmp_path):
    out = tmp_path / "run"
    code, _, err = run_cli(["train", f"trainer.output_dir={out}", "trainer.max_steps=2", *ARGS])
    assert code == 0, err
    first = records(out / "metrics.jsonl")
    steps = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert steps and max(r["step"] for r in first) == 2
    code, _, err = run_cli(["train", f"trainer.output_dir={out}", "trainer.max_steps=1", *ARGS])
    assert code == 0, err
    (archive,) = list((out / "previous-runs").iterdir())
    assert records(archive / "metrics.jsonl") == first
    assert sorted(p.name for p in (archive / "checkpoints").iterdir() if p.name.startswith("step_")) == steps
    assert (archive / "final" / "config.json").is_file()
    assert max(r["step"] for r in records(out / "metrics.jsonl")) == 1
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000001"
