"""Token sampling on the device: greedy, temperature, top-k and top-p, with seeded generators.

Pure functions over a batch of next-token logits. The returned log-probabilities are always
those of the *unfiltered* distribution ``log_softmax(logits / temperature)`` (temperature 1 when
greedy), which is what a trainer recomputes by teacher forcing. Filtering (top-k, top-p) only
decides which token is drawn.

Sampling uses the exponential-race form of the Gumbel-max trick: ``argmax(z - log(E))`` with
``E ~ Exp(1)`` draws index ``i`` with probability ``softmax(z)_i``. It needs one random tensor and
no normalisation, and runs without any host synchronisation.
"""

from __future__ import annotations

import logging
import random

import torch

from rlcore.kernels import fused_sampling
from rlcore.rlmath import logprobs_from_logits
from rlcore.rollout.base import SamplingParams

log = logging.getLogger(__name__)
_FUSED_OK: dict[str, bool] = {}


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed`` (a fresh seed drawn from torch when ``None``)."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed))
    return gen


def validate_params(params: SamplingParams, vocab_size: int | None = None) -> None:
    """Raise ``ValueError`` naming the field when ``params`` cannot be honoured."""
    if params.max_new_tokens < 1:
        raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {params.max_new_tokens}")
    if params.top_k < 0:
        raise ValueError(f"SamplingParams.top_k must be >= 0, got {params.top_k}")
    if not 0.0 < params.top_p <= 1.0:
        raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {params.top_p}")
    if params.stop_at_rows < 0:
        raise ValueError(f"SamplingParams.stop_at_rows must be >= 0 (0 = off), got {params.stop_at_rows}")
    if vocab_size is not None:
        bad = [e for e in params.eos_token_ids if not 0 <= e < vocab_size]
        if bad:
            raise ValueError(f"SamplingParams.eos_token_ids {bad} are outside the vocabulary (size {vocab_size})")


def filter_top_k_top_p(scores: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the top-k, then the top-p nucleus, of each row.

    Args:
        scores: ``[B, V]`` temperature-scaled logits (float32).
    Returns:
        ``(kept [B, K], index [B, K])``: candidate scores in descending order with filtered
        entries set to ``-inf``, and their vocabulary indices. ``K = top_k`` when top-k is on,
        else ``V``. The first candidate of each row is always kept.
    """
    vocab = scores.shape[-1]
    if top_k > 0:
        kept, index = torch.topk(scores, min(top_k, vocab), dim=-1)
    else:
        kept, index = torch.sort(scores, dim=-1, descending=True)
    if top_p < 1.0:
        probs = torch.softmax(kept, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop = mass_before >= top_p
        drop[:, 0] = False
        kept = kept.masked_fill(drop, float("-inf"))
    return kept, index


def sample_next(logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row.

    Args:
        logits: ``[B, V]`` raw next-token logits (any float dtype; computed in float32).
        params: temperature / top-k / top-p; greedy when ``temperature <= 0``.
        generator: random source on ``logits.device`` (unused when greedy).
    Returns:
        ``(tokens [B] int64, logprobs [B] float32)`` where ``logprobs`` are the sampled tokens'
        log-probabilities under ``log_softmax(logits / temperature)``.
    """
    scores = logits.float()
    if params.greedy:
        tokens = torch.argmax(scores, dim=-1)
    else:
        if params.temperature != 1.0:
            scores = scores / params.temperature
        if params.top_k > 0 or params.top_p < 1.0:
            kept, index = filter_top_k_top_p(scores, params.top_k, params.top_p)
            noise = torch.empty_like(kept).exponential_(generator=generator)
            choice = torch.argmax(kept - noise.log_(), dim=-1, keepdim=True)
            tokens = index.gather(-1, choice).squeeze(-1)
        else:
            noise = torch.empty_like(scores).exponential_(generator=generator)
            tokens = torch.argmax(scores - noise.log_(), dim=-1)
    picked = scores.gather(-1, tokens[:, None]).squeeze(-1)
    logprobs = picked - torch.logsumexp(scores, dim=-1)
    return tokens, logprobs


_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift / multiply rounds) of ``x`` (int64 holding values below 2^32;
    the multipliers stay below 2^31 so no product overflows)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK32
    return x ^ (x >> 16)


