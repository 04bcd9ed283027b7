"""Tiny random decoders built from a config, for tests and demos (no download).

:func:`tiny_causal_lm` covers the families the rollout backends are tested on; benchmarks use
:func:`causal_lm_from_config` with real shapes.
"""

from __future__ import annotations

import torch

FAMILIES = ("qwen2", "qwen3", "llama", "llama3", "mistral", "gpt2")
#: Llama-3's RoPE scaling, with the original context cut to 16 positions so that the scaled
#: frequencies differ from the plain ones within a tiny model's few dozen positions
TINY_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def tiny_config(family: str, **overrides):
    """A small config of ``family`` (hidden 64, 2 layers, GQA 4/2 heads, vocab 128).

    ``qwen3``: per-head q/k norms and a head dim of 32, not hidden / heads = 16 (as Qwen3 models have
    128 where hidden / heads is 64 or 80); ``llama3``: Llama with Llama-3's RoPE scaling
    (:data:`TINY_LLAMA3_ROPE`)."""
    import transformers as tf

    if family == "gpt2":
        base = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=256, initializer_range=0.3)
        base.update(overrides)
        return tf.GPT2Config(**base)
    base = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=128, max_position_embeddings=256, rms_norm_eps=1e-6,
                initializer_range=0.3)
    classes = {"qwen2": tf.Qwen2Config, "qwen3": tf.Qwen3Config, "llama": tf.LlamaConfig,
               "llama3": tf.LlamaConfig, "mistral": tf.MistralConfig}
    if family not in classes:
        raise ValueError(f"tiny_config: family {family!r} is not one of {FAMILIES}")
    if family in ("qwen2", "qwen3"):
        base["tie_word_embeddings"] = True
    if family == "qwen3":
        base["head_dim"] = 32
    if family == "llama3":
        base.update(rope_fields(tf.LlamaConfig, TINY_LLAMA3_ROPE))
    base.update(overrides)
    return classes[family](**base)


def rope_fields(config_class, rope: dict) -> dict:
    """Config arguments for ``rope``: ``rope_parameters`` where the config class has it (newer
    transformers), else ``rope_theta`` and ``rope_scaling``."""
    if hasattr(config_class(), "rope_parameters"):
        return {"rope_parameters": dict(rope)}
    scaling = {key: value for key, value in rope.items() if key != "rope_theta"}
    return {"rope_theta": rope["rope_theta"], "rope_scaling": scaling}


def causal_lm_from_config(config, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                          seed: int = 0):
    """Random-init causal LM for ``config`` in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config).to(dtype)
    return model.eval()


def tiny_causal_lm(family: str = "qwen2", *, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """A tiny random causal LM of ``family`` on CPU.

    ``qwen3``: its RMSNorm weights (initialised to ones) are drawn from ``[0.5, 1.5]``, so that the
    q/k norms scale the features of a head unevenly and applying them before or after RoPE differs."""
    model = causal_lm_from_config(tiny_config(family, **overrides), dtype=torch.float32, seed=seed)
    if family == "qwen3":
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
    return model.to(dtype)
