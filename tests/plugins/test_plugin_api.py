"""The plugin boundary as a third-party author meets it (issue: plugin API defects).

The fixture package ``fixtures/rlcore_everything.py`` answers every factory hook from the docs alone;
these tests train with it and check each promise of docs/hooks.md and docs/plugins.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest
import torch

import rlcore.demo
from rlcore.config import load_config
from rlcore.errors import ConfigError, PluginError
from rlcore.hookspecs import hookimpl
from rlcore.plugin_manager import BUILTIN_MODULES, build_plugin_manager
from rlcore.protocols import DistInfo
from rlcore.testing import run_cli

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


@pytest.fixture
def installed(monkeypatch):
    """The fixture plugin (and a few broken ones) installed under names, as an entry point would."""
    monkeypatch.syspath_prepend(FIXTURES)
    monkeypatch.setitem(BUILTIN_MODULES, "everything", "rlcore_everything:EverythingPlugin")
    monkeypatch.setitem(BUILTIN_MODULES, "everything-too", "rlcore_everything:EverythingPlugin")
    monkeypatch.setitem(BUILTIN_MODULES, "broken", "rlcore_no_such_module")
    yield
    sys.modules.pop("rlcore_everything", None)


def _config(tmp_path, *extra):
    return load_config([], ["plugins=[everything]", "actor.rollout_backend=everything", "trainer.max_steps=2",
                            "trainer.progress=false", "trainer.log_steps=1", "trainer.eval_samples=4",
                            "trainer.gpu_monitor=false", "trainer.export_final=false", "trainer.resume=disable",
                            "ppo.rollout_batch_size=4", "ppo.generation.n=2", "ppo.generation.max_new_tokens=4",
                            "algorithm.adv_estimator=grpo", "data.max_prompt_length=8",
                            f"trainer.output_dir={tmp_path}", *extra])


@pytest.mark.slow
def test_a_plugin_written_from_the_docs_answers_every_factory_hook_and_trains(installed, tmp_path):
    from rlcore.trainer.loop import Trainer

    cfg = _config(tmp_path, "plugin_config.everything.reward_scale=2.0", "plugin_config.everything.save_final=false")
    pm = build_plugin_manager(list(cfg.plugins))
    plugin = pm.get_plugin("everything")
    trainer = Trainer(cfg, pm, DistInfo())
    summary = trainer.train()

    assert trainer.status == "completed" and trainer.state.step == 2
    built = plugin.built
    assert {"dataset/train", "dataset/val", "placement", "reshard", "reward", "checkpoint", "rollout"} <= set(built)
    assert built["rollout"].calls >= 4 and built["rollout"].syncs >= 1  # steps and evaluations; fresh weights
    reward = built["reward"]
    assert reward.run_dir == str(tmp_path) and reward.scale == 2.0  # its own settings and the run directory
    assert all(0.0 <= s <= 2.0 for s in [summary["before/reward_mean"], summary["after/reward_mean"]])
    # The policy decided the end of the run: asked with final=True, declined, nothing saved; then waited.
    asked = built["checkpoint"].asked
    assert ("should_save", 2, True) in asked and not any(a[0] == "save" for a in asked) and asked[-1] == ("wait",)
    assert not (tmp_path / "everything-save.json").exists()
    # Every run has a record, with no logging plugin selected.
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["split"] for r in records].count("train") == 2 and records[-1]["split"] == "summary"
    # Prompt and response text reach the reward decoded alike (the demo's word tokenizer joins words
    # when decoding: the row's text "f g h" comes back as the tokens decode it, like the responses).
    tok = trainer.c.tokenizer
    batch = reward.batches[-1]
    assert batch.prompts == tok.batch_decode(batch.prompt_ids, skip_special_tokens=True)
    assert batch.responses == tok.batch_decode(batch.response_ids, skip_special_tokens=True)
    assert batch.extras["prompt"][0] in {r["prompt"] for r in built["dataset/val"].rows}  # the raw text stays


def test_settings_are_typed_and_unknown_keys_are_named(installed):
    pm = build_plugin_manager(["everything"])
    assert pm.settings_of("everything").reward_scale == 1.0  # the schema's defaults before configure
    pm.configure({"everything": {"reward_scale": 3}})
    assert pm.settings_of("everything").reward_scale == 3.0
    with pytest.raises(ConfigError) as e:
        pm.configure({"everything": {"reward_scal": 1.0, "prompts": "many"}})
    assert "'plugin_config.everything.reward_scal'" in str(e.value) and "did you mean 'reward_scale'" in str(e.value)
    with pytest.raises(ConfigError, match="plugin_config.everything.prompts"):
        pm.configure({"everything": {"prompts": "many"}})


def test_a_factory_answer_missing_a_method_is_named_before_any_model_loads(installed, tmp_path, monkeypatch):
    from rlcore.trainer import models
    from rlcore.trainer.loop import Trainer

    class Forgetful:
        @hookimpl
        def rlcore_checkpoint_policy(self):
            class Policy:  # written without wait()
                def should_save(self, step, *, final=False):
                    return False

                def save(self, step, state):
                    return None

                def resume(self, state):
                    return 0

                def export(self, model, tokenizer, name="final"):
                    return None

            return Policy()

    monkeypatch.setattr(models, "load_causal_lm", lambda *a, **k: pytest.fail("a model loaded"))
    pm = build_plugin_manager([])
    pm.register_plugin(Forgetful(), "forgetful")
    with pytest.raises(PluginError, match=r"plugin 'forgetful' answered rlcore_checkpoint_policy with a Policy, "
                                          r"which lacks wait\(\)"):
        Trainer(load_config([], list(rlcore.demo.DEMO_OVERRIDES) + [f"trainer.output_dir={tmp_path}"]), pm,
                DistInfo())


def test_a_dataset_plugin_that_needs_no_files_is_not_the_demo(installed):
    from rlcore.demo import is_demo

    assert is_demo([], [], [])
    assert not is_demo([], [], ["everything"])
    assert is_demo([], [], ["sparse-logging"])  # not a data source


def test_validate_finds_two_plugins_answering_one_factory_hook(installed, tmp_path):
    args = ["validate", "--plugins", "everything,everything-too", "actor.rollout_backend=everything",
            f"trainer.output_dir={tmp_path}"]
    code, out, err = run_cli(args)
    assert code == 2 and "'everything' and 'everything-too' both answer rlcore_" in err, (out, err)
    code, out, err = run_cli(["validate", "--plugins", "everything", "actor.rollout_backend=everything",
                              f"trainer.output_dir={tmp_path}"])
    assert code == 0 and "config OK" in out, err


def test_validate_names_a_rollout_backend_no_plugin_provides(tmp_path):
    code, _, err = run_cli(["validate", "actor.rollout_backend=vllm", f"trainer.output_dir={tmp_path}"])
    assert code == 2 and "actor.rollout_backend='vllm'" in err


def test_plugins_lists_a_broken_plugin_as_a_row(installed):
    code, out, err = run_cli(["plugins"])
    assert code == 0, err
    table = out.split("\n\n")[0]  # the plugin table; the environments follow after a blank line
    rows = {line.split()[0]: line for line in table.splitlines()[1:]}
    assert "ERROR" in rows["broken"] and "rlcore_no_such_module" in rows["broken"]
    assert "dataset_provider" in rows["everything"] and "ERROR" not in rows["defaults"]


def test_compute_advantages_refuses_an_unknown_estimator():
    from rlcore.config.schema import AlgorithmConfig, PPOConfig
    from rlcore.trainer.experience import Experience, compute_advantages

    exp = Experience(input_ids=torch.zeros(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 3),
                     response_mask=torch.ones(2, 1), old_logprobs=torch.zeros(2, 1), scores=torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="unknown algorithm.adv_estimator 'reinforce'"):
        compute_advantages(exp, dataclasses.replace(AlgorithmConfig(), adv_estimator="reinforce"), PPOConfig(), 0.0, 2)


def test_score_leaves_the_callers_extras_alone(tiny_tokenizer):
    from types import SimpleNamespace

    from rlcore.protocols import RewardOutput
    from rlcore.rollout.base import RolloutBatch
    from rlcore.trainer.loop import Trainer

    seen = []
    reward = SimpleNamespace(score=lambda b: seen.append(b) or RewardOutput(scores=torch.ones(1)))
    trainer = object.__new__(Trainer)
    trainer.c = SimpleNamespace(tokenizer=tiny_tokenizer, reward=reward)
    extras = {"ground_truth": ["x"]}
    batch = RolloutBatch(torch.tensor([[5, 6]]), torch.ones(1, 2, dtype=torch.long), torch.tensor([[7]]),
                         torch.ones(1, 1, dtype=torch.long), torch.zeros(1, 1))
    trainer.score(batch, extras)
    assert extras == {"ground_truth": ["x"]} and seen[0].extras == extras and seen[0].extras is not extras
