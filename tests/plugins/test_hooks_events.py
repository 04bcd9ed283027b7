"""Lifecycle events and the checkpoint-policy factory, seen by a plugin through a real (tiny) training run."""

from __future__ import annotations

from typing import Any

import pytest

from rlcore.testing import demo_overrides
from rlcore.config import load_config
from rlcore.config.schema import TrainerConfig
from rlcore.hookspecs import hookimpl
from rlcore.protocols import CheckpointPolicy, DistInfo

STEP_EVENTS = ["rlcore_step_start", "rlcore_before_generation", "rlcore_after_generation",
               "rlcore_after_update", "rlcore_step_end"]


class EventRecorder:
    """Records every lifecycle event; some implementations take a subset of the arguments, in another order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    @hookimpl
    def rlcore_train_start(self, config, run_dir):
        self.calls.append(("rlcore_train_start", {"run_dir": run_dir, "config": config}))

    @hookimpl
    def rlcore_step_start(self, step):
        self.calls.append(("rlcore_step_start", {"step": step}))

    @hookimpl
    def rlcore_before_generation(self, step, prompts):
        self.calls.append(("rlcore_before_generation", {"step": step, "prompts": len(prompts)}))

    @hookimpl
    def rlcore_after_generation(self, step, rollout):
        self.calls.append(("rlcore_after_generation", {"step": step, "rows": rollout.batch_size}))

    @hookimpl
    def rlcore_after_update(self, step, metrics):
        self.calls.append(("rlcore_after_update", {"step": step, "keys": set(metrics)}))

    @hookimpl
    def rlcore_step_end(self, metrics, step):
        metrics["test/extra"] = 7.0  # step_end may extend the metrics in place
        self.calls.append(("rlcore_step_end", {"step": step, "keys": set(metrics)}))

    @hookimpl
    def rlcore_metrics(self, step, metrics, split):
        self.calls.append(("rlcore_metrics", {"step": step, "split": split, "keys": set(metrics)}))

    @hookimpl
    def rlcore_train_end(self, step, status, summary):
        self.calls.append(("rlcore_train_end", {"step": step, "status": status, "summary": summary}))


class RecordingCheckpoints:
    """A checkpoint policy that writes nothing and records what the trainer asks of it."""

    def __init__(self, trainer: TrainerConfig, final: bool = True) -> None:
        self.trainer, self.final = trainer, final
        self.asked: list[tuple] = []

    def should_save(self, step, *, final=False):
        self.asked.append(("should_save", step, final))
        return step == 1 or (final and self.final)

    def save(self, step, state):
        self.asked.append(("save", step, sorted(state)))
        return None

    def resume(self, state):
        self.asked.append(("resume", sorted(state)))
        return 0

    def export(self, model, tokenizer, name="final"):
        self.asked.append(("export", name))
        return None

    def wait(self):
        self.asked.append(("wait",))


class CheckpointPlugin:
    def __init__(self) -> None:
        self.policy: RecordingCheckpoints | None = None

    @hookimpl
    def rlcore_checkpoint_policy(self, trainer):
        self.policy = RecordingCheckpoints(trainer)
        return self.policy


@pytest.mark.slow
def test_events_reach_a_plugin_in_order(tmp_path, rlcore_pm, rlcore_register):
    from rlcore.trainer.loop import Trainer

    events, checkpoints = rlcore_register(EventRecorder(), "recorder"), rlcore_register(CheckpointPlugin(), "ckpt")
    cfg = load_config([], demo_overrides(
        tmp_path, "trainer.max_steps=2", "trainer.progress=false",
        "ppo.rollout_batch_size=4", "trainer.eval_samples=8", "trainer.gpu_monitor=false"))
    Trainer(cfg, rlcore_pm, DistInfo()).train()

    names = [n for n, _ in events.calls]
    assert names[0] == "rlcore_train_start" and names[-1] == "rlcore_train_end"
    first, last = names.index("rlcore_step_start"), len(names) - 1 - names[::-1].index("rlcore_step_end")
    assert names[first:last + 2] == STEP_EVENTS + STEP_EVENTS + ["rlcore_metrics"]
    # The held-out evaluations report with split="val" before and after training; the step metrics once (log_steps=10).
    metrics = [kw for n, kw in events.calls if n == "rlcore_metrics"]
    assert [(m["step"], m["split"]) for m in metrics] == [(0, "val"), (2, "train"), (2, "val")]
    assert names.index("rlcore_metrics") < first < last < len(names) - 2

    by_step = {(n, kw.get("step")): kw for n, kw in events.calls[first:last + 1]}
    n_samples = 4 * cfg.ppo.generation.n
    for step in (1, 2):
        assert by_step[("rlcore_before_generation", step)]["prompts"] == n_samples
        assert by_step[("rlcore_after_generation", step)]["rows"] == n_samples
        assert "loss/policy" in by_step[("rlcore_after_update", step)]["keys"]
        assert {"reward/mean", "time/step_s", "test/extra"} <= by_step[("rlcore_step_end", step)]["keys"]
    assert "test/extra" in metrics[1]["keys"]
    start, end = events.calls[0][1], events.calls[-1][1]
    assert start["run_dir"] == str(tmp_path) and start["config"]["trainer"]["max_steps"] == 2
    assert end["step"] == 2 and end["status"] == "completed" and "after/reward_mean" in end["summary"]

    # The plugin's checkpoint policy replaced the default one and got the trainer section only.
    policy = checkpoints.policy
    assert isinstance(policy, CheckpointPolicy) and isinstance(policy.trainer, TrainerConfig)
    kinds = [a[0] for a in policy.asked]
    assert kinds == ["resume", "should_save", "save", "should_save", "should_save", "save", "wait", "export"]
    assert [a[1:] for a in policy.asked if a[0] == "should_save"] == [(1, False), (2, False), (2, True)]
    saves = [a for a in policy.asked if a[0] == "save"]
    assert [s[1] for s in saves] == [1, 2]  # step 1 as asked, step 2 the final save the policy agreed to
    assert {"actor", "actor_optim", "trainer", "data", "rng"} <= set(saves[0][2])
    assert not (tmp_path / "checkpoints").exists()


def test_checkpoint_policy_factory_precedence(tmp_path, rlcore_pm, rlcore_register):
    from rlcore.trainer.checkpoint import DefaultCheckpointPolicy

    trainer = TrainerConfig(output_dir=str(tmp_path))
    default = rlcore_pm.build("rlcore_checkpoint_policy", trainer=trainer, dist=DistInfo())
    assert isinstance(default, DefaultCheckpointPolicy) and isinstance(default, CheckpointPolicy)

    class Passing:
        @hookimpl
        def rlcore_checkpoint_policy(self, trainer, dist):
            return None

    rlcore_register(Passing(), "passing")
    assert isinstance(rlcore_pm.build("rlcore_checkpoint_policy", trainer=trainer, dist=DistInfo()),
                      DefaultCheckpointPolicy)
    plugin = rlcore_register(CheckpointPlugin(), "ckpt")
    built = rlcore_pm.build("rlcore_checkpoint_policy", trainer=trainer, dist=DistInfo())
    assert built is plugin.policy and built.trainer is trainer

    from rlcore.errors import PluginError

    rlcore_register(CheckpointPlugin(), "ckpt-2")
    with pytest.raises(PluginError, match="'ckpt' and 'ckpt-2' both answer rlcore_checkpoint_policy"):
        rlcore_pm.build("rlcore_checkpoint_policy", trainer=trainer, dist=DistInfo())
