"""Selective checkpointing (``<role>.gradient_checkpointing_policy=selective``): a checkpointed layer
keeps its products' and attention's outputs and recomputes the pointwise work between them: the same
gradients, fewer saved bytes than no checkpointing, more than full checkpointing; under ``auto`` the
token budget is lowered to what fits that way."""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlcore.config.loader import load_config
from rlcore.distributed.fsdp import enable_gradient_checkpointing
from rlcore.errors import ConfigError
from rlcore.rollout.tiny import tiny_causal_lm
from rlcore.trainer import recompute


def _model(mode):
    torch.manual_seed(0)
    model = tiny_causal_lm("qwen2")
    if mode != "none":
        enable_gradient_checkpointing(model, selective=mode == "selective")
    return model.train()


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _run(model):
    """Gradients of one forward and backward, and the operations the backward ran."""
    ids = torch.randint(3, 120, (2, 24), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
    with _Count() as counted:
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, counted.ops


def test_selective_gives_the_same_gradients_and_recomputes_only_the_pointwise_work():
    grads, ops = {}, {}
    for mode in ("none", "full", "selective"):
        grads[mode], ops[mode] = _run(_model(mode))
    for mode in ("full", "selective"):
        assert grads[mode].keys() == grads["none"].keys()
        for name, g in grads["none"].items():
            torch.testing.assert_close(grads[mode][name], g, rtol=0, atol=0)
    products = {mode: ops[mode]["mm"] + ops[mode]["addmm"] for mode in ops}
    assert products["full"] > products["none"]  # full checkpointing runs the layers' products again
    assert products["selective"] == products["none"]  # selective keeps them
    assert ops["none"]["silu"] == 0 < ops["selective"]["silu"]  # the pointwise work is recomputed
    assert ops["full"]["silu"] == ops["selective"]["silu"]


def test_the_policy_keeps_products_and_recomputes_the_rest():
    from torch.utils.checkpoint import CheckpointPolicy

    assert recompute._keep_products(None, torch.ops.aten.mm.default) == CheckpointPolicy.MUST_SAVE
    assert recompute._keep_products(None, torch.ops.aten.addmm.default) == CheckpointPolicy.MUST_SAVE
    assert recompute._keep_products(None, torch.ops.aten.mul.Tensor) == CheckpointPolicy.PREFER_RECOMPUTE
    assert recompute._keep_products(None, torch.ops.aten.silu.default) == CheckpointPolicy.PREFER_RECOMPUTE

    class FlashForward:  # an operator of the flash-attn package (not installed here)
        def name(self):
            return "flash_attn::_flash_attn_varlen_forward"

    assert recompute._keep_products(None, FlashForward()) == CheckpointPolicy.MUST_SAVE


def test_auto_lowers_the_budget_to_what_fits_selectively(monkeypatch):
    model = _model("selective")
    full = recompute.Recompute(model, "auto", model.config, torch.device("cpu"))
    selective = recompute.Recompute(model, "auto", model.config, torch.device("cpu"), selective=True)
    per_token = recompute.activation_bytes_per_token(model.config, torch.float32)
    kept = recompute.selective_bytes_per_token(model.config, torch.float32)
    # 2 layers x (5*64 + 2*32 + 2*128) floats + one row of 128 logits
    assert kept == 2 * (5 * 64 + 2 * 32 + 2 * 128) * 4 + 128 * 4 and kept < per_token
    assert selective.kept_share == pytest.approx(kept / per_token) and full.kept_share == 0.0
    free = 10_000 * per_token
    monkeypatch.setattr(recompute, "free_bytes", lambda device: free)
    budget = 1 << 20
    assert full.token_budget(budget) == budget  # the logits head with full checkpointing: as given
    lowered = selective.token_budget(budget)
    assert lowered % 8 == 0 and lowered < budget
    usable = recompute.FREE_SHARE * free - sum(p.numel() * p.element_size() for p in model.parameters())
    assert selective.usable_bytes() == usable  # the gradients the first backward allocates are kept out
    assert lowered * kept <= usable < (lowered + 8) * kept
    assert selective.needed(lowered)  # such a micro-batch checkpoints (selectively) ...
    assert not selective.needed(lowered * kept // per_token - 8)  # ... a small one does not


def test_the_setting_is_checked():
    cfg = load_config([], ["actor.gradient_checkpointing_policy=selective"])
    assert str(cfg.actor.gradient_checkpointing_policy) == "selective"
    assert load_config([], []).actor.gradient_checkpointing_policy is None
    with pytest.raises(ConfigError, match="gradient_checkpointing_policy"):
        load_config([], ["actor.gradient_checkpointing_policy=some"])


def two_demo_steps(path, compiled: bool, *overrides: str) -> list[dict]:
    """The metrics of the demo's first two steps in ``path`` (layers compiled or not), with ``overrides``."""
    from rlcore.plugin_manager import build_plugin_manager
    from rlcore.protocols import DistInfo
    from rlcore.testing import demo_overrides
    from rlcore.trainer.loop import Trainer

    cfg = load_config([], [*demo_overrides(path), "trainer.progress=false", "trainer.gpu_monitor=false",
                           "trainer.export_final=false", "plugins=[]", f"actor.compile={str(compiled).lower()}",
                           f"critic.compile={str(compiled).lower()}", *overrides])
    trainer = Trainer(cfg, build_plugin_manager([]), DistInfo())
    return [trainer.train_step(step) for step in (1, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, True])
def test_a_run_with_selective_checkpointing_trains_like_one_without(tmp_path, compiled):
    plain = two_demo_steps(tmp_path / "plain", compiled, "actor.gradient_checkpointing=false",
                           "critic.gradient_checkpointing=false")
    selective = two_demo_steps(tmp_path / "selective", compiled, "actor.gradient_checkpointing=true",
                               "critic.gradient_checkpointing=true", "actor.gradient_checkpointing_policy=selective",
                               "critic.gradient_checkpointing_policy=selective")
    for p, s in zip(plain, selective):
        for key in ("loss/policy", "loss/value", "actor/grad_norm", "critic/grad_norm", "reward/mean"):
            assert s[key] == pytest.approx(p[key], rel=1e-4, abs=1e-5), key


def test_layers_of_a_model_without_the_hugging_face_switch_checkpoint_selectively_too():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.nn.functional.silu(self.fc(x))

    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Block(), Block()])

        def forward(self, x):
            for block in self.layers:
                x = block(x)
            return x

    x = torch.randn(5, 8)
    ops, grads = {}, {}
    for mode in ("none", "full", "selective"):
        torch.manual_seed(0)
        model = Plain()
        if mode != "none":
            enable_gradient_checkpointing(model, selective=mode == "selective")
        loss = model(x).sum()
        with _Count() as counted:
            loss.backward()
        ops[mode], grads[mode] = counted.ops, [p.grad for p in model.parameters()]
    assert ops["full"]["addmm"] > ops["none"]["addmm"] == ops["selective"]["addmm"]  # the products are kept
    for mode in ("full", "selective"):
        assert all(torch.equal(a, b) for a, b in zip(grads[mode], grads["none"]))


@pytest.mark.parametrize("overrides, selective", [
    ([], True),  # the default: auto checkpointing, selective where it checkpoints
    (["actor.gradient_checkpointing=true"], False),  # always on: the least memory
    (["actor.gradient_checkpointing=true", "actor.gradient_checkpointing_policy=selective"], True),
    (["actor.gradient_checkpointing_policy=full"], False),
])
def test_a_null_policy_is_selective_under_auto_and_full_when_always_on(overrides, selective):
    from rlcore.trainer.components import _selective

    assert _selective(load_config([], overrides).actor) is selective
