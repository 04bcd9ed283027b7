"""Recipes end to end on the CPU demo task: GSPO, DAPO (dynamic sampling really dropping groups) and a LoRA
actor raise the held-out reward; DAPO's extra prompts keep a resumed run's data position exact; a LoRA run's
checkpoints hold the adapters and optimizer state only, and its export writes the adapter and a merged model."""

from __future__ import annotations

import pytest
import torch

from rlcore.config import load_config
from rlcore.testing import demo_overrides
from rlcore.hookspecs import hookimpl
from rlcore.plugin_manager import build_plugin_manager
from rlcore.protocols import DistInfo
from rlcore.trainer.loop import Trainer

pytestmark = pytest.mark.slow

DAPO = ("algorithm.adv_estimator=grpo", "algorithm.dynamic_sampling.enable=true", "ppo.cliprange_high=0.28",
        "ppo.loss_agg=token-mean", "algorithm.overlong_buffer.length=1")


class Recorder:
    """Keeps every step's metrics and the prompts of every rollout round."""

    def __init__(self):
        self.metrics: dict[int, dict] = {}
        self.prompts: list[tuple[int, list]] = []

    @hookimpl
    def rlcore_step_end(self, step, metrics):
        self.metrics[step] = dict(metrics)

    @hookimpl
    def rlcore_before_generation(self, step, prompts):
        self.prompts.append((step, [list(p) for p in prompts]))


def run_demo(tmp_path, *overrides):
    cfg = load_config([], [*demo_overrides(tmp_path), "trainer.progress=false",
                                                   "trainer.gpu_monitor=false", "trainer.export_final=false",
                                                   *overrides])
    pm = build_plugin_manager([])
    rec = Recorder()
    pm.register(rec)
    trainer = Trainer(cfg, pm, DistInfo())
    return trainer.train(), rec, trainer


def assert_learned(summary: dict, name: str, threshold: float) -> None:
    before, after = summary["before/reward_mean"], summary["after/reward_mean"]
    assert before < 0.2 and after > threshold, f"{name}: held-out reward {before:.3f} -> {after:.3f}"


def test_gspo_learns(tmp_path):
    summary, _, _ = run_demo(tmp_path, "algorithm.adv_estimator=grpo", "ppo.policy_loss=gspo",
                             "ppo.loss_agg=seq-mean-token-mean", "ppo.cliprange=0.003", "ppo.cliprange_high=0.004",
                             "trainer.max_steps=60")
    assert_learned(summary, "GSPO", 0.5)


def test_dapo_learns_with_groups_dropped(tmp_path):
    summary, rec, _ = run_demo(tmp_path, *DAPO, "trainer.max_steps=80")
    dropped = sum(m["dynamic_sampling/groups_dropped"] for m in rec.metrics.values())
    rounds = sum(m["dynamic_sampling/extra_rounds"] for m in rec.metrics.values())
    assert dropped > 0 and rounds > 0  # dynamic sampling was active: it dropped groups and drew more prompts
    # early on the batch is refilled to 16 groups; once the policy solves most prompts, the capped rounds may
    # leave fewer (groups that are all right are dropped too)
    assert all(rec.metrics[s]["dynamic_sampling/groups_kept"] == 16 for s in range(1, 6))
    assert_learned(summary, "DAPO", 0.4)


def test_dapo_resume_keeps_the_data_position_exact(tmp_path):
    """Extra prompts drawn by dynamic sampling are part of the saved data position: a run stopped after step 2
    and resumed draws exactly the prompts an uninterrupted run draws in steps 3 and 4."""
    common = (*DAPO, "trainer.eval_samples=4")
    _, straight, full = run_demo(tmp_path / "straight", *common, "trainer.max_steps=4")
    assert any(m["dynamic_sampling/extra_rounds"] > 0 for m in straight.metrics.values())
    run_demo(tmp_path / "split", *common, "trainer.max_steps=2")
    _, resumed, part = run_demo(tmp_path / "split", *common, "trainer.max_steps=4", "trainer.resume=auto")
    later = [(s, p) for s, p in straight.prompts if s > 2]
    assert resumed.prompts == later
    assert part.c.prompts.fill.state_dict() == full.c.prompts.fill.state_dict()


def test_lora_learns_checkpoints_adapters_and_exports_both(tmp_path):
    summary, _, trainer = run_demo(tmp_path, "algorithm.adv_estimator=grpo", "actor.lora.rank=16",
                                   "actor.lora.alpha=32", "trainer.max_steps=60", "trainer.save_steps=60",
                                   "trainer.export_final=true")
    assert_learned(summary, "LoRA", 0.5)
    assert trainer.c.ref is not None and list(trainer.c.ref.parameters()) == []  # no second copy of the model
    saved = torch.load(tmp_path / "checkpoints" / "step_00000060" / "actor.pt")
    trainable = {n for n, p in trainer.c.actor.model.named_parameters() if p.requires_grad}
    assert trainable <= set(saved) and all("lora_" in k or k.endswith("lm_head.weight") for k in saved)
    optim = torch.load(tmp_path / "checkpoints" / "step_00000060" / "actor_optim.pt")
    assert len(optim["state"]) == len(trainable)
    assert (tmp_path / "final-adapter" / "adapter_config.json").exists()
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"))
    ids = torch.tensor([[4, 5, 6, 7]])
    trainer.c.actor.model.eval()
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, trainer.c.actor.model(input_ids=ids).logits, atol=1e-4)
