"""The default checkpoint policy: schedule, atomic layout, rotation, verified resume with fallback, export."""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from rlcore.config.schema import TrainerConfig
from rlcore.errors import CheckpointError
from rlcore.protocols import CheckpointPolicy, DistInfo
from rlcore.rlmath import make_kl_controller
from rlcore.trainer.store import manifest as mf
from rlcore.trainer.store import state as stored
from rlcore.trainer.checkpoint import (
    DefaultCheckpointPolicy,
    RNGState,
    archive_previous_run,
    check_output_dir,
    check_resume,
    list_checkpoints,
)


class Counter:
    """Stands in for the data loader and the trainer counters."""

    def __init__(self) -> None:
        self.pos = 0

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, s):
        self.pos = int(s["pos"])


class Run:
    """A tiny model trained on random data: every step draws from all RNG streams."""

    def __init__(self, seed: int = 0):
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.01)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1.0 / (1 + s))
        self.kl = make_kl_controller("adaptive", 0.1, 6.0, 100)
        self.data, self.trainer = Counter(), Counter()
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.rng = RNGState({"update": self.gen})

    def state(self):
        return {"actor": self.model, "actor_optim": self.opt, "actor_sched": self.sched, "kl_ctrl": self.kl,
                "data": self.data, "trainer": self.trainer, "rng": self.rng}

    def step(self) -> float:
        x = torch.randn(4, 8) + float(np.random.rand()) + random.random()
        x = x[torch.randperm(4, generator=self.gen)]
        loss = self.model(x).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.sched.step()
        self.kl.update(loss.item(), 4)
        self.data.pos += 1
        self.trainer.pos += 1
        return loss.item()


def policy(tmp_path: Path, **kw) -> DefaultCheckpointPolicy:
    cfg = TrainerConfig(output_dir=str(tmp_path / "run"), **kw)
    return DefaultCheckpointPolicy(cfg, DistInfo())


def test_policy_satisfies_protocol_and_schedule(tmp_path):
    p = policy(tmp_path, save_steps=5)
    assert isinstance(p, CheckpointPolicy)
    assert [s for s in range(0, 16) if p.should_save(s)] == [5, 10, 15]
    assert p.should_save(7, final=True) and not p.should_save(0, final=True)
    assert not any(policy(tmp_path, save_steps=0).should_save(s) for s in range(1, 20))


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    ref = Run()
    losses = [ref.step() for _ in range(6)]
    run = Run()
    for _ in range(3):
        run.step()
    path = policy(tmp_path).save(3, run.state())
    assert path and Path(path).name == "step_00000003"
    for _ in range(2):  # diverge before "crashing"
        run.step()
    fresh = Run(seed=123)
    assert policy(tmp_path).resume(fresh.state()) == 3
    assert fresh.data.pos == 3 and fresh.trainer.pos == 3
    assert [fresh.step() for _ in range(3)] == losses[3:]
    assert fresh.kl.value == ref.kl.value
    assert fresh.sched.get_last_lr() == ref.sched.get_last_lr()


def test_a_save_before_the_first_optimizer_step_changes_nothing(tmp_path):
    """A run whose first steps train nothing (partial rollouts, dynamic sampling) may save before its
    optimizer ever stepped: the save leaves the optimizer unstepped (reading its state through DCP would
    initialise Adam with a step count of 1), and so does a resume from it."""
    ref = Run()
    losses = [ref.step() for _ in range(3)]
    saved = Run()
    policy(tmp_path).save(1, saved.state())
    assert not saved.opt.state
    assert [saved.step() for _ in range(3)] == losses
    fresh = Run(seed=123)
    assert policy(tmp_path).resume(fresh.state()) == 1 and not fresh.opt.state
    assert [fresh.step() for _ in range(3)] == losses


def test_layout_pointer_manifest_and_rotation(tmp_path):
    p = policy(tmp_path, save_total_limit=2)
    run = Run()
    for step in (1, 2, 3):
        run.step()
        p.save(step, run.state())
    root = tmp_path / "run" / "checkpoints"
    assert [c.name for c in list_checkpoints(root)] == ["step_00000003", "step_00000002"]
    assert (root / "latest").read_text().strip() == "step_00000003"
    manifest = mf.read_manifest(root / "step_00000003")
    assert manifest["step"] == 3 and manifest["format"] == "torch" and manifest["world_size"] == 1
    assert {"actor.pt", "actor_optim.pt", "state/rank_00000.pt"} <= set(manifest["files"])
    assert manifest["kinds"]["actor"] == "model" and manifest["kinds"]["rng"] == "rng"
    assert not [c for c in root.iterdir() if c.name.startswith(".")]


