"""Model FLOPs and device peak FLOPs, for the ``perf/mfu`` metric.

MFU here is *training-equivalent*: the FLOPs of one forward and backward pass over every token
of the step (``6 * matmul_params + attention``, as in the PaLM paper's appendix), divided by the
step's wall time and the device's dense bf16 peak. Generation and the extra forward passes of
RL (old/reference log-probs, values) are not counted separately, so the number is comparable
across algorithms and with pre-training MFU figures.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional, Union

import torch

from rlcore.shape import DecoderShape, config_value, decoder_shape

log = logging.getLogger(__name__)

#: Dense bf16 tensor-core peak per GPU, in FLOP/s, matched against the CUDA device name
#: (first match wins, so more specific names come first).
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("H200", 989.4e12),
    ("H100 NVL", 835e12),
    ("H100 PCIE", 756e12),
    ("H100", 989.4e12),
    ("H800", 989.4e12),
    ("H20", 148e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
    ("MI300X", 1307e12),
    ("MI250X", 383e12),
)


def _shape(model_config: Any) -> DecoderShape:
    shape = decoder_shape(model_config)
    if shape.missing():
        raise ValueError(f"cannot count the FLOPs of this model: its config has no {', '.join(shape.missing())}")
    return shape


def matmul_params(model_config: Any) -> float:
    """Weights that take part in a matmul per token (embedding lookup excluded, LM head included).

    Reads Hugging Face config names (``hidden_size``/``n_embd``, ``num_hidden_layers``/``n_layer``,
    ``num_key_value_heads``, ``intermediate_size``, MoE ``num_experts_per_tok``).
    """
    shape = _shape(model_config)
    d = shape.hidden
    attn = d * shape.heads * shape.head_dim * 2 + d * shape.kv * 2  # q, o, k, v
    experts = int(config_value(model_config, "num_experts_per_tok", default=1))
    ff = config_value(model_config, "moe_intermediate_size") if experts > 1 else None
    ff = int(ff or shape.inter)
    act = str(config_value(model_config, "hidden_act", "activation_function", default="silu"))
    gated = act in ("silu", "swiglu", "geglu") or "llama" in str(config_value(model_config, "model_type", default=""))
    mlp = (3 if gated else 2) * d * ff * experts
    return float(shape.layers * (attn + mlp) + d * shape.vocab)


def estimate_flops(model_config: Any, n_tokens: float, seq_len: int) -> float:
    """FLOPs of one forward + backward pass over ``n_tokens`` tokens in sequences of ``seq_len``.

    ``6 * N * tokens`` for the matmuls plus ``12 * layers * heads * head_dim * seq_len * tokens``
    for attention scores and values.
    """
    shape = _shape(model_config)
    dense = 6.0 * matmul_params(model_config) * float(n_tokens)
    attention = 12.0 * shape.layers * shape.heads * shape.head_dim * float(seq_len) * float(n_tokens)
    return dense + attention


def peak_flops(device: Union[torch.device, str, None]) -> Optional[float]:
    """Dense bf16 peak FLOP/s of ``device``; None for a CPU or an unknown accelerator (MFU is then omitted)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(dev)
    return peak_flops_for_name(name)


@functools.lru_cache(maxsize=None)
def peak_flops_for_name(name: str) -> Optional[float]:
    """Peak of a CUDA device name (logged once when unknown)."""
    upper = name.upper()
    for key, value in PEAK_BF16_FLOPS:
        if key in upper:
            return value
    log.info("no peak FLOPs known for %r: perf/mfu is not reported", name)
    return None
