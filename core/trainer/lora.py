"""LoRA actors through ``peft`` (``actor.lora``): adapters, the adapter-free reference, merged weights.

* :func:`add_adapters` wraps the loaded actor in a ``peft`` model; only the adapters train.
* :class:`AdaptersDisabled` is the reference policy: the same (possibly sharded) model run with its
  adapters switched off, so no second copy of the base weights is held.
* :func:`effective_weight` is a layer's weight with its adapter deltas added (what the rollout
  engine copies into its own buffers on every ``sync_weights``).
* :func:`merged_state_dict` turns a ``peft`` state dict into the plain model's, adapters merged (export).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from rlcore.errors import ConfigError
from rlcore.rollout.adapters import effective_weight, has_adapter_layers, is_lora, unwrap  # noqa: F401

#: The prefix ``peft`` puts before the wrapped model's parameter names.
PEFT_PREFIX = "base_model.model."


def require_peft() -> Any:
    try:
        import peft
    except ImportError:
        raise ConfigError(["'actor.lora.rank' > 0 needs the peft package, which is not installed: "
                           "pip install 'rlcore[lora]' (or set actor.lora.rank=0 for full fine-tuning)"]) from None
    return peft


def add_adapters(model: nn.Module, lora: Any) -> nn.Module:
    """``model`` wrapped with LoRA adapters of ``actor.lora`` (rank, alpha, dropout, target_modules).

    :raises ConfigError: peft is missing or no module matches ``actor.lora.target_modules``.
    """
    peft = require_peft()
    _refuse_embedding_targets(model, list(lora.target_modules))
    config = peft.LoraConfig(r=int(lora.rank), lora_alpha=float(lora.alpha), lora_dropout=float(lora.dropout),
                             target_modules=list(lora.target_modules), bias="none", task_type="CAUSAL_LM")
    try:
        wrapped = peft.get_peft_model(model, config)
    except ValueError as e:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ConfigError([f"'actor.lora.target_modules' = {list(lora.target_modules)}: {e} "
                           f"(linear layers of this model: {', '.join(names)})"]) from None
    return wrapped


def _refuse_embedding_targets(model: nn.Module, targets: list[str]) -> None:
    """:raises ConfigError: a target of ``actor.lora.target_modules`` matches the model's token
    embeddings or output head (whatever the model calls them), or any embedding layer."""
    special = {id(m) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None}
    wanted = [str(t) for t in targets]
    hit = sorted({name for name, m in model.named_modules() if name and (id(m) in special or isinstance(
        m, nn.Embedding)) and any(name == t or name.endswith("." + t) for t in wanted)})
    if hit:
        raise ConfigError([f"'actor.lora.target_modules' = {wanted} reaches {', '.join(hit)}: adapters on the token "
                           "embeddings or the output head are not supported (they would be left out of the "
                           "exported final/ and of the rollout engine's weights); target the decoder's linear "
                           "layers"])


class AdaptersDisabled(nn.Module):
    """The reference policy of a LoRA actor: the actor's forward with its adapters switched off.

    Holds no weights of its own (the actor is not registered as a submodule, so it is neither saved
    nor counted twice); works on the sharded actor too, whose forward gathers the base weights.
    """

    def __init__(self, actor: nn.Module):
        super().__init__()
        object.__setattr__(self, "_actor", actor)
        self.config = getattr(actor, "config", None)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self._actor.disable_adapter():
            return self._actor(*args, **kwargs)

    def train(self, mode: bool = True) -> "AdaptersDisabled":  # the actor's mode is the actor's business
        self.training = mode
        return self


def lora_scale(model: nn.Module) -> float:
    """``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA) of the model's default adapter."""
    cfg = model.peft_config["default"]
    return cfg.lora_alpha / (math.sqrt(cfg.r) if getattr(cfg, "use_rslora", False) else cfg.r)


@torch.no_grad()
def merged_state_dict(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A ``peft`` LoRA state dict as the plain model's: ``W + scale * B @ A`` under the base names.

    ``...q_proj.base_layer.weight`` + ``...q_proj.lora_A.default.weight`` / ``lora_B`` ->
    ``...q_proj.weight``; other tensors keep their names without the ``peft`` prefix.
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".lora_A." in key or ".lora_B." in key or ".lora_dropout." in key:
            continue
        name = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
        if ".base_layer." in name:
            prefix = key.split(".base_layer.")[0]
            a, b = state.get(f"{prefix}.lora_A.default.weight"), state.get(f"{prefix}.lora_B.default.weight")
            name = name.replace(".base_layer.", ".")
            if a is not None and b is not None and name.endswith(".weight"):
                delta = (b.float() @ a.float()) * scale
                value = (value.float() + delta.to(value.device)).to(value.dtype)
        out[name] = value
    return out
