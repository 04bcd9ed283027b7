"""``actor.rollout_engine``: rollout-engine settings from the training config, checked when the config
loads (each problem naming its key) and handed to the engine the trainer builds."""

from __future__ import annotations

import pytest

from rlcore.config import load_config
from rlcore.distributed.init import DistInfo
from rlcore.errors import ConfigError
from rlcore.rollout.engine import CONFIG_KEYS, RolloutEngine
from rlcore.rollout.tiny import tiny_causal_lm
from rlcore.trainer import components


def _trainer_backend(cfg, model):
    """The rollout backend the trainer builds for ``model`` (through rlcore_rollout_backend)."""
    from rlcore.config.schema import FSDPConfig
    from rlcore.distributed.reshard import FSDPReshardPolicy
    from rlcore.plugin_manager import build_plugin_manager

    generation = components._generation(build_plugin_manager([]), model, model,
                                        FSDPReshardPolicy(FSDPConfig(), DistInfo()), components.obj(cfg.actor),
                                        components.obj(cfg.data), components.obj(cfg.ppo), DistInfo())
    return generation.backend(model)


def test_settings_reach_the_engine_the_trainer_builds():
    cfg = load_config([], ["actor.rollout_backend=engine", "actor.rollout_engine.attention=matmul",
                           "actor.rollout_engine.eos_check_interval=3", "actor.rollout_engine.graph_batch_buckets=[2]",
                           "actor.rollout_engine.page_size=16", "actor.rollout_engine.kv_pages=5",
                           "ppo.generation.batch_size=4", "ppo.generation.max_new_tokens=8",
                           "data.max_prompt_length=16"])
    model = tiny_causal_lm("qwen2")
    engine = _trainer_backend(cfg, model)
    assert isinstance(engine, RolloutEngine)
    assert (engine.attention, engine.eos_check_interval, engine.buckets) == ("matmul", 3, [2, 4])
    assert (engine.max_batch_size, engine.max_seq_len) == (4, 24)  # still the trainer's
    assert engine.paged and (engine.page_size, engine.pool.pages) == (16, 5)


def test_default_engine_settings_are_the_engines_defaults():
    cfg = load_config([], ["actor.rollout_backend=engine"])
    model = tiny_causal_lm("qwen2")
    engine = _trainer_backend(cfg, model)
    assert engine.eos_check_interval == 8 and engine.attention_tuning == {}


@pytest.mark.parametrize("override, key, words", [
    ("actor.rollout_engine.atention=triton", "actor.rollout_engine.atention", "did you mean 'attention'"),
    ("actor.rollout_engine.max_batch_size=8", "actor.rollout_engine.max_batch_size", "not a rollout engine setting"),
    ("actor.rollout_engine.attention=flash", "actor.rollout_engine.attention", "'flash' is not one of"),
    ("actor.rollout_engine.compile_mode=fast", "actor.rollout_engine.compile_mode", "'fast' is not one of"),
    ("actor.rollout_engine.attention_tuning.warps=2", "actor.rollout_engine.attention_tuning", "['warps']"),
    ("actor.rollout_engine.attention_tuning.subblocks=3", "actor.rollout_engine.attention_tuning",
     "attention_tuning['subblocks']"),
    ("actor.rollout_engine.split_k.down=0", "actor.rollout_engine.split_k", "split_k['down']"),
    ("actor.rollout_engine.mlp_transposed=maybe", "actor.rollout_engine.mlp_transposed", "mlp_transposed must be"),
])
def test_bad_settings_fail_when_the_config_loads_naming_the_key(override, key, words):
    with pytest.raises(ConfigError) as caught:
        load_config([], [override])
    assert f"'{key}'" in str(caught.value) and words in str(caught.value)


def test_every_config_key_is_an_engine_argument():
    import inspect

    arguments = inspect.signature(RolloutEngine.__init__).parameters
    assert set(CONFIG_KEYS) <= set(arguments)
    assert not set(CONFIG_KEYS) & {"model", "max_batch_size", "max_seq_len", "device", "dtype"}
