"""The allocator's cache flushes are counted by phase of the step (``memory/alloc_retries_<phase>``)."""

from __future__ import annotations

from rlcore.config import load_config
from rlcore.plugin_manager import build_plugin_manager
from rlcore.protocols import DistInfo
from rlcore.testing import demo_overrides
from rlcore.trainer import loop
from rlcore.trainer.loop import Trainer

OVERRIDES = ("algorithm.adv_estimator=grpo", "ppo.ppo_epochs=1", "ppo.mini_batch_size=0", "ppo.kl_coeff=0",
             "ppo.generation.max_new_tokens=6", "ppo.rollout_batch_size=4", "trainer.eval_samples=0",
             "trainer.progress=false", "trainer.gpu_monitor=false", "trainer.export_final=false", "plugins=[]")


def test_each_phase_reports_the_flushes_that_happened_inside_it(tmp_path, monkeypatch):
    cfg = load_config([], [*demo_overrides(tmp_path), *OVERRIDES])
    trainer = Trainer(cfg, build_plugin_manager([]), DistInfo())
    flushes = {"n": 0}
    monkeypatch.setattr(trainer.perf, "retries", lambda: flushes["n"])
    generate, update = trainer.c.generation.generate, loop.ppo_update

    def flushing_generate(*args, **kwargs):
        flushes["n"] += 2
        return generate(*args, **kwargs)

    def flushing_update(*args, **kwargs):
        flushes["n"] += 1
        return update(*args, **kwargs)

    monkeypatch.setattr(trainer.c.generation, "generate", flushing_generate)
    monkeypatch.setattr(loop, "ppo_update", flushing_update)
    first = trainer.train_step(1)
    assert first["memory/alloc_retries_generate"] == 2.0
    assert first["memory/alloc_retries_update"] == 1.0
    # phases without a flush say nothing
    assert "memory/alloc_retries_reward" not in first and "memory/alloc_retries_advantages" not in first
    # counted afresh each step
    monkeypatch.setattr(loop, "ppo_update", update)
    second = trainer.train_step(2)
    assert second["memory/alloc_retries_generate"] == 2.0
    assert "memory/alloc_retries_update" not in second
