"""Reward models built from a config, for tests and benchmarks (nothing is downloaded)."""

from __future__ import annotations

import os
from typing import Any, Optional


def reward_model_config(arch: str = "qwen2", *, vocab_size: int, hidden_size: int, layers: int, heads: int,
                        kv_heads: int, intermediate_size: int, pad_token_id: int = 0, max_positions: int = 4096) -> Any:
    """A ``num_labels=1`` config of a ``qwen2`` or ``llama`` sequence-classification model."""
    from transformers import LlamaConfig, Qwen2Config

    config_cls = {"qwen2": Qwen2Config, "llama": LlamaConfig}[arch]
    return config_cls(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=max_positions, num_labels=1, pad_token_id=pad_token_id,
                      tie_word_embeddings=False)


def build_tiny_reward_model(save_dir: str, *, arch: str = "qwen2", hidden_size: int = 32, layers: int = 2,
                            seed: int = 0, chat_template: Optional[str] = None, tokenizer: Any = None) -> str:
    """Write a tiny random reward model and a tokenizer to ``save_dir``; return the path.

    :param tokenizer: the tokenizer to save with it (default: the demo tokenizer, trained on the spot).
    :param chat_template: set on the saved tokenizer (makes it differ from a policy tokenizer without one).
    """
    import torch
    from transformers import AutoModelForSequenceClassification

    os.makedirs(save_dir, exist_ok=True)
    if tokenizer is None:
        from rlcore.demo import build_tokenizer

        tokenizer = build_tokenizer(save_dir)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(save_dir)
    config = reward_model_config(arch, vocab_size=len(tokenizer), hidden_size=hidden_size, layers=layers, heads=4,
                                 kv_heads=2, intermediate_size=hidden_size * 2, max_positions=256,
                                 pad_token_id=int(tokenizer.pad_token_id or 0))
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():  # a visible spread of scores: the default head init is tiny
        model.score.weight.normal_(0.0, 1.0)
    model.save_pretrained(save_dir)
    return save_dir
