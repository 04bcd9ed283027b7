"""Crashes and resumes of real ``rlcore train`` processes on CPU (the demo task, tiny settings).

One uninterrupted reference run, then a run killed (SIGKILL) in the middle of a step, resumed and
killed again in the middle of writing a checkpoint, and resumed once more: its per-step metrics
must equal the reference's exactly. A corrupt newest checkpoint is skipped with a warning while
resuming under a different world size (1 -> 2 processes, then 2 -> 1 through DCP shards).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REQUIRED = ("rlcore.trainer.loop", "rlcore.data.loader", "rlcore.rewards.backend", "rlcore.distributed.init",
            "rlcore.distributed.launch", "rlcore.rollout")
MISSING = [m for m in REQUIRED if importlib.util.find_spec(m) is None]
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bool(MISSING), reason=f"the training loop is not complete yet: {MISSING} missing")]

ARGS = ["--plugins", "sparse-logging", "trainer.log_steps=1", "trainer.save_steps=2", "trainer.progress=false",
        "trainer.eval_samples=4", "trainer.gpu_monitor=false", "trainer.export_final=false",
        "ppo.rollout_batch_size=2", "ppo.generation.n=2", "ppo.mini_batch_size=2", "ppo.generation.max_new_tokens=4",
        "actor.rollout_backend=hf", "trainer.resume=auto"]
#: Wall-clock or hardware dependent: everything else must repeat exactly.
VOLATILE = ("time", "time/", "perf/", "memory/", "gpu/", "reshard/")

#: Runs ``rlcore train`` and, at the step or save named by $HANG_AT, touches $HANG_MARKER and hangs
#: (so the test can SIGKILL it there). "save:N" first writes half of a file of checkpoint N.
HANGING_MAIN = r"""
import os, sys, time, pathlib
where, at = os.environ["HANG_AT"].split(":")
at, marker = int(at), pathlib.Path(os.environ["HANG_MARKER"])
def hang():
    marker.write_text("hanging")
    time.sleep(600)
if where == "step":
    from rlcore.trainer import loop
    original = loop.Trainer.train_step
    def train_step(self, step):
        if step == at:
            hang()
        return original(self, step)
    loop.Trainer.train_step = train_step
