"""Rollout through Hugging Face ``generate``: works for any causal LM, used as the fallback.

It runs the live training model (no copy, so :meth:`HFGenerateBackend.sync_weights` has nothing
to do), left pads prompts, and computes the sampled tokens' log-probabilities from the *raw*
logits (``output_logits``), not from the processed scores that temperature / top-k / top-p
warpers produce, so they equal a teacher-forced ``log_softmax(logits / temperature)``.

Memory note: raw logits are kept for every step (``B x R x V`` float32) until the log-probs are
gathered; the engine (:mod:`rlcore.rollout.engine`) does not have this cost.
"""

from __future__ import annotations

import contextlib
import time
from typing import Sequence

import torch

from rlcore.rollout.base import RolloutBatch, SamplingParams, left_pad, mask_after_eos
from rlcore.rlmath import logprobs_from_logits
from rlcore.rollout.sampling import validate_params


@contextlib.contextmanager
def _eval_mode(model):
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@contextlib.contextmanager
def _no_model_eos(model):
    """Hide the model's default EOS ids: generate() fills unset fields from them."""
    config = getattr(model, "generation_config", None)
    saved = getattr(config, "eos_token_id", None)
    if config is not None:
        config.eos_token_id = None
    try:
        yield
    finally:
        if config is not None:
            config.eos_token_id = saved


@contextlib.contextmanager
def _seeded(seed: int | None, device: torch.device):
    """Seed torch's global generators for the block, restoring their state afterwards."""
    if seed is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(int(seed))
        yield


def generation_config(params: SamplingParams):
    """A ``GenerationConfig`` for ``params`` (EOS ids only from ``params``, see :func:`_no_model_eos`)."""
    from transformers import GenerationConfig

    eos = list(params.eos_token_ids) or None
    kwargs = dict(max_new_tokens=params.max_new_tokens, min_new_tokens=0, eos_token_id=eos,
                  pad_token_id=params.pad_token_id, return_dict_in_generate=True, output_logits=True,
                  num_beams=1, use_cache=True)
    if params.greedy:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:  # explicit values: generate() replaces None with the model's / library defaults (top_k=50)
        kwargs.update(do_sample=True, temperature=float(params.temperature), top_p=float(params.top_p),
                      top_k=int(params.top_k))
    return GenerationConfig(**kwargs)


class HFGenerateBackend:
    """:class:`~rlcore.rollout.base.RolloutBackend` over ``model.generate``.

    Args:
        model: any HF causal LM with ``generate``.
        device: where prompts are placed (default: the model's device).
    """

    #: prompts carrying an episode are played turn by turn (:func:`rlcore.rollout.turns.play_episodes`)
    supports_episodes = True

    def __init__(self, model, *, device: torch.device | str | None = None):
        if not hasattr(model, "generate"):
            raise ValueError(f"HFGenerateBackend: {type(model).__name__} has no generate()")
        self.model = model
        self.device = torch.device(device) if device is not None else next(model.parameters()).device

    def sync_weights(self) -> None:
        """Nothing to do: ``generate`` runs the live model."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> RolloutBatch:
        """Sample one response per prompt (see :class:`~rlcore.rollout.base.RolloutBackend`).
        Prompts that carry an episode (:class:`rlcore.envs.runner.EpisodePrompt`) are played turn
        by turn (:func:`rlcore.rollout.turns.play_episodes`)."""
        from rlcore.rollout.turns import play_episodes

        return play_episodes(self._generate, prompts, params, self.device)

    @torch.no_grad()
    def _generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> RolloutBatch:
        vocab = getattr(self.model.config, "vocab_size", None)
        validate_params(params, vocab)
        start = time.perf_counter()
        ids, mask = left_pad(prompts, params.pad_token_id, self.device)
        config = generation_config(params)
        with _eval_mode(self.model), _no_model_eos(self.model), _seeded(params.seed, self.device):
            out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        response = out.sequences[:, ids.shape[1]:]
        temperature = 1.0 if params.greedy else params.temperature
        logprobs = torch.stack([logprobs_from_logits(step, response[:, t], temperature)
                                for t, step in enumerate(out.logits)], dim=1)  # raw logits, [B, R]
        del out
        response_mask = mask_after_eos(response, params.eos_token_ids)
        response = response.masked_fill(response_mask == 0, params.pad_token_id)
        stats = {"rollout/seconds": time.perf_counter() - start,
                 "rollout/new_tokens": float(response_mask.sum().item())}
        return RolloutBatch(prompt_ids=ids, prompt_mask=mask, response_ids=response, response_mask=response_mask,
                            logprobs=logprobs * response_mask, stats=stats)
