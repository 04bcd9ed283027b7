"""Types shared by every rollout backend.

A rollout backend turns a list of prompts (token ids, unpadded) into sampled responses plus the
log-probabilities of the sampled tokens. Two backends ship with rlcore: :mod:`rlcore.rollout.hf`
(Hugging Face ``generate``; any causal LM) and :mod:`rlcore.rollout.engine` (static KV cache,
CUDA graphs and continuous batching for Llama-style decoders).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence, runtime_checkable

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to sample.

    ``temperature == 0`` means greedy. ``top_k == 0`` and ``top_p == 1.0`` disable those filters.
    Log-probabilities are always those of ``log_softmax(logits / temperature)`` (temperature 1
    when greedy), so the trainer can recompute them by teacher forcing with the same temperature.
    """

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    #: > 0: end the call once at most this many samples are still decoding and none waits for a slot;
    #: those come back as they are, short of their limit and without EOS, marked in
    #: :attr:`RolloutBatch.cut` (partial rollouts carry them on). A backend that cannot stop early
    #: decodes every sample to its end (``cut`` None).
    stop_at_rows: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class RolloutBatch:
    """Padded tensors describing ``B`` prompt/response pairs.

    Shapes: ``prompt_ids``/``prompt_mask`` ``[B, P]`` (left padded),
    ``response_ids``/``response_mask``/``logprobs`` ``[B, R]`` (right padded). ``response_mask``
    is 1 for every generated token up to and including the first EOS and 0 after it.
    ``logprobs`` holds the sampled tokens' log-probabilities (0 where the mask is 0).

    Multi-turn rollouts (:mod:`rlcore.envs`) interleave model turns with observations: then
    ``response_attention`` ``[B, R]`` is 1 for every token of the sequence (observations too) and
    ``response_mask`` only for the model's tokens, the ones that train (loss, KL, entropy).

    ``cut`` ``[B]`` bool marks the samples the call ended unfinished (``SamplingParams.stop_at_rows``:
    no EOS, short of their limit); None where the call cut none.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor
    stats: dict[str, float] = field(default_factory=dict)
    response_attention: Optional[torch.Tensor] = None
    cut: Optional[torch.Tensor] = None

    @property
    def batch_size(self) -> int:
        return int(self.prompt_ids.shape[0])

    def sequences(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(input_ids, attention_mask)`` of prompt and response concatenated, ``[B, P+R]``."""
        ids = torch.cat([self.prompt_ids, self.response_ids], dim=1)
        attention = self.response_mask if self.response_attention is None else self.response_attention
        mask = torch.cat([self.prompt_mask, attention.to(self.prompt_mask.dtype)], dim=1)
        return ids, mask

    @property
    def attention(self) -> torch.Tensor:
        """``[B, R]``: every token of the responses (observations included)."""
        return self.response_mask if self.response_attention is None else self.response_attention


@runtime_checkable
class RolloutBackend(Protocol):
    """What the trainer needs from a generator.

    Every batch ``generate`` returns is checked before the trainer uses it
    (:func:`rlcore.contract.rollout_problems`): one row per prompt in order, the widths and 0/1 masks
    of :class:`RolloutBatch`, ``logprobs`` present, finite and at most 0, token ids inside the
    vocabulary, at most ``max_new_tokens`` response tokens. With ``data.env_key`` prompts may carry a
    multi-turn episode: a backend that plays them declares ``supports_episodes = True`` and passes
    such prompts to :func:`rlcore.rollout.turns.play_episodes`; without the attribute (False, as in
    :class:`rlcore.protocols.RolloutBackendBase`) the run is refused before any model loads. An
    optional ``close()`` is called once when the run ends; an optional ``release_kv()`` after each
    rollout, to hand memory the backend holds between rollouts back for the update (it returns the
    bytes freed, an int >= 0, and takes the memory again when it next generates)."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> RolloutBatch:
        """Sample one response per prompt (repeat prompts for several samples)."""
        ...

    def sync_weights(self) -> None:
        """Refresh the backend's weights from the training model after an update, in place."""
        ...


#: ``on_finished(indices, responses)``: prompt indices of finished samples and their response tokens
#: (up to and including the first EOS), reported while the rest of the rollout still decodes.
FinishedCallback = Callable[[list[int], list[list[int]]], None]


