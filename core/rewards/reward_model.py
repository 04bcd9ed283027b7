"""A Hugging Face reward model: a sequence-classification directory with ``num_labels=1``.

The score of a sequence is the head's output at its last token. Inputs are the policy's own token
ids (prompt then response) when the reward model reads the same vocabulary and chat template as the
policy; otherwise each sample is re-tokenized with the reward model's tokenizer, through its chat
template when it has one (``[user: prompt, assistant: response]``, or a column of chat messages
followed by the response). Inputs longer than ``reward_model.max_length`` keep their last tokens.

Sequences are sorted by length and scored in micro-batches of ``reward_model.micro_batch_size``.
Where the model's head is the usual ``score`` linear layer (Llama, Qwen2, Mistral, Gemma …) the
backbone runs once and only the last hidden state of each sequence goes through the head; other
heads get the model's own forward.
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional, Sequence

import torch

from rlcore.config.schema import Dtype, torch_dtype
from rlcore.errors import RewardError
from rlcore.rewards.base import ComponentResult

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_reward_model_dir(path: Optional[str]) -> Any:
    """The config of the reward model at ``path``; :class:`RewardError` unless it is a local
    sequence-classification directory with one label."""
    from transformers import AutoConfig

    if not path:
        raise RewardError("reward_model.enable is true but reward_model.path is not set")
    if not os.path.isdir(path):
        raise RewardError(f"reward_model.path '{path}' does not exist (a local Hugging Face model directory is "
                          "expected; nothing is downloaded)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise RewardError(f"reward_model.path '{path}' is not a Hugging Face model directory (no config.json)")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise RewardError(f"reward_model.path '{path}': config.json cannot be read: {type(e).__name__}: {e}") from e
    archs = list(getattr(config, "architectures", None) or [])
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise RewardError(
            f"reward_model.path '{path}' is not a sequence-classification model (architectures: "
            f"{', '.join(archs) or 'none'}). A reward model is saved from AutoModelForSequenceClassification "
            "with num_labels=1; a causal LM cannot be used as one.")
    if getattr(config, "num_labels", None) != 1:
        raise RewardError(f"reward_model.path '{path}' has num_labels={config.num_labels}; a reward model has "
                          "num_labels=1 (one scalar score)")
    return config


def _load_tokenizer(path: str) -> Any:
    if not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        return None
    from rlcore.trainer.models import tokenizer_as_saved

    try:
        return tokenizer_as_saved(path, local_files_only=True)
    except Exception as e:
        raise RewardError(f"reward_model.path '{path}': its tokenizer cannot be loaded: "
                          f"{type(e).__name__}: {e}") from e


def same_tokenizer(a: Any, b: Any) -> bool:
    """Whether two tokenizers map text to the same ids and render chats the same way."""
    if a is b:
        return True
    if a is None or b is None:
        return False
    return (len(a) == len(b) and getattr(a, "chat_template", None) == getattr(b, "chat_template", None)
            and a.get_vocab() == b.get_vocab())


def _chat_column(extras: dict[str, list], i: int) -> Optional[list]:
    """A column holding this sample's chat messages (a list of ``{"role", "content"}`` dicts), if any."""
    for key in sorted(extras):
        v = extras[key][i]
        if isinstance(v, (list, tuple)) and v and all(isinstance(m, dict) and "role" in m and "content" in m
                                                      for m in v):
            return [dict(m) for m in v]
    return None


