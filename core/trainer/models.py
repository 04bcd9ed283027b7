"""Loading the actor, reference and critic, and the teacher-forced forward passes over rollouts."""

from __future__ import annotations

import copy
import logging
import os
import weakref
from typing import Any, Optional

import torch
from torch import nn

from rlcore import rlmath
from rlcore.errors import ConfigError
from rlcore.kernels import logprob as logprob_kernels
from rlcore.trainer import aligned as aligned_rows
from rlcore.trainer.aligned import KnownRows, align_left, safe_masked_width

log = logging.getLogger(__name__)



def check_model_path(path: str, key: str) -> None:
    """Raise early (before any weights load) if ``path`` is not a Hugging Face model directory."""
    if not os.path.isdir(path):
        raise ConfigError([f"'{key}' = {path!r}: no such directory"])
    if not os.path.exists(os.path.join(path, "config.json")):
        raise ConfigError([f"'{key}' = {path!r}: not a Hugging Face model directory (no config.json)"])


#: ``tokenizer_class`` values that mean "the ``tokenizer.json`` pipeline as saved" (transformers 4 | 5)
GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def declared_tokenizer_class(path: str) -> Optional[str]:
    """The ``tokenizer_class`` a local tokenizer directory's ``tokenizer_config.json`` names, or None."""
    import json

    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            value = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def tokenizer_as_saved(path: str, **kwargs: Any):
    """``from_pretrained`` of the tokenizer at ``path``: with the generic fast class when its
    ``tokenizer_config.json`` declares it (see :func:`load_tokenizer`), else ``AutoTokenizer``'s choice."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if (declared_tokenizer_class(path) in GENERIC_TOKENIZER_CLASSES
            and os.path.isfile(os.path.join(path, "tokenizer.json"))):
        return PreTrainedTokenizerFast.from_pretrained(path, **kwargs)
    return AutoTokenizer.from_pretrained(path, **kwargs)


def load_tokenizer(path: str):
    """The tokenizer of ``path`` through ``from_pretrained``, padded on the left (pad = EOS where it has none).

    A directory whose ``tokenizer_config.json`` names the generic fast class (``PreTrainedTokenizerFast``,
    ``TokenizersBackend`` in transformers 5) loads with that class, i.e. as its ``tokenizer.json`` was
    saved: ``AutoTokenizer`` of transformers 5 replaces it with the model type's own class for some
    model types (Qwen2's byte-level tokenizer for a Qwen2 config), which rebuilds the pre-tokenizer
    and decoder (the demo's word tokenizer would decode ``"c k a f"`` as ``"ckaf"``)."""
    tok = tokenizer_as_saved(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_causal_lm(path: str, dtype: str = "fp32", device: torch.device | str = "cpu",
                   attn_implementation: Optional[str] = None) -> nn.Module:
    """The causal LM at ``path`` in ``dtype`` on ``device``; ``attn_implementation``: the attention of its
    forwards (None: the model's default)."""
    from transformers import AutoModelForCausalLM

    from rlcore.config.schema import torch_dtype

    extra = {} if attn_implementation is None else {"attn_implementation": str(attn_implementation)}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype), **extra)
    return model.to(device)


def check_attn_implementation(value: Optional[str], device: torch.device, key: str) -> None:
    """Raise :class:`~rlcore.errors.ConfigError` naming ``key`` when the attention ``value`` cannot run a
    training forward and backward on ``device`` (flash kernels need their package and CUDA; flex
    attention has no backward on CPU)."""
    import importlib.util

    from rlcore.errors import ConfigError

    if value is None or str(value) in ("sdpa", "eager"):
        return
    value = str(value)
    if device.type != "cuda":
        raise ConfigError([f"'{key}': {value} trains on CUDA only, this role's device is {device} (use sdpa)"])
    package = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}.get(value)
    if package is not None and importlib.util.find_spec(package) is None:
        raise ConfigError([f"'{key}': {value} needs the '{package}' package, which is not installed "
                           "(install it, or use sdpa or flex_attention)"])


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

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
                position_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        # attention_mask None with restarting position_ids: packed sequences (rlcore.trainer.packing);
        # kwargs carry the variable-length attention arguments of flash-attention kernels
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False, **kwargs)
        # a matrix-vector product gives [B, T] directly (no squeezed view of the head's output, which
        # FSDP2 warns about for a wrapped module's return value)
        return torch.matmul(out.last_hidden_state, self.value_head.weight[0]) + self.value_head.bias[0]


