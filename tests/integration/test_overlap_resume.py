"""A run with the overlapped update (``ppo.overlap_update``) stopped after step 2 and resumed trains steps 3
and 4 exactly as the uninterrupted run: the same weights, bit for bit, and the same metrics."""

from __future__ import annotations

import pytest
import torch
from test_recipes import run_demo

pytestmark = pytest.mark.slow

OVERLAP = ("algorithm.adv_estimator=grpo", "ppo.ppo_epochs=1", "ppo.mini_batch_size=0", "ppo.kl_coeff=0",
           "ppo.micro_batch_size=6", "ppo.generation.max_new_tokens=10", "ppo.rollout_batch_size=8",
           "trainer.eval_samples=0", "ppo.overlap_update=true")


def test_a_resumed_overlapped_run_repeats_the_uninterrupted_one(tmp_path):
    _, straight, full = run_demo(tmp_path / "straight", *OVERLAP, "trainer.max_steps=4")
    run_demo(tmp_path / "split", *OVERLAP, "trainer.max_steps=2", "trainer.save_steps=2")
    _, resumed, part = run_demo(tmp_path / "split", *OVERLAP, "trainer.max_steps=4", "trainer.resume=auto")
    assert sorted(resumed.metrics) == [3, 4]
    for step in (3, 4):
        assert resumed.metrics[step]["update/overlapped_frac"] > 0
        for key in ("loss/policy", "entropy/mean", "actor/grad_norm", "reward/mean", "update/overlapped_frac"):
            assert resumed.metrics[step][key] == straight.metrics[step][key], (step, key)
    for (name, a), b in zip(full.c.actor.model.named_parameters(), part.c.actor.model.parameters()):
        assert torch.equal(a, b), name
