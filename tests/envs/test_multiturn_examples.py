"""Multi-turn runs end to end on CPU: every examples/multiturn* config validates and trains with the
demo's model, and the rollout's multi-turn counters reach metrics.jsonl."""

import glob
import json
import os

import pytest

from rlcore.cli import main
from rlcore.envs.sandbox import sandbox_level

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "examples", "multiturn*.yaml")))
QUIET = ["trainer.progress=false", "trainer.gpu_monitor=false"]


def train_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [m for m in map(json.loads, f) if m.get("split") == "train"]


def test_there_are_multiturn_examples():
    assert EXAMPLES, "no examples/multiturn*.yaml"


@pytest.mark.slow
@pytest.mark.parametrize("example", EXAMPLES)
def test_multiturn_example_validates_and_trains(example, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the examples name their data relative to the repository
    run = str(tmp_path / "run")
    # a host without namespaces trains the python example with what it has (strict would refuse it)
    sandbox = [] if sandbox_level().strict else ["env.python.sandbox=best-effort"]
    assert main(["validate", "--config", example, f"trainer.output_dir={run}", *sandbox]) == 0
    assert main(["train", "--config", example, "trainer.max_steps=1", f"trainer.output_dir={run}", *QUIET,
                 *sandbox]) == 0
    (step,) = train_metrics(run)
    assert step["env/episodes"] > 0
    assert "rollout/observation_tokens" in step and "env/truncated_frac" in step


def test_rollout_observation_tokens_and_env_waits_reach_metrics_jsonl(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": "a b c", "env": "guess", "secret": 50}) + "\n"
                             for _ in range(8)))
    run = str(tmp_path / "run")
    code = main(["train", f"data.train_files=[{train}]", "data.env_key=env", "actor.rollout_backend=engine",
                 "algorithm.adv_estimator=grpo", "ppo.rollout_batch_size=4", "ppo.generation.n=2",
                 "ppo.mini_batch_size=8", "ppo.generation.max_new_tokens=16", "data.max_prompt_length=8",
                 "env.max_turns=3", "env.stop=[]", "trainer.max_steps=1", "trainer.eval_samples=0",
                 "trainer.export_final=false", f"trainer.output_dir={run}", *QUIET])
    assert code == 0
    (step,) = train_metrics(run)
    # guess answers every wrong turn: observations are in every episode of more than one turn
    assert step["rollout/observation_tokens"] > 0, step
    assert step["rollout/env_waits"] >= 0
    assert step["env/observation_tokens_mean"] * step["env/episodes"] == step["rollout/observation_tokens"]