def frozen_copy(model: nn.Module) -> nn.Module:
    ref = copy.deepcopy(model)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only (left padding gets position 0). ``[B, T] -> [B, T]``."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


#: use the one-pass kernels of :mod:`rlcore.kernels.logprob` where they run (CUDA); off: the reference
#: (:func:`rlcore.rlmath.logprobs_from_logits`) everywhere
LOGPROB_KERNELS = True


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float, with_entropy: bool = False,
                   entropy_grad: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs of ``labels`` under ``softmax(logits / T)`` and, with ``with_entropy``, the entropy:
    ``logits [B, R, V]``, ``labels [B, R]`` -> ``([B, R], [B, R] or None)`` float32.

    Two implementations: the one-pass kernels (:func:`rlcore.kernels.logprob.token_logprobs`, CUDA; their
    entropy carries no gradient) and the reference in :mod:`rlcore.rlmath` (chunked float32 PyTorch),
    taken elsewhere, or when the entropy needs a gradient (``entropy_grad``).
    """
    if (LOGPROB_KERNELS and logprob_kernels.available(logits.device)
            and not (with_entropy and entropy_grad and torch.is_grad_enabled())):
        return logprob_kernels.token_logprobs(logits, labels, temperature, with_entropy)
    logp = rlmath.logprobs_from_logits(logits, labels, temperature=temperature)
    if not with_entropy:
        return logp, None
    if entropy_grad:
        return logp, rlmath.entropy_from_logits(logits, temperature=temperature)
    with torch.no_grad():
        return logp, rlmath.entropy_from_logits(logits.detach(), temperature=temperature)



#: the attribute of a model holding :func:`set_logprob_head`'s choice (absent: "logits"); an attribute, so copies keep it
_HEAD_ATTR = "_rlcore_logprob_head"
#: models whose fused head was checked against their own logits: model -> passed
_HEAD_CHECKED: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()
#: config attributes that put something between the head and the softmax (the fused path is then off)
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


#: Hugging Face classes whose logits are ``lm_head(last hidden states)``, nothing more (others are checked)
_PLAIN_HEADS = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                          "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"})


def set_logprob_head(model: nn.Module, mode: str) -> None:
    """Choose how ``model``'s teacher-forced log-probs are computed (``ppo.logprob_head``):
    ``"fused"`` (the head fused with the log-softmax, :mod:`rlcore.kernels.linear_logprob`: no
    ``[tokens, V]`` logits), ``"logits"`` (the model's own logits, the default), ``"auto"`` (fused on CUDA)."""
    if mode not in ("auto", "fused", "logits"):
        raise ValueError(f"logprob head must be auto, fused or logits, got {mode!r}")
    object.__setattr__(model, _HEAD_ATTR, mode)


def fused_head(model: nn.Module, device: torch.device) -> Optional[tuple[nn.Module, torch.Tensor]]:
    """``(decoder, head weight)`` when ``model``'s log-probs may be computed from its last hidden
    states by the fused head (:func:`set_logprob_head`), else ``None`` (see :func:`split_head`)."""
    mode = getattr(model, _HEAD_ATTR, "logits")
    if mode == "logits" or (mode == "auto" and device.type != "cuda"):
        return None
    return split_head(model, device)


def split_head(model: nn.Module, device: torch.device) -> Optional[tuple[nn.Module, torch.Tensor]]:
    """``(decoder, head weight)`` when ``model``'s logits are exactly ``decoder(...) @ W^T``: a Hugging
    Face causal LM with a bias-free linear head, nothing between it and the softmax, weights that are
    plain tensors (not FSDP shards, which only the model's own forward gathers); else ``None``.
    Checked once per model against its own logits on a few tokens."""
    get_decoder, get_head = getattr(model, "get_decoder", None), getattr(model, "get_output_embeddings", None)
    if get_decoder is None or get_head is None:
        return None
    head, decoder = get_head(), get_decoder()
    config = getattr(model, "config", None)
    if (type(head) is not nn.Linear or head.bias is not None or decoder is None or decoder is model
            or type(head.weight) is not nn.Parameter
            or any(getattr(config, name, None) not in (None, 0, 1, 1.0) for name in _LOGIT_TRANSFORMS)):
        return None
    if model not in _HEAD_CHECKED and type(model).__name__ in _PLAIN_HEADS:
        _HEAD_CHECKED[model] = True
    if model not in _HEAD_CHECKED:
        _HEAD_CHECKED[model] = _head_matches_logits(model, decoder, head.weight, device)
        if not _HEAD_CHECKED[model]:
            log.warning("%s's logits are not its decoder's last hidden states times its head; computing "
                        "log-probs from its logits", type(model).__name__)
    return (decoder, head.weight) if _HEAD_CHECKED[model] else None


@torch.no_grad()
def _head_matches_logits(model: nn.Module, decoder: nn.Module, weight: torch.Tensor, device: torch.device) -> bool:
    ids = torch.arange(3, 11, device=device)[None] % int(weight.shape[0])
    logits = model(input_ids=ids, use_cache=False).logits[0].float()
    hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state[0]
    mine = (hidden @ weight.t()).float()
    return bool(torch.allclose(mine, logits, rtol=1e-2, atol=1e-2 * float(logits.abs().max().clamp(min=1))))


def _fused_logprobs(decoder: nn.Module, weight: torch.Tensor, kwargs: dict, rows: torch.Tensor,
                    positions: torch.Tensor, labels: torch.Tensor, temperature: float, with_entropy: bool):
    """Log-probs (and entropy) of ``labels [K]`` predicted at ``(rows, positions)`` of the decoder's
    last hidden states, through the fused head."""
    from rlcore.kernels.linear_logprob import linear_token_logprobs

    hidden = decoder(**kwargs, use_cache=False).last_hidden_state
    return linear_token_logprobs(hidden[rows, positions], weight, labels, temperature, with_entropy)


def response_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      response_len: int, temperature: float = 1.0,
                      with_entropy: bool = False,
                      entropy_grad: bool = True, *, response_mask: Optional[torch.Tensor] = None,
                      packed: bool = False,
                      known: Optional[KnownRows] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Teacher-forced log-probs of the last ``response_len`` tokens. ``[B, T] -> [B, R]`` (and entropy ``[B, R]``).

    The log-probs go through :func:`token_logprobs`. ``entropy_grad=False``: the entropy is a metric
    only (no gradient).

    ``packed=True`` (needs ``response_mask [B, R]``): one forward over the samples' real tokens packed
    into one row (:mod:`rlcore.trainer.packing`), logits only where they predict a response token;
    positions outside ``response_mask`` are 0.

    Otherwise each row's tokens are moved to its first column and the forward runs without an attention
    mask (:mod:`rlcore.trainer.aligned`: the kernels' causal path, no fully masked rows); the head runs
    on the response positions' hidden states only where the model's logits are its decoder's output
    times its head (:func:`split_head`; with ``response_mask``, on its tokens only, 0 elsewhere), else
    on the window of positions the rows need. Response positions past a row's end (right padding)
    hold finite values of no meaning, as before.

    ``known``: the rows' sizes as the host knows them (:class:`~rlcore.trainer.aligned.KnownRows`, with
    ``response_mask``): the forward then reads nothing of the device to shape its tensors, and the host
    can queue the next micro-batch while this one runs.
    """
    temp = temperature if temperature > 0 else 1.0
    fused = None
    if not (with_entropy and entropy_grad and torch.is_grad_enabled()):  # the fused entropy has no gradient
        fused = fused_head(model, input_ids.device)
    if packed:
        if response_mask is None:
            raise ValueError("response_logprobs: packed=True needs the response_mask")
        from rlcore.trainer.packing import pack

        rows = pack(input_ids, attention_mask, response_mask)
        if fused is not None:
            logp, ent = _fused_logprobs(*fused, rows.forward_kwargs(model), torch.zeros_like(rows.index),
                                        rows.index, rows.labels.long(), float(temp), bool(with_entropy))
            return rows.unpack(logp), (rows.unpack(ent) if ent is not None else None)
        out = model(**rows.forward_kwargs(model), use_cache=False, logits_to_keep=rows.index)
        logp, ent = token_logprobs(out.logits, rows.labels[None].long(), float(temp), bool(with_entropy),
                                  entropy_grad)
        return rows.unpack(logp[0]), (rows.unpack(ent[0]) if ent is not None else None)
    longest = known.longest if known is not None else None
    aligned = align_left(input_ids, attention_mask, longest=longest) if aligned_rows.ENABLED else None
    if aligned is None:  # some row's tokens have holes: the masked forward
        return _masked_logprobs(model, fused, input_ids, attention_mask, response_len, temp, with_entropy,
                                entropy_grad, response_mask)
    pos = aligned.response_positions(response_len)
    labels = input_ids[:, -response_len:].long()
    if fused is not None:
        rows, cols = (_trained_at(response_mask, known) if response_mask is not None
                      else attention_mask[:, -response_len:].bool().nonzero(as_tuple=True))
        with aligned_rows.rows_not_packed():
            logp, ent = _fused_logprobs(*fused, aligned.forward_kwargs(), rows, pos[rows, cols], labels[rows, cols],
                                        float(temp), bool(with_entropy))
        return _spread((logp, ent), (input_ids.shape[0], response_len), rows, cols)
    split = split_head(model, input_ids.device)
    if split is not None:  # the head on the response positions' hidden states only
        decoder, weight = split
        with aligned_rows.rows_not_packed():
            hidden = decoder(**aligned.forward_kwargs(), use_cache=False).last_hidden_state
        if response_mask is not None:  # only the response tokens themselves: no logits for the padding
            rows, cols = _trained_at(response_mask, known)
            if len(rows):
                logits = torch.nn.functional.linear(hidden[rows, pos[rows, cols]], weight)[None]
                logp, ent = token_logprobs(logits, labels[rows, cols][None], float(temp), bool(with_entropy),
                                           entropy_grad)
                return _spread((logp[0], None if ent is None else ent[0]), (input_ids.shape[0], response_len),
                               rows, cols)
        picked = hidden.gather(1, pos[..., None].expand(-1, -1, hidden.shape[-1]))
        logits = torch.nn.functional.linear(picked, weight)
    else:  # the model's own logits over the window of positions every row needs
        low, high = torch.stack([pos.min(), pos.max()]).tolist()
        window = torch.arange(low, high + 1, device=pos.device)
        with aligned_rows.rows_not_packed():
            out = model(**aligned.forward_kwargs(), use_cache=False, logits_to_keep=window)
        logits = out.logits.gather(1, (pos - low)[..., None].expand(-1, -1, out.logits.shape[-1]))
    return token_logprobs(logits, labels, float(temp), bool(with_entropy), entropy_grad)


def _trained_at(response_mask: torch.Tensor, known: Optional[KnownRows]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, cols)`` of the set positions of ``response_mask``; their count from ``known`` (the host's
    sizes) where given, so the device is not read for it."""
    if known is None:
        return response_mask.bool().nonzero(as_tuple=True)
    return torch.nonzero_static(response_mask.bool(), size=int(known.trained)).unbind(1)


def _spread(values: tuple[torch.Tensor, Optional[torch.Tensor]], shape: tuple[int, int], rows: torch.Tensor,
            cols: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(log-probs, entropy or None)`` of the tokens at ``(rows, cols)`` into ``shape``, 0 elsewhere
    (the autograd graph kept)."""
    return tuple(v if v is None else v.new_zeros(shape).index_put((rows, cols), v) for v in values)


def _masked_logprobs(model, fused, input_ids, attention_mask, response_len, temp, with_entropy, entropy_grad,
                     response_mask):
    """:func:`response_logprobs` of rows whose tokens are not contiguous: the forward with their mask,
    at a width the cuDNN attention backward computes (:func:`rlcore.trainer.aligned.safe_masked_width`)."""
    input_ids, attention_mask = _masked_width(input_ids, attention_mask)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask))
    width = input_ids.shape[1]
    if fused is not None:
        keep = (response_mask.bool() if response_mask is not None
                else attention_mask[:, width - response_len:].bool())
        rows, cols = keep.nonzero(as_tuple=True)
        logp, ent = _fused_logprobs(*fused, kwargs, rows, cols + (width - response_len - 1),
                                    input_ids[:, width - response_len:][rows, cols].long(), float(temp),
                                    bool(with_entropy))
        return _spread((logp, ent), (input_ids.shape[0], response_len), rows, cols)
    out = model(**kwargs, use_cache=False, logits_to_keep=response_len + 1)
    logits = out.logits[:, -(response_len + 1):-1]
    labels = input_ids[:, -response_len:]
    return token_logprobs(logits, labels.long(), float(temp), bool(with_entropy), entropy_grad)


def _masked_width(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows widened on the left with padding to :func:`~rlcore.trainer.aligned.safe_masked_width`."""
    extra = safe_masked_width(input_ids.shape[1]) - input_ids.shape[1]
    if not extra:
        return input_ids, attention_mask
    pad = torch.nn.functional.pad
    return pad(input_ids, (extra, 0)), pad(attention_mask, (extra, 0))


def response_values(critic: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    response_len: int, *, response_mask: Optional[torch.Tensor] = None,
                    packed: bool = False, known: Optional[KnownRows] = None) -> torch.Tensor:
    """Values of the states before each response token. ``[B, T] -> [B, R]``; ``packed`` and ``known`` as in
    :func:`response_logprobs`; rows moved left and no attention mask as there (:mod:`rlcore.trainer.aligned`)."""
    if packed:
        if response_mask is None:
            raise ValueError("response_values: packed=True needs the response_mask")
        from rlcore.trainer.packing import pack

        rows = pack(input_ids, attention_mask, response_mask)
        values = critic(**rows.forward_kwargs(critic))
        return rows.unpack(values[0, rows.index].float())
    longest = known.longest if known is not None else None
    aligned = align_left(input_ids, attention_mask, longest=longest) if aligned_rows.ENABLED else None
    if aligned is None:
        input_ids, attention_mask = _masked_width(input_ids, attention_mask)
        values = critic(input_ids=input_ids, attention_mask=attention_mask,
                        position_ids=position_ids(attention_mask))
        return values[:, -(response_len + 1):-1].float()
    with aligned_rows.rows_not_packed():
        values = critic(**aligned.forward_kwargs())
    return values.gather(1, aligned.response_positions(response_len)).float()


def build_optimizer(model: nn.Module, role_cfg: Any, total_steps: int):
    """AdamW and the role's learning-rate schedule (:func:`build_scheduler`)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=role_cfg.lr, weight_decay=role_cfg.weight_decay,
                              betas=tuple(float(b) for b in role_cfg.betas), eps=float(role_cfg.eps))
    return optim, build_scheduler(optim, role_cfg.lr_scheduler, role_cfg.warmup_steps, total_steps,
                                  role_cfg.lr_scheduler_kwargs)


#: schedules of ``transformers.get_scheduler`` that step on a validation metric the trainer does not pass
METRIC_SCHEDULES = ("reduce_lr_on_plateau", "greedy")


def build_scheduler(optim: torch.optim.Optimizer, name: str, warmup_steps: int, total_steps: int,
                    kwargs: dict | None = None):
    """``transformers.get_scheduler(name)`` over ``total_steps`` optimizer steps, the first ``warmup_steps``
    warming up; ``constant`` with warmup steps is ``constant_with_warmup``.

    :raises ValueError: a schedule that needs a metric, or ``kwargs`` the schedule does not take.
    """
    from transformers import get_scheduler

    name, warmup = str(name), max(0, int(warmup_steps))
    if name in METRIC_SCHEDULES:
        raise ValueError(f"the {name} schedule steps on a validation metric, which the trainer does not pass")
    if name == "constant" and warmup:
        name = "constant_with_warmup"
    sched = get_scheduler(name, optim, num_warmup_steps=warmup, num_training_steps=max(1, int(total_steps)),
                          scheduler_specific_kwargs=dict(kwargs or {}))
    if warmup and isinstance(sched, torch.optim.lr_scheduler.LambdaLR):
        # transformers' warmup starts at 0 (an optimizer step that learns nothing); rlcore's first step
        # takes lr / warmup_steps and the warmup ends at the full lr on step warmup_steps
        sched.lr_lambdas = [_one_step_ahead(f) for f in sched.lr_lambdas]
        for group, base, factor in zip(optim.param_groups, sched.base_lrs, sched.lr_lambdas):
            group["lr"] = base * factor(sched.last_epoch)
        sched._last_lr = [group["lr"] for group in optim.param_groups]
    return sched


def _one_step_ahead(factor):
    """A schedule's factor function read one step later (a plain function: a scheduler's state_dict
    keeps no copy of it)."""
    def ahead(step: int) -> float:
        return factor(step + 1)

    return ahead
