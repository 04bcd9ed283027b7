"""Loading the actor, reference and critic, and the teacher-forced forward passes over rollouts."""

from __future__ import annotations

import copy
import logging
import os
from typing import Any, Optional

import torch
from torch import nn

from rlcore import rlmath
from rlcore.errors import ConfigError

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_model_path(path: str, key: str) -> None:
    """Raise early (before any weights load) if ``path`` is not a Hugging Face model directory."""
    if not os.path.isdir(path):
        raise ConfigError([f"'{key}' = {path!r}: no such directory"])
    if not os.path.exists(os.path.join(path, "config.json")):
        raise ConfigError([f"'{key}' = {path!r}: not a Hugging Face model directory (no config.json)"])


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_causal_lm(path: str, dtype: str = "fp32", device: torch.device | str = "cpu") -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    return model.to(device)


class ValueModel(nn.Module):
    """A causal LM's backbone with a scalar head: one value per token."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.normal_(self.value_head.weight, std=1.0 / (hidden_size + 1))
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_causal_lm(cls, lm: nn.Module) -> "ValueModel":
        backbone = lm.get_decoder() if hasattr(lm, "get_decoder") else lm.base_model
        model = cls(backbone, lm.config.hidden_size)
        model.config = lm.config
        return model.to(next(lm.parameters()).device, dtype=next(lm.parameters()).dtype)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor) -> torch.Tensor:
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False)
        return self.value_head(out.last_hidden_state).squeeze(-1)


def frozen_copy(model: nn.Module) -> nn.Module:
    ref = copy.deepcopy(model)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only (left padding gets position 0). ``[B, T] -> [B, T]``."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def response_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      response_len: int, temperature: float = 1.0,
                      with_entropy: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Teacher-forced log-probs of the last ``response_len`` tokens. ``[B, T] -> [B, R]`` (and entropy ``[B, R]``)."""
    temp = temperature if temperature > 0 else 1.0
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
                use_cache=False, logits_to_keep=response_len + 1)
    logits = out.logits[:, -(response_len + 1):-1]
    labels = input_ids[:, -response_len:]
    logp = rlmath.logprobs_from_logits(logits, labels, temperature=temp)
    ent = rlmath.entropy_from_logits(logits, temperature=temp) if with_entropy else None
    return logp, ent


def response_values(critic: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    response_len: int) -> torch.Tensor:
    """Values of the states before each response token. ``[B, T] -> [B, R]``."""
    values = critic(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask))
    return values[:, -(response_len + 1):-1].float()


def build_optimizer(model: nn.Module, role_cfg: Any, total_steps: int):
    """AdamW with linear warmup then a constant, cosine or linear schedule."""
    import math

    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=role_cfg.lr, weight_decay=role_cfg.weight_decay, betas=(0.9, 0.95))
    warmup = max(0, int(role_cfg.warmup_steps))
    total = max(1, int(total_steps))
    kind = role_cfg.lr_scheduler

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        if kind == "linear":
            return 1.0 - progress
        return 1.0

    sched = torch.optim.lr_scheduler.LambdaLR(optim, factor)
    return optim, sched