class RewardModel:
    """A reward model module plus the tokenization that feeds it. Device-agnostic: callers place it.

    :param module: an ``AutoModelForSequenceClassification`` model with ``num_labels=1``.
    :param tokenizer: the reward model's tokenizer (None: it reads the policy's ids).
    :param policy_tokenizer: the actor's tokenizer.
    """

    def __init__(self, module: torch.nn.Module, tokenizer: Any, policy_tokenizer: Any, *, max_length: int = 2048,
                 micro_batch_size: int = 16, source: str = "reward model"):
        if micro_batch_size < 1 or max_length < 1:
            raise RewardError(f"reward_model.micro_batch_size ({micro_batch_size}) and reward_model.max_length "
                              f"({max_length}) must be >= 1")
        self.module = module.eval().requires_grad_(False)
        self.source = source
        self.policy_tokenizer = policy_tokenizer
        self.tokenizer = tokenizer if tokenizer is not None else policy_tokenizer
        self.retokenize = tokenizer is not None and not same_tokenizer(policy_tokenizer, tokenizer)
        self.max_length, self.micro_batch_size = int(max_length), int(micro_batch_size)
        pad = getattr(self.tokenizer, "pad_token_id", None)
        self.pad_id = int(pad if pad is not None else (getattr(module.config, "pad_token_id", None) or 0))
        head = getattr(module, "score", None)
        base = getattr(module, getattr(module, "base_model_prefix", ""), None)
        self._head = head if isinstance(head, torch.nn.Linear) and isinstance(base, torch.nn.Module) else None
        self._base = base if self._head is not None else None

    @classmethod
    def load(cls, cfg: Any, policy_tokenizer: Any) -> "RewardModel":
        """Load from ``cfg.path`` (a ``RewardModelConfig``) on the CPU in ``cfg.dtype``; errors name the path."""
        from transformers import AutoModelForSequenceClassification

        if cfg.dtype not in Dtype.values():
            raise RewardError(f"reward_model.dtype '{cfg.dtype}' is not one of {', '.join(Dtype.values())}")
        check_reward_model_dir(cfg.path)
        tokenizer = _load_tokenizer(cfg.path)
        try:
            module = AutoModelForSequenceClassification.from_pretrained(cfg.path, dtype=torch_dtype(cfg.dtype),
                                                                        local_files_only=True)
        except Exception as e:
            raise RewardError(f"reward_model.path '{cfg.path}' cannot be loaded: {type(e).__name__}: {e}") from e
        vocab = getattr(module.config, "get_text_config", lambda: module.config)().vocab_size
        if tokenizer is None and policy_tokenizer is not None and len(policy_tokenizer) > vocab:
            raise RewardError(f"reward_model.path '{cfg.path}' has no tokenizer and its vocabulary ({vocab}) "
                              f"is smaller than the policy's ({len(policy_tokenizer)})")
        return cls(module, tokenizer, policy_tokenizer, max_length=cfg.max_length,
                   micro_batch_size=cfg.micro_batch_size, source=cfg.path)

    # -- inputs ------------------------------------------------------------------------------
    def _render(self, batch: Any, i: int) -> str:
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            messages = _chat_column(batch.extras, i) or [{"role": "user", "content": batch.prompts[i]}]
            messages.append({"role": "assistant", "content": batch.responses[i]})
            return tok.apply_chat_template(messages, tokenize=False)
        return batch.prompts[i] + batch.responses[i]

    def encode(self, batch: Any) -> tuple[list[list[int]], int]:
        """Token ids the reward model reads, one list per sample, and how many were cut to ``max_length``."""
        if self.retokenize:
            templated = bool(getattr(self.tokenizer, "chat_template", None))
            texts = [self._render(batch, i) for i in range(len(batch.responses))]
            seqs = [list(x) for x in self.tokenizer(texts, add_special_tokens=not templated)["input_ids"]]
        else:
            seqs = [list(p) + list(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
        for i, s in enumerate(seqs):
            if not s:
                raise RewardError(f"sample {i} is empty: nothing for the reward model to score")
        truncated = sum(len(s) > self.max_length for s in seqs)
        return [s[-self.max_length:] for s in seqs], truncated

    # -- scoring -----------------------------------------------------------------------------
    def _score_batch(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Scores ``[B]`` of right-padded ``ids``/``mask`` ``[B, T]``, read at each row's last real token."""
        if self._head is not None:
            hidden = self._base(input_ids=ids, attention_mask=mask, use_cache=False)[0]  # [B, T, H]
            last = mask.sum(-1) - 1  # [B]
            pooled = hidden[torch.arange(ids.shape[0], device=ids.device), last]  # [B, H]
            return self._head(pooled).squeeze(-1)
        return self.module(input_ids=ids, attention_mask=mask).logits.squeeze(-1)

    @torch.inference_mode()
    def forward(self, seqs: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
        """Float32 scores ``[N]`` on the CPU for token-id lists ``seqs``, computed on ``device``."""
        n = len(seqs)
        order = sorted(range(n), key=lambda i: -len(seqs[i]))
        parts, index = [], []
        pin = device.type == "cuda"
        for start in range(0, n, self.micro_batch_size):
            idx = order[start:start + self.micro_batch_size]
            width = len(seqs[idx[0]])
            ids = torch.full((len(idx), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for row, i in enumerate(idx):
                ids[row, :len(seqs[i])] = torch.tensor(seqs[i], dtype=torch.long)
                mask[row, :len(seqs[i])] = 1
            if pin:
                ids, mask = ids.pin_memory(), mask.pin_memory()
            ids, mask = ids.to(device, non_blocking=pin), mask.to(device, non_blocking=pin)
            parts.append(self._score_batch(ids, mask).float())
            index.extend(idx)
        out = torch.empty(n, dtype=torch.float32)
        out[torch.tensor(index, dtype=torch.long)] = torch.cat(parts).cpu()
        return out


class ResidentScorer:
    """The reward component of a model that stays on one device (the CPU or a GPU) for the whole run."""

    name = "rm"

    def __init__(self, rm: RewardModel, device: torch.device):
        self.rm, self.device = rm, torch.device(device)
        rm.module.to(self.device)

    def __call__(self, batch: Any) -> ComponentResult:
        t = time.perf_counter()
        seqs, truncated = self.rm.encode(batch)
        scores = self.rm.forward(seqs, self.device)
        return ComponentResult(scores=scores.tolist(), metrics={
            "reward/rm_truncated": float(truncated), "time/reward_model_s": time.perf_counter() - t})