else:
    from rlcore.trainer.store import files as cs
    original = cs.save_file
    def save_file(obj, path):
        original(obj, path)
        if f".tmp-step_{at:08d}" in str(path) and path.name == "actor_optim.pt":
            data = path.read_bytes()
            path.write_bytes(data[: len(data) // 2])
            hang()
    cs.save_file = save_file
from rlcore.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", RLCORE_LOG_LEVEL="INFO")
    env.pop("HANG_AT", None)
    return env


def _train(run_dir: Path, *extra: str, timeout: float = 400) -> str:
    cmd = [sys.executable, "-m", "rlcore", "train", *ARGS, f"trainer.output_dir={run_dir}", *extra]
    p = subprocess.run(cmd, cwd=run_dir.parent, env=_env(), capture_output=True, text=True, timeout=timeout)
    out = p.stdout + p.stderr
    if p.returncode != 0:
        raise AssertionError(f"rlcore train failed ({p.returncode}):\n{out[-4000:]}")
    return out


def _train_and_kill(run_dir: Path, hang_at: str, *extra: str, timeout: float = 400) -> str:
    """Start a run that hangs at ``hang_at`` ("step:N" or "save:N"); SIGKILL it there; return its output."""
    marker = run_dir.parent / f"{run_dir.name}.{hang_at.replace(':', '-')}.hanging"
    env = dict(_env(), HANG_AT=hang_at, HANG_MARKER=str(marker))
    log_path = run_dir.parent / f"{run_dir.name}.{hang_at.replace(':', '-')}.log"
    cmd = [sys.executable, "-c", HANGING_MAIN, "train", *ARGS, f"trainer.output_dir={run_dir}", *extra]
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, cwd=run_dir.parent, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not marker.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        reached = marker.exists()
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
    out = log_path.read_text()
    assert reached, f"the run never reached {hang_at}:\n{out[-4000:]}"
    return out


def _metrics(run_dir: Path) -> dict[int, dict]:
    """Last train record of every step (a resumed run rewrites the steps after its checkpoint)."""
    records = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["split"] == "train":
            records[rec["step"]] = {k: v for k, v in rec.items() if not k.startswith(VOLATILE)}
    return records


def _latest(run_dir: Path) -> str:
    return (run_dir / "checkpoints" / "latest").read_text().strip()


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory) -> Path:
    """The demo model built once and copied into each run (every run then starts from identical state)."""
    from rlcore.demo import ensure_demo_model

    root = tmp_path_factory.mktemp("demo") / "_demo"
    ensure_demo_model(str(root))
    return root


def _new_run(base: Path, name: str, demo_model: Path) -> Path:
    run_dir = base / name
    shutil.copytree(demo_model, run_dir / "_demo")
    return run_dir


@pytest.fixture(scope="module")
def reference(tmp_path_factory, demo_model) -> Path:
    run_dir = _new_run(tmp_path_factory.mktemp("ref"), "ref", demo_model)
    _train(run_dir, "trainer.max_steps=4")
    return run_dir


def test_sigkill_in_a_step_and_in_a_save_then_resume_repeats_the_reference(tmp_path, demo_model, reference):
    expected = _metrics(reference)
    assert sorted(expected) == [1, 2, 3, 4]
    run_dir = _new_run(tmp_path, "crashy", demo_model)

    _train_and_kill(run_dir, "step:3", "trainer.max_steps=4")
    assert _latest(run_dir) == "step_00000002"
    assert not (run_dir / "checkpoints" / "step_00000004").exists()

    out = _train_and_kill(run_dir, "save:4", "trainer.max_steps=4")
    assert "resumed from" in out and "step_00000002 (step 2)" in out
    assert (run_dir / "checkpoints" / ".tmp-step_00000004").is_dir()
    assert _latest(run_dir) == "step_00000002"

    out = _train(run_dir, "trainer.max_steps=4")
    assert "step_00000002 (step 2)" in out
    assert _latest(run_dir) == "step_00000004"
    assert not (run_dir / "checkpoints" / ".tmp-step_00000004").exists()
    got = _metrics(run_dir)
    for step in (3, 4):
        assert got[step] == expected[step], f"step {step} differs after resuming"


def test_corrupt_latest_falls_back_and_world_size_changes_reshard(tmp_path, reference):
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "resharded"
    shutil.copytree(reference, run_dir)
    actor = run_dir / "checkpoints" / "step_00000004" / "actor.pt"
    actor.write_bytes(actor.read_bytes()[:-100])

    out = _train(run_dir, "trainer.max_steps=5", "trainer.nproc_per_node=2")
    assert "step_00000004 is incomplete or corrupt" in out and "falling back to the previous one" in out
    assert "resumed from" in out and "step_00000002 (step 2)" in out
    assert "written by 1 process(es), this run has 2" in out and "resharded" in out
    assert _latest(run_dir) == "step_00000005"
    manifest = json.loads((run_dir / "checkpoints" / "step_00000005" / "manifest.json").read_text())
    assert manifest["format"] == "dcp" and manifest["world_size"] == 2
    assert sorted(_metrics(run_dir)) == [1, 2, 3, 4, 5]

    out = _train(run_dir, "trainer.max_steps=6", "trainer.export_final=true")
    assert "step_00000005 (step 5)" in out and "written by 2 process(es), this run has 1" in out
    assert _latest(run_dir) == "step_00000006"
    model = AutoModelForCausalLM.from_pretrained(str(run_dir / "final"))
    assert model.config.num_hidden_layers >= 1


def test_sigterm_finishes_the_step_saves_and_stops(tmp_path, demo_model):
    run_dir = _new_run(tmp_path, "terminated", demo_model)
    # steps of ~75 ms: many of them, so that the run is still going when the signal comes however late this
    # (loaded) process sees the first record
    cmd = [sys.executable, "-m", "rlcore", "train", *ARGS, f"trainer.output_dir={run_dir}", "trainer.max_steps=2000",
           "trainer.save_steps=0"]
    log_path = tmp_path / "terminated.log"
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=log, stderr=subprocess.STDOUT)
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while p.poll() is None and time.monotonic() < deadline:
            if metrics.exists() and '"split": "train"' in metrics.read_text():
                break
            time.sleep(0.1)
        p.send_signal(signal.SIGTERM)
        code = p.wait(timeout=300)
    out = log_path.read_text()
    from rlcore.errors import EXIT_INTERRUPTED

    assert code == EXIT_INTERRUPTED, out[-4000:]  # not 0: `rlcore train && deploy final/` must not go on
    assert "received SIGTERM" in out and "run interrupted at step" in out
    last = json.loads(metrics.read_text().splitlines()[-1])
    assert last["split"] == "summary" and last["status"] == "interrupted" and last["step"] < 2000
    assert _latest(run_dir) == f"step_{last['step']:08d}"


def test_unwritable_or_full_output_dir_fails_before_models_load(tmp_path, monkeypatch):
    from rlcore.testing import run_cli
    from rlcore.trainer.store import files

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    code, out, err = run_cli(["train", f"trainer.output_dir={blocker / 'run'}"])
    assert code == 2 and "trainer.output_dir=" in err and "cannot be created" in err
    monkeypatch.setattr(files, "free_bytes", lambda path: 5 * 2**20)
    code, out, err = run_cli(["train", f"trainer.output_dir={tmp_path / 'full'}"])
    assert code == 2 and "nearly full: 5 MiB free" in err
    assert not (tmp_path / "full" / "_demo").exists()  # nothing was built or loaded
