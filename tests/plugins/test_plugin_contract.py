"""What rlcore promises a plugin across releases and checks of its answers (docs/plugins.md,
"What rlcore checks of a plugin's answers" and "Plugin API versions")."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import rlcore
from rlcore.config import load_config
from rlcore.testing import demo_overrides
from rlcore.hookspecs import hookimpl
from rlcore.plugin_manager import BUILTIN_MODULES, build_plugin_manager
from rlcore.protocols import DistInfo

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")

#: the demo, as small as a run gets
SMALL = ("trainer.max_steps=1", "trainer.progress=false", "trainer.gpu_monitor=false", "trainer.export_final=false",
         "trainer.eval_samples=4", "ppo.rollout_batch_size=4", "ppo.generation.n=2",
         "ppo.generation.max_new_tokens=4", "ppo.mini_batch_size=8", "ppo.ppo_epochs=1", "plugins=[]")


def small_config(tmp_path, *extra):
    return load_config([], demo_overrides(tmp_path, *SMALL, *extra))


def _fixture_plugin(monkeypatch, name: str, target: str):
    """Register the fixture plugin module of ``target`` (``module[:object]``) as built-in plugin ``name``;
    a generator: its module is forgotten after the test."""
    module = target.split(":")[0]
    monkeypatch.syspath_prepend(FIXTURES)
    monkeypatch.setitem(BUILTIN_MODULES, name, target)
    yield __import__(module)
    sys.modules.pop(module, None)


@pytest.fixture
def api_1_0(monkeypatch):
    yield from _fixture_plugin(monkeypatch, "api-1-0", "rlcore_api_1_0:Api10Plugin")


def test_the_plugin_api_version_is_published():
    from rlcore.testing import run_cli

    major, minor = (int(p) for p in rlcore.PLUGIN_API_VERSION.split("."))
    assert (major, minor) >= (1, 1)
    code, out, _ = run_cli(["plugins"])
    assert code == 0 and f"plugin API {rlcore.PLUGIN_API_VERSION} (rlcore {rlcore.__version__}" in out.splitlines()[-1]


def test_a_plugin_written_for_plugin_api_1_0_still_trains(api_1_0, tmp_path):
    from rlcore.trainer.loop import Trainer

    cfg = small_config(tmp_path, "plugins=[api-1-0]")
    pm = build_plugin_manager(["api-1-0"])
    with pytest.warns(DeprecationWarning) as caught:
        trainer = Trainer(cfg, pm, DistInfo())
        trainer.train()
    messages = " ".join(str(w.message) for w in caught)
    assert "plugin 'api-1-0'" in messages and "lacks wait()" in messages and "lacks generation_share()" in messages
    assert "prepare() takes no fsdp=" in messages
    assert trainer.status == "completed" and trainer.state.step == 1
    built = pm.get_plugin("api-1-0").built
    assert built["reshard"].prepared == ["actor", "critic"]  # the critic's fsdp= was left out
    assert (1, True) in built["checkpoint"].asked  # and the run ended with the default wait()


def test_base_classes_give_the_methods_added_later(api_1_0, rlcore_pm, rlcore_register):
    from rlcore_api_1_0 import NeverSaves

    from rlcore.protocols import CheckpointPolicy, CheckpointPolicyBase, GenerationShare, SamplingParams
    from rlcore.protocols import ReshardPolicy, ReshardPolicyBase

    class Layout(ReshardPolicyBase):
        def prepare(self, model, role, fsdp=None):
            return model

        def generation(self, model):
            raise NotImplementedError

    class Saver(NeverSaves, CheckpointPolicyBase):  # the 1.0 policy, brought up to date by inheriting
        pass

    class Plugin:
        @hookimpl
        def rlcore_reshard_policy(self):
            return Layout()

        @hookimpl
        def rlcore_checkpoint_policy(self):
            return Saver()

    rlcore_register(Plugin, "based")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is missing: no warning
        layout = rlcore_pm.build("rlcore_reshard_policy", fsdp=None, remeshing=None, dist=DistInfo())
        saver = rlcore_pm.build("rlcore_checkpoint_policy", trainer=None, dist=DistInfo())
    assert isinstance(layout, Layout) and isinstance(layout, ReshardPolicy)
    assert isinstance(saver, Saver) and isinstance(saver, CheckpointPolicy) and saver.wait() is None
    share = layout.generation_share([[1, 2]], SamplingParams())
    assert isinstance(share, GenerationShare) and share.rows is None and layout.stats() == {}


# ---------------------------------------------------------------------------------------------
# Each factory built once per run, every instance closed
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def counting(monkeypatch):
    for module in _fixture_plugin(monkeypatch, "counting", "rlcore_counting"):
        module.BUILT.clear()
        module.CLOSED.clear()
        yield module


def test_train_builds_each_factory_once_and_closes_every_instance(counting, tmp_path):
    from rlcore.testing import run_cli

    code, out, err = run_cli(["train", "--plugins", "counting", *SMALL[:-1], "algorithm.adv_estimator=grpo",
                              f"trainer.output_dir={tmp_path}"])
    assert code == 0, err[-3000:]
    once = {"placement": 1, "dataset/train": 1, "dataset/val": 1, "reward": 1, "checkpoint": 1, "reshard": 1}
    assert dict(counting.BUILT) == once
    assert dict(counting.CLOSED) == once


def test_validate_asks_each_factory_once_and_closes_what_it_built(counting, tmp_path):
    from rlcore.testing import run_cli

    code, out, err = run_cli(["validate", "--plugins", "counting", f"trainer.output_dir={tmp_path}"])
    assert code == 0, err
    assert counting.BUILT["placement"] == 1 and counting.BUILT["reward"] == 1
    assert dict(counting.CLOSED) == dict(counting.BUILT)


def test_a_failed_build_closes_what_was_built(counting, tmp_path, monkeypatch):
    from rlcore.trainer import models
    from rlcore.trainer.loop import Trainer

    monkeypatch.setattr(models, "load_causal_lm", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no model")))
    with pytest.raises(RuntimeError, match="no model"):
        Trainer(small_config(tmp_path, "plugins=[counting]"), build_plugin_manager(["counting"]), DistInfo())
    assert counting.BUILT["reward"] == 1 and dict(counting.CLOSED) == dict(counting.BUILT)


# ---------------------------------------------------------------------------------------------
# Every rollout batch, reward answer and resume step is checked where it crosses the boundary
# ---------------------------------------------------------------------------------------------


class Faulty:
    """A plugin whose rollout backend (HF generate underneath) breaks one rule of the contract."""

    def __init__(self, fault, when=lambda params: True):
        self.fault, self.when = fault, when

    @hookimpl
    def rlcore_rollout_backend(self, model, request):
        from rlcore.rollout.hf import HFGenerateBackend

        if request.backend != "faulty":
            return None
        fault, when = self.fault, self.when

        class Backend:
            def __init__(self):
                self.inner = HFGenerateBackend(model)

            def generate(self, prompts, params):
                batch = self.inner.generate(prompts, params)
                return fault(batch) if when(params) else batch

            def sync_weights(self):
                pass

        return Backend()


def _row_short(batch):
    import dataclasses

    return dataclasses.replace(batch, **{k: getattr(batch, k)[:-1] for k in
                                         ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "logprobs")})


def _set(name, value):
    def fault(batch):
        setattr(batch, name, value(batch) if callable(value) else value)
        return batch
    return fault


FAULTS = {
    "a row short": (_row_short, "the batch has 3 rows for 4 prompts"),
    "no logprobs": (_set("logprobs", None), "logprobs is missing, not a tensor"),
    "logprobs a column short": (_set("logprobs", lambda b: b.logprobs[:, :-1]), "differs from response_ids"),
    "NaN logprobs": (_set("logprobs", lambda b: b.logprobs * float("nan")), "logprobs are not finite"),
    "probabilities": (_set("logprobs", lambda b: b.logprobs.exp() * b.response_mask), "logprobs above 0"),
    "token outside the vocabulary": (_set("response_ids", lambda b: b.response_ids + 10_000), "outside the vocabulary"),
    "rows out of order": (_set("prompt_ids", lambda b: b.prompt_ids.flip(0)), "are not prompt 0"),
    "a mask of 2s": (_set("response_mask", lambda b: b.response_mask * 2), "response_mask holds values other than 0"),
}


def _train_with(plugin, tmp_path, *extra):
    from rlcore.trainer.loop import Trainer

    cfg = small_config(tmp_path, "actor.rollout_backend=faulty", "algorithm.adv_estimator=grpo", *extra)
    pm = build_plugin_manager([])
    pm.register_plugin(plugin, "faulty")
    Trainer(cfg, pm, DistInfo()).train()


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_rollout_batch_that_breaks_the_contract_stops_the_run_naming_the_plugin(fault, tmp_path):
    from rlcore.errors import PluginError

    make, expected = FAULTS[fault]
    plugin = Faulty(make, when=lambda params: not params.greedy)  # training rollouts only: evaluation is fine
    with pytest.raises(PluginError) as error:
        _train_with(plugin, tmp_path, "ppo.generation.batch_size=4")
    message = str(error.value)
    assert message.startswith("plugin 'faulty': its rollout backend Backend.generate returned a RolloutBatch")
    assert expected in message and len(message.splitlines()) <= 10, message


def test_an_evaluation_rollout_a_row_short_is_the_backends_fault_not_the_rewards(tmp_path):
    from rlcore.errors import PluginError

    plugin = Faulty(_row_short, when=lambda params: params.greedy)  # evaluation only
    with pytest.raises(PluginError, match="(?s)plugin 'faulty'.*RolloutBatch.*has 3 rows for 4 prompts"):
        _train_with(plugin, tmp_path, "ppo.generation.batch_size=4")


@pytest.mark.parametrize("scores, expected", [
    (lambda n: torch.zeros(n - 1), r"scores of shape \(\d+,\), not \[\d+\]"),
    (lambda n: [0.0] * n, "scores of type list, not a tensor"),
    (lambda n: torch.zeros(n, 2), r"scores of shape \(\d+, 2\)"),
])
def test_a_reward_backend_answer_of_the_wrong_size_is_named(scores, expected, tmp_path):
    from rlcore.errors import PluginError
    from rlcore.protocols import RewardOutput

    class Miscounting:
        @hookimpl
        def rlcore_reward_backend(self):
            class Scorer:
                def score(self, batch):
                    return RewardOutput(scores=scores(len(batch.responses)))
            return Scorer()

    from rlcore.trainer.loop import Trainer

    pm = build_plugin_manager([])
    pm.register_plugin(Miscounting(), "miscounting")
    prefix = r"plugin 'miscounting': its reward backend's score\(\) answered \d+ samples with "
    with pytest.raises(PluginError, match=prefix + expected):
        Trainer(small_config(tmp_path, "algorithm.adv_estimator=grpo"), pm, DistInfo()).train()


def test_a_resume_step_that_is_no_step_is_named(api_1_0, tmp_path, monkeypatch):
    from rlcore_api_1_0 import NeverSaves

    from rlcore.errors import PluginError
    from rlcore.trainer.loop import Trainer

    monkeypatch.setattr(NeverSaves, "resume", lambda self, state: None)
    pm = build_plugin_manager(["api-1-0"])
    with pytest.raises(PluginError, match=r"plugin 'api-1-0': its checkpoint policy's resume\(\) returned None"):
        Trainer(small_config(tmp_path, "plugins=[api-1-0]"), pm, DistInfo()).train()


# ---------------------------------------------------------------------------------------------
# Episodes never vanish with a plugin backend
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def everything(monkeypatch):
    yield from _fixture_plugin(monkeypatch, "everything", "rlcore_everything:EverythingPlugin")


@pytest.mark.parametrize("command", ["validate", "train"])
def test_a_backend_that_cannot_play_episodes_is_refused_before_any_model_loads(everything, tmp_path, monkeypatch,
                                                                              command):
    from rlcore.testing import run_cli
    from rlcore.trainer import models

    monkeypatch.setattr(models, "load_causal_lm", lambda *a, **k: pytest.fail("a model loaded"))
    code, out, err = run_cli([command, "--plugins", "everything", "actor.rollout_backend=everything",
                              "data.env_key=env", f"trainer.output_dir={tmp_path}"])
    assert code == 2, err
    assert "plugin 'everything': its rollout backend Generator does not play multi-turn episodes" in err
    assert "supports_episodes = True" in err and "play_episodes" in err


def test_the_trainer_refuses_episodes_for_a_backend_that_cannot_play_them():
    from rlcore.contract import RolloutContract
    from rlcore.distributed.reshard import FSDPReshardPolicy
    from rlcore.config.schema import FSDPConfig
    from rlcore.envs.runner import Episode, EpisodeLimits, EpisodePrompt
    from rlcore.errors import PluginError
    from rlcore.rollout.base import SamplingParams
    from rlcore.rollout.hf import HFGenerateBackend
    from rlcore.rollout.tiny import tiny_causal_lm
    from rlcore.trainer.generation import ActorGeneration

    class Plain(HFGenerateBackend):
        supports_episodes = False

    model = tiny_causal_lm("qwen2")
    contract = RolloutContract(vocab_size=model.config.vocab_size)
    generation = ActorGeneration(model, FSDPReshardPolicy(FSDPConfig(), DistInfo()), lambda m, tp: Plain(m), 4,
                                 contract=contract)
    contract.names[id(generation.backend(model))] = "plain"
    episode = Episode("demo_lookup", None, {}, EpisodeLimits(), runner=None)
    with pytest.raises(PluginError, match="plugin 'plain': its rollout backend Plain does not play multi-turn"):
        generation.generate([EpisodePrompt([5, 6], episode)], SamplingParams(max_new_tokens=2))
    assert episode.turns == 0  # nothing was sampled for it


def test_the_environment_built_for_the_start_up_check_is_closed(tmp_path, rlcore_pm, rlcore_register):
    from rlcore.config import load_config
    from rlcore.preflight import _check_environments

    made = []

    class Env:
        def __init__(self, config):
            self.closed = False
            made.append(self)

        def start(self, row):
            raise AssertionError("the start-up check never starts an episode")

        def step(self, turn):
            raise AssertionError("the start-up check never steps an episode")

        def close(self):
            self.closed = True

    class Registers:
        @hookimpl
        def rlcore_environment(self, register):
            register("checked", Env)

    rlcore_register(Registers, "registers")
    cfg = load_config([], ["data.env_key=env", "plugin_config.checked={}", f"trainer.output_dir={tmp_path}"])
    _check_environments(cfg, rlcore_pm)
    assert len(made) == 1 and made[0].closed
