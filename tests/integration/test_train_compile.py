"""``actor.compile`` / ``critic.compile``: regionally compiled decoder layers train like the eager ones."""

import pytest
import torch

from rlcore.config import load_config
from rlcore.testing import demo_overrides
from rlcore.errors import ConfigError
from rlcore.plugin_manager import build_plugin_manager
from rlcore.protocols import DistInfo
from rlcore.trainer.loop import Trainer

pytestmark = pytest.mark.slow

KEYS = ("loss/policy", "loss/value", "actor/grad_norm", "critic/grad_norm", "reward/mean")


def steps(tmp_path, *overrides, n=2):
    cfg = load_config([], [*demo_overrides(tmp_path), "trainer.progress=false",
                                                   "trainer.gpu_monitor=false", "trainer.export_final=false",
                                                   "plugins=[]", *overrides])
    trainer = Trainer(cfg, build_plugin_manager([]), DistInfo())
    metrics = [trainer.train_step(step) for step in range(1, n + 1)]
    return trainer, metrics


def test_compiled_layers_train_like_eager_ones(tmp_path):
    _, eager = steps(tmp_path / "eager")
    trainer, compiled = steps(tmp_path / "compiled", "actor.compile=true", "critic.compile=true")
    from rlcore.distributed.fsdp import decoder_layers

    for model in (trainer.c.policy, trainer.c.critic.model):
        layers = decoder_layers(model)
        assert layers and all(getattr(layer, "_compiled_call_impl", None) is not None for layer in layers)
    for e, c in zip(eager, compiled):
        for key in KEYS:
            assert c[key] == pytest.approx(e[key], rel=1e-3, abs=1e-4), key


def test_a_model_without_decoder_layers_is_refused():
    from rlcore.distributed.fsdp import compile_layers

    with pytest.raises(ConfigError, match="actor.compile"):
        compile_layers(torch.nn.Linear(2, 2), "actor")


def test_by_default_compiled_on_cuda_only_and_without_layers_left_as_is(tmp_path):
    from rlcore.distributed.fsdp import compile_layers, decoder_layers
    from rlcore.trainer.components import _wants_compile

    assert _wants_compile(None, "cuda") and not _wants_compile(None, "cpu")
    assert _wants_compile(True, "cpu") and not _wants_compile(False, "cuda")
    plain = torch.nn.Linear(2, 2)
    assert compile_layers(plain, "actor", fallback=True) is plain
    trainer, _ = steps(tmp_path, n=1)  # the demo on CPU, actor.compile unset
    assert trainer.cfg.actor.compile is None
    assert all(getattr(layer, "_compiled_call_impl", None) is None for layer in decoder_layers(trainer.c.policy))


def test_compiled_layers_take_options_inductor_knows():
    """The options that keep a layer's compilation valid across micro-batch lengths, and its
    roundings those of the eager model, are real Inductor settings of this torch (a misspelt key
    would fail at the first compiled forward)."""
    from torch._inductor import config as inductor_config

    from rlcore.distributed.fsdp import layer_compile_options

    options = layer_compile_options()
    assert options.get("emulate_precision_casts") is True
    with inductor_config.patch(options):
        for key, value in options.items():
            section, _, name = key.rpartition(".")
            holder = getattr(inductor_config, section) if section else inductor_config
            assert getattr(holder, name) == value


def test_compiled_layers_give_the_eager_models_bf16_values_exactly():
    """In bf16 a fused kernel that kept RMSNorm's normalised value in float32 before the weight
    (Inductor's default) changes most logits; the compiled layers round as the eager model does."""
    import copy

    from rlcore.distributed.fsdp import compile_layers
    from rlcore.rollout.tiny import tiny_causal_lm

    torch.manual_seed(0)
    model = tiny_causal_lm("qwen3").to(torch.bfloat16).eval()  # norms drawn from [0.5, 1.5]
    ids = torch.randint(1, model.config.vocab_size, (2, 40))
    with torch.no_grad():
        expected = model(ids).logits
        got = compile_layers(copy.deepcopy(model), "actor")(ids).logits
    assert torch.equal(got, expected)
