"""Shared by the reasoning benchmark and the engine's model check: model shapes (real configurations
of Qwen2.5, Qwen3 and Llama-3 with random weights, no download; tiny ones for CPU smoke runs) and
the statistics of a rollout's log-probs against the trainer's recomputation."""

from __future__ import annotations

from typing import Any

import torch

#: shape -> (family, config arguments); the families are those of :func:`rlcore.rollout.tiny.tiny_config`
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2.5-1.5b": ("qwen2", dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                                   num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                                   tie_word_embeddings=True, rope_theta=1e6)),
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                                 num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
                                 tie_word_embeddings=False, rope_theta=1e6)),
    "qwen3-1.7b": ("qwen3", dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                                 num_key_value_heads=8, head_dim=128, intermediate_size=6144, vocab_size=151936,
                                 tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3-8b": ("qwen3", dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                               num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
                               tie_word_embeddings=False, rope_theta=1e6)),
    "llama3-8b": ("llama3", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                 num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                                 tie_word_embeddings=False,
                                 rope={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192})),
    # CPU smoke shapes (tiny_config's defaults, a vocabulary large enough for the stop-token rule)
    "tiny-qwen2": ("qwen2", dict(vocab_size=512)),
    "tiny-qwen3": ("qwen3", dict(vocab_size=512)),
    "tiny-llama3": ("llama3", dict(vocab_size=512)),
}
TINY = tuple(name for name in SHAPES if name.startswith("tiny"))


def config_for(shape: str, **extra):
    """The transformers config of ``shape`` (``extra`` overrides its fields)."""
    import transformers as tf

    from rlcore.rollout.tiny import rope_fields, tiny_config

    if shape not in SHAPES:
        raise SystemExit(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    family, fields = SHAPES[shape]
    fields = dict(fields)
    if shape in TINY:
        return tiny_config(family, **fields, **extra)
    classes = {"qwen2": tf.Qwen2Config, "qwen3": tf.Qwen3Config, "llama3": tf.LlamaConfig}
    rope = fields.pop("rope", None) or {"rope_type": "default", "rope_theta": fields.pop("rope_theta")}
    fields.update(rope_fields(classes[family], rope))
    base = dict(max_position_embeddings=40960, rms_norm_eps=1e-6, hidden_act="silu")
    return classes[family](**{**base, **fields, **extra})


def random_model(shape: str, dtype: torch.dtype, device: str, seed: int = 0, norm_jitter: float = 0.0, **extra):
    """A random-init causal LM of ``shape`` in eval mode. ``norm_jitter`` > 0 draws every RMSNorm
    weight from ``1 ± norm_jitter`` (initialised to ones, they would hide a norm applied at the wrong
    place: a per-head norm of weight one commutes with RoPE)."""
    from rlcore.rollout.tiny import causal_lm_from_config

    model = causal_lm_from_config(config_for(shape, **extra), dtype=dtype, device=device, seed=seed)
    if norm_jitter > 0:
        gen = torch.Generator(device=device).manual_seed(seed + 1)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    noise = torch.rand(param.shape, generator=gen, device=device) * 2 - 1
                    param.copy_((1 + norm_jitter * noise).to(param.dtype))
    return model


def mismatch(rollout: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the sampler's log-probs ``rollout`` are from the trainer's ``trainer`` (both ``[B, R]``,
    over the tokens where ``mask`` is set): mean and max absolute difference, and two estimates of
    KL(sampler || trainer) from the sampled tokens: ``kl_k1`` = mean of ``log p_rollout - log p_trainer``
    and ``kl_k3`` = mean of ``r - 1 - log r`` with ``r = p_trainer / p_rollout`` (non-negative, lower variance)."""
    keep = mask.bool()
    if not keep.any():
        return {"tokens": 0}
    a, b = rollout.float()[keep], trainer.float()[keep]
    diff = a - b
    log_ratio = -diff
    return {"tokens": int(keep.sum()), "abs_diff_mean": float(diff.abs().mean()), "abs_diff_max": float(diff.abs().max()),
            "kl_k1": float(diff.mean()), "kl_k3": float((log_ratio.exp() - 1 - log_ratio).mean())}


@torch.no_grad()
def teacher_forced(model, batch, temperature: float, micro: int = 8) -> torch.Tensor:
    """The trainer's log-probs ``[B, R]`` of ``batch``'s response tokens (rlcore's own
    :func:`rlcore.trainer.models.response_logprobs`, in chunks of ``micro`` rows)."""
    from rlcore.trainer.models import response_logprobs

    ids, mask = batch.sequences()
    width = batch.response_ids.shape[1]
    out = [response_logprobs(model, ids[i:i + micro], mask[i:i + micro], width, temperature)[0].float()
           for i in range(0, ids.shape[0], micro)]
    return torch.cat(out) * batch.response_mask
