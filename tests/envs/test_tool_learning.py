"""End to end on CPU: a task that cannot be solved without a tool is learned through multi-turn
rollouts of the engine (the held-out reward rises from about zero)."""

import json

import pytest

from rlcore.config import load_config
from rlcore.demo import DEMO_OVERRIDES, build_tool_model_dir, lookup_rows
from rlcore.plugin_manager import build_plugin_manager
from rlcore.protocols import DistInfo
from rlcore.trainer.loop import Trainer

pytestmark = pytest.mark.slow


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def tool_task_config(tmp_path, *overrides):
    model = build_tool_model_dir(str(tmp_path / "model"))
    train = write_rows(tmp_path / "train.jsonl", lookup_rows("train", 512))
    val = write_rows(tmp_path / "val.jsonl", lookup_rows("val", 64))
    return load_config([], list(DEMO_OVERRIDES) + [
        f"actor.model_path={model}", f"data.train_files=[{train}]", f"data.val_files=[{val}]", "data.env_key=env",
        "actor.rollout_backend=engine", "algorithm.adv_estimator=grpo", "ppo.generation.n=8",
        "ppo.rollout_batch_size=8", "ppo.mini_batch_size=64", "ppo.generation.max_new_tokens=10",
        "env.max_turns=2", "ppo.kl_coeff=0.0", "trainer.eval_samples=64", "trainer.log_steps=5",
        f"trainer.output_dir={tmp_path / 'run'}", "trainer.progress=false", "trainer.gpu_monitor=false",
        "trainer.export_final=false", "plugins=[]", *overrides])


def test_tool_task_is_learned(tmp_path):
    cfg = tool_task_config(tmp_path, "trainer.max_steps=140")
    summary = Trainer(cfg, build_plugin_manager([]), DistInfo()).train()
    before, after = summary["before/reward_mean"], summary["after/reward_mean"]
    assert before < 0.15, before
    # without the tool the best expected reward is a guess: (1 - CALL_REWARD) / len(LETTERS) ~ 0.07; the
    # call plus a guess ~ 0.27; above that the tool's answer is copied. Runs differ (environment answers
    # arrive at different decode steps, which changes the sampling order): 0.40 and 0.65 were seen.
    assert after > 0.3, f"held-out reward {before:.3f} -> {after:.3f}"
