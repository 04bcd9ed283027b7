"""``rlcore.shape``: one reader of a decoder's sizes for the memory and FLOP estimates."""

import pytest
import torch
from transformers import GPT2Config, Qwen2Config

from rlcore.observe.flops import estimate_flops, matmul_params
from rlcore.rollout.autosize import estimate_sample_bytes
from rlcore.shape import decoder_shape
from rlcore.trainer.recompute import activation_bytes_per_token


def test_sizes_are_read_under_each_familys_names():
    qwen = decoder_shape(Qwen2Config(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                                     num_key_value_heads=2, intermediate_size=8960, vocab_size=151936))
    assert qwen == (1536, 28, 12, 2, 128, 8960, 151936) and qwen.kv == 256
    gpt2 = decoder_shape(GPT2Config(n_embd=64, n_layer=3, n_head=4, vocab_size=100))
    # no key/value heads, head dim or inner size named: all heads, hidden // heads, 4 x hidden
    assert gpt2 == (64, 3, 4, 4, 16, 256, 100)
    mapping = decoder_shape({"d_model": 32, "num_layers": 2, "n_head": 2, "head_dim": 8, "ffn_dim": 48})
    assert mapping == (32, 2, 2, 2, 8, 48, 0) and mapping.missing() == []


def test_a_config_without_the_sizes_an_estimate_needs_is_named():
    shape = decoder_shape({"hidden_size": 64})
    assert shape.missing() == ["num_hidden_layers", "num_attention_heads"]
    with pytest.raises(ValueError, match="num_hidden_layers, num_attention_heads"):
        estimate_flops({"hidden_size": 64}, 10, 10)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        estimate_sample_bytes({"hidden_size": 64}, 16)


def test_the_estimates_read_the_same_sizes():
    cfg = GPT2Config(n_embd=64, n_layer=3, n_head=4, n_inner=None, vocab_size=100)
    s = decoder_shape(cfg)
    # the update's estimate: per layer 6 h + 2 kv + 4 i elements and 2 h float32 norms, then the logits row
    assert activation_bytes_per_token(cfg, torch.bfloat16) == \
        s.layers * ((6 * s.hidden + 2 * s.kv + 4 * s.inter) * 2 + 2 * s.hidden * 4) + s.vocab * 2
    # the rollout's: the KV cache, float32 logits and the sampler's temporaries, the prompt's activations
    assert estimate_sample_bytes(cfg, 10) == 2 * s.layers * s.kv * 10 * 2 + 3 * s.vocab * 4 + \
        10 * (4 * s.hidden + 2 * s.inter) * 2
    assert matmul_params(cfg) == s.layers * (4 * s.hidden * s.hidden + 2 * s.hidden * s.inter) + s.hidden * s.vocab
