"""A disk that fills at the write points after a checkpoint's data (its manifest, the ``latest``
pointer), during the final export, or while drawing the dashboard: a clear error and exit 2 with the
previous checkpoint intact (from which ``trainer.resume=auto`` continues as if nothing happened), or
for the dashboard a warning and a completed run. The full disk is an ``OSError(ENOSPC)`` raised at
the write point (or the error safetensors gives), in this process."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from rlcore.errors import EXIT_ERROR
from rlcore.testing import run_cli
from rlcore.trainer.store import files
from rlcore.trainer.store import manifest as mf

pytestmark = pytest.mark.slow

ARGS = ["--plugins", "sparse-logging", "trainer.log_steps=1", "trainer.progress=false", "trainer.eval_samples=4",
        "trainer.gpu_monitor=false", "ppo.rollout_batch_size=2", "ppo.generation.n=2", "ppo.mini_batch_size=2",
        "ppo.generation.max_new_tokens=4", "actor.rollout_backend=hf", "trainer.save_steps=1"]
COMPARED = ("loss/policy", "kl/mean", "actor/grad_norm", "reward/mean", "entropy/mean")


def _train(run: Path, *extra: str) -> tuple[int, str, str]:
    return run_cli(["train", *ARGS, f"trainer.output_dir={run}", *extra])


def _steps(run: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if r["split"] == "train"}


def _full(path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def _latest(run: Path) -> str:
    return (run / "checkpoints" / "latest").read_text().strip()


def test_full_disk_while_finishing_a_checkpoint_keeps_the_previous_and_resume_is_identical(tmp_path, monkeypatch):
    ref, run = tmp_path / "ref", tmp_path / "run"
    code, _, err = _train(ref, "trainer.max_steps=3", "trainer.export_final=false")
    assert code == 0, err
    write_manifest = mf.write_manifest

    def manifest_on_a_full_disk(root, *, step, **kw):
        if step == 2:
            (root / mf.MANIFEST).write_text("{")  # torn, as a write cut by the full disk leaves it
            raise _full(root / mf.MANIFEST)
        return write_manifest(root, step=step, **kw)

    monkeypatch.setattr(mf, "write_manifest", manifest_on_a_full_disk)
    code, _, err = _train(run, "trainer.max_steps=3", "trainer.export_final=false")
    assert code == EXIT_ERROR, err
    assert "could not finish checkpoint" in err and "no space left on the device" in err and "step_00000001" in err
    assert "Traceback" not in err
    ckpts = run / "checkpoints"
    assert _latest(run) == "step_00000001" and mf.verify(ckpts / "step_00000001") == []
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000001"]  # the torn save is gone
    monkeypatch.setattr(mf, "write_manifest", write_manifest)  # space freed
    code, _, err = _train(run, "trainer.max_steps=3", "trainer.export_final=false", "trainer.resume=auto")
    assert code == 0, err
    expected, got = _steps(ref), _steps(run)
    for step in (2, 3):
        assert {k: got[step][k] for k in COMPARED} == {k: expected[step][k] for k in COMPARED}, step


def test_full_disk_while_moving_latest_keeps_the_previous_pointer(tmp_path, monkeypatch):
    run = tmp_path / "run"
    write_pointer = files.write_pointer

    def pointer_on_a_full_disk(path, target):
        if target == "step_00000002":
            path.with_name(path.name + ".tmp").write_text("step_0")
            raise _full(path)
        write_pointer(path, target)

    monkeypatch.setattr(files, "write_pointer", pointer_on_a_full_disk)
    code, _, err = _train(run, "trainer.max_steps=2", "trainer.export_final=false")
    assert code == EXIT_ERROR, err
    assert "could not finish checkpoint" in err and "no space left" in err
    assert _latest(run) == "step_00000001" and not (run / "checkpoints" / "latest.tmp").exists()
    monkeypatch.setattr(files, "write_pointer", write_pointer)
    code, _, err = _train(run, "trainer.max_steps=2", "trainer.export_final=false", "trainer.resume=auto")
    assert code == 0, err
    assert _latest(run) == "step_00000002"


def test_full_disk_during_the_export_or_the_dashboard(tmp_path, monkeypatch):
    from matplotlib.figure import Figure
    from transformers import PreTrainedModel

    run = tmp_path / "run"
    save_pretrained = PreTrainedModel.save_pretrained

    def export_on_a_full_disk(self, save_dir, *a, **kw):  # what safetensors raises (not an OSError)
        if Path(save_dir).name != ".tmp-final":  # the demo model is written before training
            return save_pretrained(self, save_dir, *a, **kw)
        raise RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
                           'left on device" })')

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", export_on_a_full_disk)
    code, _, err = _train(run, "trainer.max_steps=1")
    assert code == EXIT_ERROR, err
    assert "could not export the model" in err and "trainer.resume=auto exports it again" in err
    assert not (run / "final").exists() and not (run / ".tmp-final").exists()
    assert _latest(run) == "step_00000001"
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", save_pretrained)
    monkeypatch.setattr(Figure, "savefig", lambda self, path, **kw: (Path(path).write_bytes(b"\x89PNG"),
                                                                     (_ for _ in ()).throw(_full(path))))
    code, out, err = _train(run, "trainer.max_steps=1", "trainer.resume=auto")
    assert code == 0, err  # the dashboard is not the run: a warning, not a failure
    assert (run / "final" / "config.json").is_file()
    assert "dashboard not drawn" in out and not list(run.glob("dashboard*"))
