"""Tiny random decoders built from a config, for tests and demos (no download).

:func:`tiny_causal_lm` covers the families the rollout backends are tested on; benchmarks use
:func:`causal_lm_from_config` with real shapes.
"""

from __future__ import annotations

import torch

FAMILIES = ("qwen2", "llama", "mistral", "gpt2")


def tiny_config(family: str, **overrides):
    """A small config of ``family`` (hidden 64, 2 layers, GQA 4/2 heads, vocab 128)."""
    import transformers as tf

    if family == "gpt2":
        base = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=256, initializer_range=0.3)
        base.update(overrides)
        return tf.GPT2Config(**base)
    base = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=128, max_position_embeddings=256, rms_norm_eps=1e-6,
                initializer_range=0.3)
    classes = {"qwen2": tf.Qwen2Config, "llama": tf.LlamaConfig, "mistral": tf.MistralConfig}
    if family not in classes:
        raise ValueError(f"tiny_config: family {family!r} is not one of {FAMILIES}")
    if family == "qwen2":
        base["tie_word_embeddings"] = True
    base.update(overrides)
    return classes[family](**base)


def causal_lm_from_config(config, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                          seed: int = 0):
    """Random-init causal LM for ``config`` in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config).to(dtype)
    return model.eval()


def tiny_causal_lm(family: str = "qwen2", *, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """A tiny random causal LM of ``family`` on CPU."""
    return causal_lm_from_config(tiny_config(family, **overrides), dtype=dtype, seed=seed)
