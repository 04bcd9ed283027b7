"""``actor.attn_implementation`` / ``critic.attn_implementation``: the training forwards' attention."""

import pytest
import torch

from rlcore.config import load_config
from rlcore.testing import demo_overrides
from rlcore.errors import ConfigError, RLCoreError
from rlcore.plugin_manager import build_plugin_manager
from rlcore.preflight import preflight
from rlcore.protocols import DistInfo
from rlcore.trainer import packing
from rlcore.trainer.loop import Trainer


def demo_config(tmp_path, *overrides):
    return load_config([], [*demo_overrides(tmp_path), "trainer.progress=false",
                                                   "trainer.gpu_monitor=false", "trainer.export_final=false",
                                                   "plugins=[]", *overrides])


def test_an_unknown_attention_fails_when_the_config_loads_naming_the_key():
    with pytest.raises(ConfigError) as caught:
        load_config([], ["actor.attn_implementation=flash"])
    assert "'actor.attn_implementation'" in str(caught.value) and "flash_attention_2" in str(caught.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("value", ["flex_attention", "flash_attention_2"])
def test_a_cuda_only_attention_on_a_cpu_role_is_refused_before_any_model_loads(tmp_path, value):
    cfg = demo_config(tmp_path, f"critic.attn_implementation={value}", "algorithm.adv_estimator=gae")
    with pytest.raises(RLCoreError, match=r"'critic.attn_implementation': .*CUDA only"):
        preflight(cfg, [])
    # under GRPO there is no critic: its setting is not checked
    preflight(demo_config(tmp_path, f"critic.attn_implementation={value}", "algorithm.adv_estimator=grpo"), [])


def test_the_setting_reaches_the_trained_models(tmp_path):
    cfg = demo_config(tmp_path, "actor.attn_implementation=eager", "algorithm.adv_estimator=gae",
                      "ppo.kl_coeff=0.1")
    trainer = Trainer(cfg, build_plugin_manager([]), DistInfo())
    assert packing.attention_implementation(trainer.c.policy) == "eager"
    assert packing.attention_implementation(trainer.c.critic.model) == "sdpa"  # the critic keeps the default
    metrics = trainer.train_step(1)
    assert torch.isfinite(torch.tensor(metrics["loss/policy"]))
