"""LoRA adapter layers as the rollout engine sees them: the weight a layer computes with.

Kept apart from the engine so that it reads any model's effective weights without knowing ``peft``
(the actor's adapters are added by :mod:`rlcore.trainer.lora`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def is_lora(model: Any) -> bool:
    """Whether ``model`` is a ``peft`` model (has adapters that can be switched off)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def has_adapter_layers(model: nn.Module) -> bool:
    """Whether some submodule of ``model`` is a LoRA layer (also after ``get_base_model()``)."""
    return any(hasattr(m, "lora_A") and hasattr(m, "get_delta_weight") for m in model.modules())


def unwrap(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a ``peft`` model (its LoRA layers included); other models as they are."""
    return model.get_base_model() if is_lora(model) else model


@torch.no_grad()
def effective_weight(layer: nn.Module) -> torch.Tensor:
    """The weight ``layer`` computes with: a plain layer's ``weight``; a LoRA layer's base weight plus
    ``scale * B @ A`` of each active adapter (unless the adapters are merged or disabled)."""
    if not (hasattr(layer, "get_delta_weight") and hasattr(layer, "lora_A")):
        return layer.weight
    base = layer.get_base_layer().weight
    if getattr(layer, "merged", False) or getattr(layer, "disable_adapters", False):
        return base
    out = base
    for name in layer.active_adapters:
        if name in layer.lora_A:
            out = out + layer.get_delta_weight(name).to(base.dtype)
    return out