def test_same_step_is_written_once_and_step_zero_never(tmp_path):
    p = policy(tmp_path)
    run = Run()
    assert p.save(0, run.state()) is None
    first = p.save(4, run.state())
    mtime = os.stat(Path(first) / "manifest.json").st_mtime_ns
    assert p.save(4, run.state()) == first
    assert os.stat(Path(first) / "manifest.json").st_mtime_ns == mtime


def _two_checkpoints(tmp_path):
    p = policy(tmp_path, save_total_limit=3)
    run = Run()
    run.step()
    p.save(1, run.state())
    run.step()
    p.save(2, run.state())
    return tmp_path / "run" / "checkpoints"


@pytest.mark.parametrize("damage", ["truncate", "flip", "manifest", "missing"])
def test_corrupt_latest_falls_back_with_a_warning(tmp_path, caplog, damage):
    root = _two_checkpoints(tmp_path)
    latest = root / "step_00000002"
    target = latest / "actor.pt"
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:100])
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "manifest":
        (latest / "manifest.json").write_text("{not json")
    else:
        (latest / "state" / "rank_00000.pt").unlink()
    fresh = Run(seed=5)
    with caplog.at_level(logging.WARNING, logger="rlcore.trainer.checkpoint"):
        assert policy(tmp_path).resume(fresh.state()) == 1
    assert "step_00000002" in caplog.text and "falling back" in caplog.text
    assert fresh.trainer.pos == 1


def test_interrupted_save_is_ignored(tmp_path):
    root = _two_checkpoints(tmp_path)
    (root / ".tmp-step_00000003").mkdir()
    (root / ".tmp-step_00000003" / "actor.pt").write_bytes(b"partial")
    assert policy(tmp_path).resume(Run().state()) == 2
    p = policy(tmp_path)
    run = Run()
    p.save(3, run.state())  # a later save replaces the leftover
    assert (root / "latest").read_text().strip() == "step_00000003"
    assert mf.verify(root / "step_00000003") == []


def test_explicit_resume_path_is_strict(tmp_path):
    root = _two_checkpoints(tmp_path)
    assert policy(tmp_path, resume=str(root / "step_00000001")).resume(Run().state()) == 1
    assert policy(tmp_path, resume=str(tmp_path / "run")).resume(Run().state()) == 2
    (root / "step_00000001" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="manifest.json"):
        policy(tmp_path, resume=str(root / "step_00000001")).resume(Run().state())
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        policy(tmp_path, resume=str(tmp_path / "nowhere")).resume(Run().state())


def test_resume_target_is_checked_before_any_model_loads(tmp_path):
    root = _two_checkpoints(tmp_path)
    for ok in ("auto", "disable", str(tmp_path / "run"), str(root), str(root / "step_00000001")):
        check_resume(TrainerConfig(resume=ok))
    with pytest.raises(CheckpointError, match="did you mean 'disable'"):
        check_resume(TrainerConfig(resume="disabled"))
    with pytest.raises(CheckpointError, match="no such checkpoint directory.*a checkpoint path"):
        check_resume(TrainerConfig(resume=str(tmp_path / "nowhere")))
    (root / "step_00000001" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="step_00000001 is not a complete checkpoint"):
        check_resume(TrainerConfig(resume=str(root / "step_00000001")))


