"""FLOPs estimate and device peaks for MFU."""

from __future__ import annotations

import pytest
import torch

from rlcore.observe.flops import estimate_flops, matmul_params, peak_flops, peak_flops_for_name


def test_matmul_params_match_known_models():
    from transformers import LlamaConfig, Qwen2Config

    llama7b = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                          vocab_size=32000)
    assert matmul_params(llama7b) == pytest.approx(6.74e9 - 32000 * 4096, rel=0.01)
    qwen = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936)
    assert matmul_params(qwen) == pytest.approx(494e6, rel=0.01)  # tied head counted once, as a matmul


def test_estimate_counts_forward_backward_and_attention():
    cfg = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
           "vocab_size": 100}
    n = matmul_params(cfg)
    assert estimate_flops(cfg, 1000, 1) == pytest.approx(6 * n * 1000 + 12 * 2 * 64 * 1 * 1000)
    assert estimate_flops(cfg, 2000, 128) == pytest.approx(2 * estimate_flops(cfg, 1000, 128))
    gpt2 = {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100, "activation_function": "gelu_new"}
    assert matmul_params(gpt2) == 2 * (4 * 64 * 64 + 2 * 64 * 256) + 64 * 100


def test_peak_flops():
    assert peak_flops(torch.device("cpu")) is None and peak_flops("cpu") is None
    assert peak_flops_for_name("NVIDIA H100 80GB HBM3") == pytest.approx(989.4e12)
    assert peak_flops_for_name("NVIDIA H100 PCIe") == pytest.approx(756e12)
    assert peak_flops_for_name("NVIDIA H200") == pytest.approx(989.4e12)
    assert peak_flops_for_name("NVIDIA A100-SXM4-80GB") == pytest.approx(312e12)
    assert peak_flops_for_name("Mystery Accelerator") is None
