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

from rlcore.config import load_config
from rlcore.errors import ConfigError, PluginError
from rlcore.hookspecs import hookimpl
from rlcore.plugin_manager import BUILTIN_MODULES, build_plugin_manager
from rlcore.protocols import DistInfo
from rlcore.testing import demo_overrides, run_cli

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
    """The fixture plugin is the data source; the model is the demo's, set as `rlcore train` sets it."""
    from rlcore.demo import use_demo_model

    cfg = load_config([], ["plugins=[everything]", "actor.rollout_backend=everything", "trainer.max_steps=2",
                           "trainer.progress=false", "trainer.log_steps=1", "trainer.eval_samples=4",
                           "trainer.gpu_monitor=false", "trainer.export_final=false", "trainer.resume=disable",
                           "ppo.rollout_batch_size=4", "ppo.generation.n=2", "ppo.generation.max_new_tokens=4",
                           "algorithm.adv_estimator=grpo", "data.max_prompt_length=8",
                           f"trainer.output_dir={tmp_path}", *extra])
    use_demo_model(cfg, DistInfo(), provides_data=True)
    return cfg


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
            class Policy:  # written without resume()
                def should_save(self, step, *, final=False):
                    return False

                def save(self, step, state):
                    return None

                def export(self, model, tokenizer, name="final"):
                    return None

            return Policy()

    monkeypatch.setattr(models, "load_causal_lm", lambda *a, **k: pytest.fail("a model loaded"))
    pm = build_plugin_manager([])
    pm.register_plugin(Forgetful(), "forgetful")
    with pytest.raises(PluginError, match=r"plugin 'forgetful' answered rlcore_checkpoint_policy with a Policy, "
                                          r"which lacks resume\(\)"):
        Trainer(load_config([], demo_overrides(tmp_path)), pm,
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


# ---------------------------------------------------------------------------------------------
# The boundary as a second third-party package met it (a checkpoint policy saving every N steps,
# a dataset plugin without a model, validate against train, the test kit).
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saving_run(tmp_path_factory):
    """Two steps with the fixture plugin, its policy saving every second step; the warnings logged."""
    import logging

    from rlcore.trainer.loop import Trainer

    tmp_path = tmp_path_factory.mktemp("saving-run")
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(FIXTURES)
        mp.setitem(BUILTIN_MODULES, "everything", "rlcore_everything:EverythingPlugin")
        logging.getLogger("rlcore").addHandler(handler)
        try:
            cfg = _config(tmp_path, "plugin_config.everything.save_every=2")
            pm = build_plugin_manager(list(cfg.plugins))
            trainer = Trainer(cfg, pm, DistInfo())
            trainer.train()
        finally:
            logging.getLogger("rlcore").removeHandler(handler)
            sys.modules.pop("rlcore_everything", None)
    return trainer, pm.get_plugin("everything").built, [r.getMessage() for r in records]


def test_a_policy_is_never_asked_to_save_a_step_it_saved(saving_run):
    trainer, built, _ = saving_run
    asked = built["checkpoint"].asked
    assert trainer.status == "completed" and trainer.state.step == 2
    # step 2 saved as a periodic save; the end of the run asks (final=True) but does not save it again
    assert [a for a in asked if a[0] == "save"] == [("save", 2)]
    assert asked[-2:] == [("should_save", 2, True), ("wait",)]


def test_the_backend_syncs_only_before_rollouts_that_follow_an_update(saving_run):
    _, built, _ = saving_run
    # rollouts: evaluation before (the weights it was built for), step 1 (no update yet), step 2
    # (after step 1's update: sync), evaluation after (after step 2's update: sync)
    assert built["rollout"].calls >= 4 and built["rollout"].syncs == 2


def test_a_resumed_run_refreshes_the_backend_before_its_first_rollout(installed, tmp_path):
    from rlcore.trainer.loop import Trainer

    def run(max_steps, resume):
        cfg = _config(tmp_path, "plugin_config.everything.checkpoint=false", "trainer.save_steps=1",
                      f"trainer.max_steps={max_steps}", f"trainer.resume={resume}")
        pm = build_plugin_manager(list(cfg.plugins))
        trainer = Trainer(cfg, pm, DistInfo())
        trainer.train()
        return trainer, pm.get_plugin("everything").built["rollout"]

    run(1, "disable")
    trainer, backend = run(2, "auto")
    # the backend was built before the checkpoint of step 1 loaded: step 2's rollout reads the loaded
    # weights (a sync), the evaluation after it the updated ones (a sync)
    assert trainer.state.step == 2 and backend.syncs == 2


def test_a_dataset_plugin_without_a_model_is_warned_of_the_demo_model(saving_run):
    _, _, warnings = saving_run
    assert any("actor.model_path is not set: the policy is the demo's tiny model" in w for w in warnings), warnings


def test_the_reward_gets_the_prompt_text_with_its_spaces(saving_run):
    _, built, _ = saving_run
    batch = built["reward"].batches[-1]
    assert batch.prompts == batch.extras["prompt"]  # "c d e" decodes as "c d e", not "cde"
    assert all(" " in p for p in batch.prompts)


@pytest.mark.parametrize("drop, missing", [("checkpoint.resume", "rlcore_checkpoint_policy with a NoFiles, which "
                                                                    "lacks resume()"),
                                           ("placement.offload", "rlcore_placement_policy with a CPUPlacement, "
                                                                 "which lacks offload()"),
                                           ("reshard.stats", "rlcore_reshard_policy with a SameLayout, which "
                                                             "lacks stats()"),
                                           ("reward.score", "rlcore_reward_backend with a NextLetterReward, "
                                                            "which lacks score()")])
def test_validate_rejects_a_factory_answer_train_would_reject(installed, tmp_path, monkeypatch, drop, missing):
    from rlcore.trainer import models

    monkeypatch.setattr(models, "load_causal_lm", lambda *a, **k: pytest.fail("a model loaded"))
    code, out, err = run_cli(["validate", "--plugins", "everything", "actor.rollout_backend=everything",
                              f"trainer.output_dir={tmp_path}", f"plugin_config.everything.drop={drop}"])
    assert code == 2 and f"plugin 'everything' answered {missing}" in err, (out, err)
    assert not (tmp_path / "_demo").exists()  # nothing built in the run directory


def test_validate_reports_every_conflict_together_and_writes_no_demo_model(installed, tmp_path):
    code, out, err = run_cli(["validate", "--plugins", "everything,everything-too", "actor.rollout_backend=everything",
                              f"trainer.output_dir={tmp_path}"])
    hooks = ("placement_policy", "dataset_provider", "reshard_policy", "reward_backend", "checkpoint_policy")
    assert code == 2 and "5 problems found" in err, err
    for hook in hooks:
        assert f"'everything' and 'everything-too' both answer rlcore_{hook}" in err, hook
    assert not (tmp_path / "_demo").exists()
    code, out, err = run_cli(["validate", "--plugins", "everything", "actor.rollout_backend=everything",
                              f"trainer.output_dir={tmp_path}"])
    assert code == 0 and not (tmp_path / "_demo").exists(), err


def test_validate_names_a_misspelt_rollout_backend_before_any_model_loads(installed, tmp_path, monkeypatch):
    from rlcore.trainer import models

    monkeypatch.setattr(models, "load_causal_lm", lambda *a, **k: pytest.fail("a model loaded"))
    base = ["validate", "--plugins", "everything", f"trainer.output_dir={tmp_path}"]
    code, out, err = run_cli(base + ["actor.rollout_backend=everythign"])
    assert code == 2 and "actor.rollout_backend='everythign'" in err, err
    assert "known backends are auto, engine, hf, everything" in err and "did you mean 'everything'" in err
    # a name a plugin answers besides its own is found by asking it
    code, out, err = run_cli(base + ["actor.rollout_backend=mine", "plugin_config.everything.backend_name=mine"])
    assert code == 0, err


def installed_distribution(where, monkeypatch, dist: str, version: str, entry: str, module: str) -> None:
    """A distribution ``dist`` whose ``rlcore.plugins`` entry point ``entry`` names ``module``, found
    on the path as an installed one is (its metadata in a ``.dist-info`` directory)."""
    info = where / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[rlcore.plugins]\n{entry} = {module}\n")
    monkeypatch.syspath_prepend(str(where))


def test_plugins_names_the_distribution_of_a_broken_plugin(tmp_path, monkeypatch):
    installed_distribution(tmp_path, monkeypatch, "rlcore-broken-example", "1.2.3", "broken-example",
                           "rlcore_broken_example_missing")
    code, out, err = run_cli(["plugins"])
    assert code == 0, err
    row = next(line for line in out.splitlines() if line.startswith("broken-example "))
    assert row.split()[1:3] == ["rlcore-broken-example", "1.2.3"] and "ERROR" in row


def test_rlcore_register_instantiates_a_plugin_class_as_an_entry_point_does(installed, rlcore_pm, rlcore_register,
                                                                          tmp_path):
    from rlcore.config.schema import TrainerConfig
    from rlcore_everything import EverythingPlugin, NoFiles

    plugin = rlcore_register(EverythingPlugin, name="everything")
    assert isinstance(plugin, EverythingPlugin) and rlcore_pm.get_plugin("everything") is plugin
    policy = rlcore_pm.build("rlcore_checkpoint_policy", trainer=TrainerConfig(output_dir=str(tmp_path)),
                             dist=DistInfo())
    assert isinstance(policy, NoFiles) and plugin.built["checkpoint"] is policy


def test_the_config_page_says_a_dataset_plugin_turns_the_demo_off():
    page = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "config.md")).read()
    when = next(p for p in page.split("\n\n") if "apply the built-in demo's settings" in p)
    assert "rlcore_dataset_provider" in when, when
    row = next(line for line in page.splitlines() if line.startswith("| `data.train_files` | `list[str]` |"))
    assert "rlcore_dataset_provider" in row, row


def test_a_plugin_with_a_misspelt_hook_is_one_broken_row(tmp_path, monkeypatch):
    """It imports and registers, then fails its check: listed once, as broken, not also as a plugin."""
    package = tmp_path / "rlcore_misspelt_example.py"
    package.write_text("from rlcore.hookspecs import hookimpl\n\n\n@hookimpl\ndef rlcore_step_ennd(step):\n"
                       "    pass\n")
    installed_distribution(tmp_path, monkeypatch, "rlcore-misspelt-example", "0.1.0", "misspelt-example",
                           "rlcore_misspelt_example")
    code, out, err = run_cli(["plugins"])
    assert code == 0, err
    rows = [line for line in out.splitlines() if line.startswith("misspelt-example ")]
    assert len(rows) == 1 and "ERROR" in rows[0], rows