def reports_finished(backend: object) -> bool:
    """Whether ``backend.generate`` takes an ``on_finished`` callback (the engine does; HF ``generate`` does not)."""
    import inspect

    try:
        return "on_finished" in inspect.signature(backend.generate).parameters  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError):
        return False


def takes_limits(backend: object) -> bool:
    """Whether ``backend.generate`` takes each prompt's own token limit (``max_new_tokens``: the engine does)."""
    import inspect

    try:
        return "max_new_tokens" in inspect.signature(backend.generate).parameters  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError):
        return False


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for the work queued there: a copy from pageable memory
    would wait for it, so on CUDA it goes through pinned memory, asynchronously."""
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int,
             device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token-id lists into ``(ids [B, P], mask [B, P])``."""
    if len(prompts) == 0:
        raise ValueError("left_pad: no prompts given")
    width = max(len(p) for p in prompts)
    if width == 0:
        raise ValueError("left_pad: every prompt is empty")
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        if len(p):
            ids[i, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
            mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def mask_after_eos(response_ids: torch.Tensor, eos_token_ids: Sequence[int]) -> torch.Tensor:
    """``[B, R]`` mask that keeps tokens up to and including the first EOS."""
    if not eos_token_ids:
        return torch.ones_like(response_ids)
    is_eos = torch.zeros_like(response_ids, dtype=torch.bool)
    for e in eos_token_ids:
        is_eos |= response_ids == e
    # number of EOS strictly before position t
    before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    return (before == 0).long()


def slice_rollout(batch: RolloutBatch, start: int, stop: int) -> RolloutBatch:
    """Rows ``[start, stop)`` of ``batch``, without the padding columns no kept row needs.

    Shapes: ``[B, P]``/``[B, R]`` -> ``[stop - start, P']``/``[stop - start, R']``.
    """
    pm, rm = batch.prompt_mask[start:stop], batch.response_mask[start:stop]
    used = pm.bool().any(0).nonzero()
    p0 = int(used[0]) if len(used) else pm.shape[1] - 1
    used = rm.bool().any(0).nonzero()
    r1 = int(used[-1]) + 1 if len(used) else 1
    return RolloutBatch(prompt_ids=batch.prompt_ids[start:stop, p0:], prompt_mask=pm[:, p0:],
                        response_ids=batch.response_ids[start:stop, :r1], response_mask=rm[:, :r1],
                        logprobs=batch.logprobs[start:stop, :r1], stats=dict(batch.stats),
                        cut=None if batch.cut is None else batch.cut[start:stop])


def concat_batches(parts: Sequence[RolloutBatch], pad_token_id: int) -> RolloutBatch:
    """Join batches whose prompt/response widths differ (prompts re-left-padded, responses right-padded)."""
    if len(parts) == 1:
        return parts[0]
    p_width = max(b.prompt_ids.shape[1] for b in parts)
    r_width = max(b.response_ids.shape[1] for b in parts)

    def pad(t: torch.Tensor, width: int, value: float, left: bool) -> torch.Tensor:
        extra = width - t.shape[1]
        if extra == 0:
            return t
        filler = torch.full((t.shape[0], extra), value, dtype=t.dtype, device=t.device)
        return torch.cat([filler, t] if left else [t, filler], dim=1)

    stats: dict[str, float] = {}
    for b in parts:
        for k, v in b.stats.items():
            stats[k] = stats.get(k, 0.0) + v
    attention = None
    if any(b.response_attention is not None for b in parts):
        attention = torch.cat([pad(b.attention, r_width, 0, False) for b in parts])
    cut = None
    if any(b.cut is not None for b in parts):
        cut = torch.cat([b.cut if b.cut is not None else torch.zeros(b.batch_size, dtype=torch.bool,
                                                                    device=b.response_ids.device) for b in parts])
    return RolloutBatch(
        prompt_ids=torch.cat([pad(b.prompt_ids, p_width, pad_token_id, True) for b in parts]),
        prompt_mask=torch.cat([pad(b.prompt_mask, p_width, 0, True) for b in parts]),
        response_ids=torch.cat([pad(b.response_ids, r_width, pad_token_id, False) for b in parts]),
        response_mask=torch.cat([pad(b.response_mask, r_width, 0, False) for b in parts]),
        logprobs=torch.cat([pad(b.logprobs, r_width, 0.0, False) for b in parts]),
        stats=stats, response_attention=attention, cut=cut,
    )
