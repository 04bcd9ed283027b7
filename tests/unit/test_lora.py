"""LoRA actors (actor.lora, peft): merged weights in the engine, the adapter-free reference, export, checkpoints."""

from __future__ import annotations

import types

import pytest
import torch

peft = pytest.importorskip("peft")

from rlcore.config import load_config  # noqa: E402
from rlcore.errors import ConfigError  # noqa: E402
from rlcore.rollout.base import SamplingParams  # noqa: E402
from rlcore.rollout.engine import RolloutEngine  # noqa: E402
from rlcore.rollout.hf import HFGenerateBackend  # noqa: E402
from rlcore.rollout.tiny import tiny_causal_lm  # noqa: E402
from rlcore.trainer import lora  # noqa: E402

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12], [3]]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
LORA = types.SimpleNamespace(rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj", "o_proj",
                                                                               "gate_proj", "down_proj"])


def lora_model(family: str = "qwen2", **overrides):
    torch.manual_seed(0)
    model = lora.add_adapters(tiny_causal_lm(family, **overrides), LORA)
    return model


def nudge_adapters(model, seed: int = 1, scale: float = 0.5) -> None:
    """Give every adapter a non-zero update (B starts at zero), as training would."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_engine_generates_with_merged_adapters_and_sync_follows_updates(family):
    model = lora_model(family)
    engine = RolloutEngine(model, max_batch_size=4, max_seq_len=20)
    assert not engine.weights.share  # owned buffers, so the adapter deltas can be merged into them
    pointers = engine.weights.pointers()
    nudge_adapters(model)
    stale = engine.generate(PROMPTS, GREEDY)
    engine.sync_weights()
    assert engine.weights.pointers() == pointers  # merged in place: nothing recompiles or recaptures
    got = engine.generate(PROMPTS, GREEDY)
    expected = HFGenerateBackend(model).generate(PROMPTS, GREEDY)  # peft's forward: base + B A x
    assert torch.equal(got.response_ids, expected.response_ids)
    assert torch.allclose(got.logprobs, expected.logprobs, atol=1e-4)
    assert not torch.equal(stale.response_ids, got.response_ids)  # the update changed the policy


def test_reference_is_the_base_model_with_adapters_off():
    model = lora_model()
    base_copy = tiny_causal_lm("qwen2")  # same seed inside tiny_causal_lm: the same base weights
    nudge_adapters(model)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    mask = torch.ones_like(ids)
    ref = lora.AdaptersDisabled(model)
    with torch.no_grad():
        ref_logits = ref(input_ids=ids, attention_mask=mask).logits
        base_logits = base_copy(input_ids=ids, attention_mask=mask).logits
        actor_logits = model(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(ref_logits, base_logits, atol=1e-5)
    assert not torch.allclose(actor_logits, base_logits, atol=1e-3)
    assert list(ref.parameters()) == []  # no second copy of the weights
    model(input_ids=ids, attention_mask=mask)  # adapters are on again after the reference's forward
    assert not any(getattr(m, "disable_adapters", False) for m in model.modules() if hasattr(m, "lora_A"))


def test_merged_state_dict_matches_the_adapted_model(tmp_path):
    from transformers import AutoModelForCausalLM

    model = lora_model()
    nudge_adapters(model)
    merged = lora.merged_state_dict(model.state_dict(), lora.lora_scale(model))
    assert not any("lora_" in k or "base_layer" in k for k in merged)
    model.get_base_model().save_pretrained(str(tmp_path), state_dict=merged)
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    ids = torch.tensor([[4, 5, 6, 7]])
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)


def test_unknown_target_modules_name_the_key():
    with pytest.raises(ConfigError, match="actor.lora.target_modules.*q_proj"):
        lora.add_adapters(tiny_causal_lm("qwen2"), types.SimpleNamespace(rank=4, alpha=8.0, dropout=0.0,
                                                                        target_modules=["qkv_proj"]))


def test_config_checks_and_missing_peft(monkeypatch):
    with pytest.raises(ConfigError, match="actor.lora.dropout"):
        load_config([], ["actor.lora.rank=8", "actor.lora.dropout=1.5"])
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    with pytest.raises(ConfigError, match=r"actor.lora.rank.*pip install 'rlcore\[lora\]'"):
        load_config([], ["actor.lora.rank=8"])
    load_config([], ["actor.lora.rank=0"])  # without adapters peft is not needed


@pytest.mark.parametrize("target", ["embed_tokens", "lm_head"])
def test_adapters_on_the_embeddings_or_the_head_are_refused_at_config_load(target):
    """Their adapters would be left out of final/ and of the rollout engine's weights."""
    with pytest.raises(ConfigError, match=rf"actor.lora.target_modules.*{target}.*not supported"):
        load_config([], ["actor.lora.rank=8", f"actor.lora.target_modules=[q_proj,{target}]"])


def test_a_target_name_that_reaches_the_head_is_refused_when_adapters_are_added():
    """A name the config check cannot know (matched against the model's own modules)."""
    model = tiny_causal_lm("qwen2")
    model.model.add_module("head_alias", model.lm_head)  # another path to the output head
    with pytest.raises(ConfigError, match="head_alias.*not supported"):
        lora.add_adapters(model, types.SimpleNamespace(rank=4, alpha=8.0, dropout=0.0,
                                                       target_modules=["q_proj", "head_alias"]))