def test_a_fresh_run_moves_an_earlier_one_aside(tmp_path, caplog):
    root = _two_checkpoints(tmp_path)
    run_dir = root.parent
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / "final").mkdir()
    (run_dir / "_demo").mkdir()
    (run_dir / "notes.txt").write_text("mine")
    saved = [c.name for c in list_checkpoints(root)]
    with caplog.at_level(logging.WARNING):
        moved = archive_previous_run(str(run_dir), stamp="T")
    assert moved == run_dir / "previous-runs" / "T"
    assert sorted(p.name for p in moved.iterdir()) == ["checkpoints", "final", "metrics.jsonl"]
    assert [c.name for c in list_checkpoints(moved / "checkpoints")] == saved and saved
    assert (moved / "metrics.jsonl").read_text() == '{"step": 1}\n'
    # files that are not a run's own stay where they are
    assert sorted(p.name for p in run_dir.iterdir()) == ["_demo", "notes.txt", "previous-runs"]
    assert "moved to" in caplog.text and "nothing was deleted" in caplog.text
    assert archive_previous_run(str(run_dir), stamp="T") is None  # nothing left to move
    (run_dir / "metrics.jsonl").write_text("{}\n")
    assert archive_previous_run(str(run_dir), stamp="T") == run_dir / "previous-runs" / "T-1"
    assert (moved / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_only_an_earlier_rlcore_run_is_moved_aside(tmp_path, caplog):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "mine").mkdir(parents=True)  # a user's own folders, no run of ours
    (run_dir / "final").mkdir()
    assert archive_previous_run(str(run_dir), stamp="T") is None
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "final"]
    # a finished run (metrics and final model, no checkpoint): moved, and not called resumable
    (run_dir / "metrics.jsonl").write_text("{}\n")
    with caplog.at_level(logging.WARNING):
        moved = archive_previous_run(str(run_dir), stamp="T")
    assert sorted(p.name for p in moved.iterdir()) == ["checkpoints", "final", "metrics.jsonl"]
    assert "moved to" in caplog.text and "would have continued" not in caplog.text
    caplog.clear()
    root = _two_checkpoints(tmp_path / "unfinished")  # checkpoints and no final model: resumable
    with caplog.at_level(logging.WARNING):
        assert archive_previous_run(str(root.parent), stamp="T") is not None
    assert "trainer.resume=auto would have continued it" in caplog.text


def test_disable_and_empty_dir_start_fresh(tmp_path):
    _two_checkpoints(tmp_path)
    assert policy(tmp_path, resume="disable").resume(Run().state()) == 0
    assert policy(tmp_path / "other").resume(Run().state()) == 0


def test_missing_state_entry_is_a_clear_error(tmp_path):
    _two_checkpoints(tmp_path)
    state = Run().state()
    state["critic"] = torch.nn.Linear(2, 2)
    with pytest.raises(CheckpointError, match="critic"):
        policy(tmp_path).resume(state)


def test_async_save_writes_the_state_of_the_save_call(tmp_path):
    p = policy(tmp_path, async_save=True)
    run = Run()
    run.step()
    expected = {k: v.clone() for k, v in run.model.state_dict().items()}
    p.save(1, run.state())
    with torch.no_grad():
        for param in run.model.parameters():
            param.add_(1.0)
    p.wait()
    fresh = Run(seed=9)
    assert policy(tmp_path).resume(fresh.state()) == 1
    for k, v in fresh.model.state_dict().items():
        torch.testing.assert_close(v, expected[k])


def test_async_saves_reuse_their_staging_copy_without_mixing_steps(tmp_path):
    p = policy(tmp_path, async_save=True, save_total_limit=0)
    run = Run()
    run.step()
    first = {k: v.clone() for k, v in run.model.state_dict().items()}
    p.save(1, run.state())
    ptr = p._staging.tree["actor"]["0.weight"].data_ptr()
    run.step()
    second = {k: v.clone() for k, v in run.model.state_dict().items()}
    p.save(2, run.state())  # waits for save 1, then refills the same buffers
    p.wait()
    assert p._staging.tree["actor"]["0.weight"].data_ptr() == ptr
    root = tmp_path / "run" / "checkpoints"
    for step, expected in ((1, first), (2, second)):
        fresh = Run(seed=9)
        assert policy(tmp_path, resume=str(root / f"step_{step:08d}")).resume(fresh.state()) == step
        for k, v in fresh.model.state_dict().items():
            torch.testing.assert_close(v, expected[k])


