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


def _compiled_layer_run(layer, x, rope):
    """The layer's output and the activations its backward keeps, ``{storage: (bytes, last dim)}``."""
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = (storage.nbytes(), t.shape[-1] if t.dim() else 0)
        return t

    positions = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
    cos, sin = rope(x, positions)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x, attention_mask=None, position_ids=positions, position_embeddings=(cos, sin))
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    return (out[0] if isinstance(out, tuple) else out), {k: v for k, v in saved.items() if k not in params}


def test_recomputing_pointwise_results_keeps_fewer_activations_and_gives_the_same_gradients():
    """``compile_recompute_pointwise``: the compiled layer's backward recomputes the pointwise results
    that feed its matrix products (SiLU·mul, the norms' outputs) instead of keeping them: of the MLP's
    intermediate-width activations it keeps gate and up only, a third less in all than the default
    split, and the gradients are those of the default split bit for bit."""
    import copy

    import torch._functorch.config as functorch_config

    from rlcore.distributed.fsdp import PARTITION_SETTINGS, compile_layers, decoder_layers
    from rlcore.rollout.tiny import tiny_causal_lm

    torch.manual_seed(0)
    model = tiny_causal_lm("qwen2", hidden_size=128, intermediate_size=384, num_attention_heads=4,
                           num_key_value_heads=2).to(torch.bfloat16)
    rope = model.model.rotary_emb
    x = torch.randn(2, 48, 128, dtype=torch.bfloat16)
    weights = torch.linspace(-1, 1, x.numel()).view_as(x)
    runs = {}
    for name, settings in (("default", {k: not v for k, v in PARTITION_SETTINGS.items()}), ("ours", {})):
        torch._dynamo.reset()
        compiled = compile_layers(copy.deepcopy(model), "actor", recompute_pointwise=True)
        layer = decoder_layers(compiled)[0]
        inp = x.clone().requires_grad_(True)
        with functorch_config.patch(settings):  # "default": the split without our settings
            if name == "default":
                layer._compiled_call_impl = getattr(layer._compiled_call_impl, "compiled", layer._compiled_call_impl)
            out, saved = _compiled_layer_run(layer, inp, rope)
        (out.float() * weights).sum().backward()
        runs[name] = (saved, [inp.grad] + [p.grad for p in layer.parameters()])
    wide = {name: sum(1 for _, dim in saved.values() if dim == 384) for name, (saved, _) in runs.items()}
    assert wide == {"default": 3, "ours": 2}
    total = {name: sum(b for b, _ in saved.values()) for name, (saved, _) in runs.items()}
    assert total["ours"] <= 0.75 * total["default"]
    for a, b in zip(runs["default"][1], runs["ours"][1]):
        assert torch.equal(a, b)


def test_the_setting_reaches_the_compiled_layers(tmp_path):
    """``actor.compile_recompute_pointwise`` (on by default): every compiled layer of the actor runs its
    compiled call under the partition settings; set false, the plain compiled call."""
    from rlcore.distributed.fsdp import decoder_layers

    on, _ = steps(tmp_path / "on", "actor.compile=true", n=1)
    off, _ = steps(tmp_path / "off", "actor.compile=true", "actor.compile_recompute_pointwise=false", n=1)
    assert all(hasattr(layer._compiled_call_impl, "compiled") for layer in decoder_layers(on.c.policy))
    assert not any(hasattr(layer._compiled_call_impl, "compiled") for layer in decoder_layers(off.c.policy))
