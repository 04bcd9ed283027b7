"""End to end on CPU: the held-out reward of the demo task rises past a threshold within a bounded number of steps."""

import pytest

from rlcore.config import load_config
from rlcore.testing import demo_overrides
from rlcore.plugin_manager import build_plugin_manager
from rlcore.protocols import DistInfo
from rlcore.trainer.loop import Trainer

pytestmark = pytest.mark.slow


def run_demo(tmp_path, *overrides):
    cfg = load_config([], [*demo_overrides(tmp_path), "trainer.progress=false",
                                                   "trainer.gpu_monitor=false", "trainer.export_final=false",
                                                   *overrides])
    return Trainer(cfg, build_plugin_manager([]), DistInfo()).train()


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_reward_rises(tmp_path, estimator):
    summary = run_demo(tmp_path, f"algorithm.adv_estimator={estimator}", "trainer.max_steps=60")
    before, after = summary["before/reward_mean"], summary["after/reward_mean"]
    assert before < 0.2
    assert after > 0.5, f"{estimator}: held-out reward {before:.3f} -> {after:.3f}"


def test_rloo_learns(tmp_path):
    summary = run_demo(tmp_path, "algorithm.adv_estimator=rloo", "trainer.max_steps=60")
    assert summary["after/reward_mean"] - summary["before/reward_mean"] > 0.3