def test_stage_copies_into_matching_buffers_only():
    a, b = torch.ones(3), torch.zeros(2)
    tree = {"t": a, "groups": [{"lr": 0.1, "params": ["x"]}], "u": b}
    copy1 = stored.stage(tree)
    assert copy1["t"] is not a and torch.equal(copy1["t"], a)
    a.add_(1)
    tree["u"] = torch.zeros(5)
    copy2 = stored.stage(tree, copy1)
    assert copy2["t"] is copy1["t"] and torch.equal(copy2["t"], a)  # refilled in place
    assert copy2["u"] is not copy1["u"] and copy2["u"].shape == (5,)  # new shape: new buffer
    assert copy2["groups"] == [{"lr": 0.1, "params": ["x"]}] and copy2["groups"] is not tree["groups"]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_dcp_format_round_trip_in_one_process(tmp_path, asynchronous):
    run = Run()
    run.step()
    tmp = tmp_path / "ckpt"
    tmp.mkdir()
    done = []
    pending = stored.write_state(tmp, run.state(), "dcp", DistInfo(), asynchronous=asynchronous,
                                on_done=lambda: done.append(1))
    if pending is not None:
        pending.result()
    kinds = {k: stored.kind_of(k, v, run.state()) for k, v in run.state().items()}
    mf.write_manifest(tmp, step=1, world_size=1, fmt="dcp", kinds=kinds)
    assert mf.verify(tmp) == [] and (tmp / "dcp" / ".metadata").is_file()
    assert done == ([1] if asynchronous else [])
    params = [p.detach().clone() for p in run.model.parameters()]
    expected = run.step()  # the saved RNG streams are the ones this step drew from
    fresh = Run(seed=3)
    stored.load_state(tmp, mf.read_manifest(tmp), fresh.state(), DistInfo(), seed=0)
    for a, b in zip(fresh.model.parameters(), params):
        torch.testing.assert_close(a, b)
    assert fresh.step() == expected


def test_rng_state_round_trip():
    gen = torch.Generator().manual_seed(7)
    rng = RNGState({"g": gen})
    saved = rng.state_dict()
    draws = (random.random(), float(np.random.rand()), float(torch.rand(1)), float(torch.rand(1, generator=gen)))
    rng.load_state_dict(saved)
    again = (random.random(), float(np.random.rand()), float(torch.rand(1)), float(torch.rand(1, generator=gen)))
    assert draws == again


def test_check_output_dir_errors_before_training(tmp_path, monkeypatch):
    check_output_dir(TrainerConfig(output_dir=str(tmp_path / "ok" / "nested")))
    assert (tmp_path / "ok" / "nested").is_dir() and not list((tmp_path / "ok" / "nested").iterdir())
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match=r"trainer.output_dir=.*cannot be created"):
        check_output_dir(TrainerConfig(output_dir=str(blocker / "run")))
    from rlcore.trainer.store import files
    monkeypatch.setattr(files, "free_bytes", lambda path: 10 * 2**20)
    with pytest.raises(CheckpointError, match="nearly full: 10 MiB free"):
        check_output_dir(TrainerConfig(output_dir=str(tmp_path / "ok")))


def test_export_is_a_loadable_hf_directory(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlcore.testing import make_tiny_model_dir

    src = make_tiny_model_dir(str(tmp_path / "model"), hidden_size=32)
    model = AutoModelForCausalLM.from_pretrained(src)
    tok = AutoTokenizer.from_pretrained(src)
    with torch.no_grad():
        next(model.parameters()).add_(0.5)
    out = policy(tmp_path).export(model, tok, "final")
    assert out == str(tmp_path / "run" / "final")
    loaded = AutoModelForCausalLM.from_pretrained(out)
    for (k, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        torch.testing.assert_close(a, b, msg=k)
    assert AutoTokenizer.from_pretrained(out).pad_token == tok.pad_token
    with pytest.raises(CheckpointError, match="save_pretrained"):
        policy(tmp_path).export(torch.nn.Linear(2, 2), None)


def test_graceful_exit_turns_the_first_signal_into_a_request():
    import signal

    from rlcore.trainer.checkpoint import GracefulExit

    # a job started in the background inherits SIGINT ignored; the test wants Python's own handler
    signal.signal(signal.SIGINT, signal.default_int_handler)
    before = signal.getsignal(signal.SIGTERM)
    with GracefulExit() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.signal_name == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):  # a second signal gets the previous handler
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) == before
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