def keyed_uniforms(seed: int, keys: torch.Tensor) -> torch.Tensor:
    """``[n]`` float32 uniforms in ``[0, 1)``, each a function of ``seed`` and its row's ``key`` only
    (int64 >= 0), computed on ``keys``' device: a draw keyed by what it is for (a request and a
    response column) comes out the same whatever rows and steps the sequence was decoded in."""
    keys = keys.long()
    x = _mix32((keys & _MASK32) ^ (int(seed) & _MASK32))
    x = _mix32(x ^ ((keys >> 32) & _MASK32) ^ ((int(seed) >> 32) & _MASK32))
    return (x >> 8).float() * (1.0 / (1 << 24))


def sample_keyed(logits: torch.Tensor, params: SamplingParams,
                 uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample_next` by inverse CDF with one given uniform per row (``[B]``, see
    :func:`keyed_uniforms`) instead of noise from a generator: the token whose cumulative
    probability (over the top-k / top-p candidates when filtering) first passes it."""
    if params.greedy:
        return sample_next(logits, params, None)
    scores = logits.float()
    if params.temperature != 1.0:
        scores = scores / params.temperature
    if params.top_k > 0 or params.top_p < 1.0:
        kept, index = filter_top_k_top_p(scores, params.top_k, params.top_p)
    else:
        kept, index = scores, None
    probs = torch.softmax(kept, dim=-1)
    cdf = probs.cumsum(-1)
    choice = torch.searchsorted(cdf, (uniforms.float() * cdf[:, -1])[:, None], right=True)
    # rounding: past the last candidate with any probability, take that one
    last = torch.where(probs > 0, torch.arange(probs.shape[-1], device=probs.device), 0).amax(-1, keepdim=True)
    choice = torch.minimum(choice, last)
    tokens = (choice if index is None else index.gather(-1, choice)).squeeze(-1)
    picked = scores.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, picked - torch.logsumexp(scores, dim=-1)


def _fused_self_check(device: torch.device) -> bool:
    """Run the fused kernel once against :func:`sample_next`; remember the verdict per device."""
    key = str(device)
    if key not in _FUSED_OK:
        try:
            logits = torch.randn(3, 5000, device=device) * 4
            tokens, logprobs = fused_sampling.sample_rows(logits, 0.0, 0)
            ref_tokens, ref_logprobs = sample_next(logits, SamplingParams(temperature=0.0), None)
            drawn, drawn_lp = fused_sampling.sample_rows(logits, 0.7, 1)
            ok = (torch.equal(tokens, ref_tokens) and torch.allclose(logprobs, ref_logprobs, atol=1e-3)
                  and torch.allclose(drawn_lp, logprobs_from_logits(logits, drawn, 0.7), atol=1e-3))
            if not ok:
                log.warning("fused sampler disagrees with the PyTorch sampler on %s; not using it", device)
        except Exception as error:  # noqa: BLE001 - any failure means: use the PyTorch path
            log.warning("fused sampler unavailable on %s (%s); using the PyTorch sampler", device, error)
            ok = False
        _FUSED_OK[key] = bool(ok)
    return _FUSED_OK[key]


class Sampler:
    """Per-call sampler: seeded device generator plus, for the one-pass CUDA kernel, a seeded
    host stream of per-step seeds (so no step waits for the device)."""

    def __init__(self, params: SamplingParams, device: torch.device | str, *, fused: bool = True):
        self.params = params
        self.device = torch.device(device)
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        self.seed = seed
        self.generator = make_generator(seed, self.device)
        self.host = random.Random(seed)
        plain = params.top_k == 0 and params.top_p >= 1.0
        self.fused = bool(fused and plain and fused_sampling.available(self.device)
                          and _fused_self_check(self.device))

    def __call__(self, logits: torch.Tensor, keys: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, V]`` logits -> ``(tokens [B], logprobs [B])`` as :func:`sample_next` defines them.

        ``keys`` (``[B]`` int64): draw each row with the uniform :func:`keyed_uniforms` gives its key
        (inverse CDF), so that a row's token does not depend on the other rows or on earlier calls."""
        if keys is not None and not self.params.greedy:
            if self.fused:  # the key hash inside the kernel
                return fused_sampling.sample_rows(logits, self.params.temperature, 0, keys=keys, key_seed=self.seed)
            return sample_keyed(logits, self.params, keyed_uniforms(self.seed, keys))
        if self.fused:
            temperature = 0.0 if self.params.greedy else self.params.temperature
            return fused_sampling.sample_rows(logits, temperature, self.host.getrandbits(31))
        return sample_next(logits, self.params, self.generator)
