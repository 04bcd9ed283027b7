"""``ppo.rollout_batch_size=auto``: size the rollout batch from free GPU memory, and survive OOM.

The starting rule is the classic one: ``batch ≈ GPU memory × 0.6 ÷ memory per sample``, with
the *free* memory of the device (so colocated models are accounted for) and a per-sample figure
that is either measured (:func:`measure_sample_bytes`, peak-memory slope between two probe
batches) or estimated from the model config (:func:`estimate_sample_bytes`). If generation still
runs out of memory, :class:`AdaptiveMicroBatch` halves the micro-batch and retries the failed
chunk, so no sample is lost, and keeps the smaller size for later calls.

On CPU there is no device memory to read: :func:`auto_rollout_batch_size` plans
:data:`CPU_DEFAULT_BATCH_SIZE` (16) samples, i.e. ``16 // n`` prompts of ``n`` samples (at least
one), enough for the CPU demo and tests, small enough to keep a 2-core machine responsive.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Optional, Sequence

import torch

from rlcore.rollout.base import RolloutBatch, SamplingParams, concat_batches

log = logging.getLogger(__name__)

CPU_DEFAULT_BATCH_SIZE = 16
MEMORY_FRACTION = 0.6


def estimate_sample_bytes(config, seq_len: int, *, dtype_bytes: int = 2, prompt_len: int | None = None) -> int:
    """Generation memory of one sample, from a decoder config.

    KV cache ``2 · layers · kv_heads · head_dim · seq_len · dtype_bytes``, plus float32 logits and
    the sampler's two vocabulary-sized temporaries, plus the prefill activations of the prompt
    (residual, q/k/v and the gated MLP's two intermediate tensors per token).
    """
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer")
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd")
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head")
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    inter = getattr(config, "intermediate_size", None) or 4 * hidden
    vocab = config.vocab_size
    prompt = seq_len if prompt_len is None else prompt_len
    kv = 2 * layers * kv_heads * head_dim * seq_len * dtype_bytes
    logits = 3 * vocab * 4
    activations = prompt * (4 * hidden + 2 * inter) * dtype_bytes
    return int(kv + logits + activations)


def measure_sample_bytes(run: Callable[[int], object], *, probe: tuple[int, int] = (1, 4),
                         device: torch.device | str | None = None) -> int:
    """Measured generation memory per sample: the peak-allocation slope between two probe batches.

    Args:
        run: ``run(batch_size)`` generates a batch of that many samples (same lengths as in training).
        probe: the two batch sizes to compare.
    Raises:
        ValueError: not on a CUDA device (there is nothing to measure).
    """
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise ValueError("measure_sample_bytes: needs a CUDA device")
    peaks = []
    for batch in probe:
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        run(batch)
        torch.cuda.synchronize(dev)
        peaks.append(torch.cuda.max_memory_allocated(dev) - base)
    slope = (peaks[1] - peaks[0]) / max(1, probe[1] - probe[0])
    return max(1, int(slope))


def _round(value: int, multiple_of: int, minimum: int, maximum: int | None) -> int:
    value = max(minimum, value)
    if maximum is not None:
        value = min(maximum, value)
    if multiple_of > 1:
        value = max(multiple_of, value - value % multiple_of)
    return int(value)


def _sample_bytes(sample_bytes: int | None, config, model_path: str | None, max_len: int | None,
                  dtype_bytes: int) -> int:
    if sample_bytes is not None:
        if sample_bytes <= 0:
            raise ValueError(f"auto_rollout_batch_size: sample_bytes must be > 0, got {sample_bytes}")
        return int(sample_bytes)
    if config is None and model_path is not None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_path)
    if config is None or not max_len:
        raise ValueError("auto_rollout_batch_size: give sample_bytes, or a model config / model_path and max_len")
    return estimate_sample_bytes(config, int(max_len), dtype_bytes=dtype_bytes)


def auto_rollout_batch_size(*, device: torch.device | str | None = None, n: int = 1, sample_bytes: int | None = None,
                            model_path: str | None = None, config=None, max_len: int | None = None,
                            dtype_bytes: int = 2, free_bytes: int | None = None, fraction: float = MEMORY_FRACTION,
                            multiple_of: int = 1, minimum: int = 1, maximum: int | None = None) -> int:
    """Prompts per rollout, each sampled ``n`` times: ``free memory × fraction ÷ sample bytes ÷ n``.

    Args:
        device: the generation device; CPU (or no CUDA) gives ``CPU_DEFAULT_BATCH_SIZE // n`` (at least 1).
        n: samples per prompt.
        sample_bytes: generation memory of one sample (e.g. from :func:`measure_sample_bytes`);
            otherwise estimated by :func:`estimate_sample_bytes` from ``config`` (or the config
            at ``model_path``) and ``max_len`` (prompt + new tokens) at ``dtype_bytes``.
        free_bytes: free device memory (default: read from the device).
        fraction: share of the free memory generation may take.
        multiple_of, minimum, maximum: round down to a multiple, then clamp (in prompts).
    """
    if n < 1:
        raise ValueError(f"auto_rollout_batch_size: n must be >= 1, got {n}")
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"auto_rollout_batch_size: fraction must be in (0, 1], got {fraction}")
    dev = torch.device(device) if device is not None else None
    on_gpu = free_bytes is not None or (dev is not None and dev.type == "cuda" and torch.cuda.is_available())
    if not on_gpu:
        size = _round(max(1, CPU_DEFAULT_BATCH_SIZE // n), multiple_of, minimum, maximum)
        log.info("ppo.rollout_batch_size=auto on CPU -> %d prompts x %d samples (fixed default)", size, n)
        return size
    per_sample = _sample_bytes(sample_bytes, config, model_path, max_len, dtype_bytes)
    if free_bytes is None:
        free_bytes, _total = torch.cuda.mem_get_info(dev)
    raw = int(free_bytes * fraction // per_sample) // n
    size = _round(raw, multiple_of, minimum, maximum)
    log.info("ppo.rollout_batch_size=auto -> %d prompts x %d samples (free %.1f GiB x %.2f / %.1f MiB per sample)",
             size, n, free_bytes / 2**30, fraction, per_sample / 2**20)
    return size


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def _shifted(on_finished: Callable, offset: int) -> Callable:
    return lambda indices, responses: on_finished([offset + i for i in indices], responses)


class AdaptiveMicroBatch:
    """Generate in micro-batches, halving the micro-batch on out-of-memory.

    The chunk that failed is retried at half the size (down to ``minimum``), so every prompt gets
    its sample; the reduced size is kept for later calls. Seeded runs give each chunk its own seed
    (``seed + first prompt index``) so repeated prompts in different chunks do not share noise.
    """

    def __init__(self, micro_batch: int, *, minimum: int = 1):
        if micro_batch < 1 or minimum < 1:
            raise ValueError(f"AdaptiveMicroBatch: micro_batch ({micro_batch}) and minimum ({minimum}) must be >= 1")
        self.micro_batch = int(micro_batch)
        self.minimum = int(minimum)
        self.retries = 0

    def generate(self, generate: Callable[..., RolloutBatch], prompts: Sequence[Sequence[int]],
                 params: SamplingParams, on_finished: Optional[Callable] = None) -> RolloutBatch:
        """Run ``generate`` over all ``prompts`` chunk by chunk; results keep the prompts' order.

        ``on_finished`` (see :data:`rlcore.rollout.base.FinishedCallback`) is handed to each chunk's
        ``generate`` with the chunk's indices shifted to the whole list's; a chunk retried after an
        out-of-memory error may report samples again."""
        parts: list[RolloutBatch] = []
        start = 0
        while start < len(prompts):
            size = min(self.micro_batch, len(prompts) - start)
            chunk_params = params if params.seed is None else dataclasses.replace(params, seed=params.seed + start)
            kw = {} if on_finished is None else {"on_finished": _shifted(on_finished, start)}
            try:
                parts.append(generate(prompts[start:start + size], chunk_params, **kw))
            except (torch.OutOfMemoryError, RuntimeError) as error:
                if not _is_oom(error) or self.micro_batch <= self.minimum:
                    raise
                self.micro_batch = max(self.minimum, self.micro_batch // 2)
                self.retries += 1
                log.warning("rollout out of memory at micro-batch %d; retrying at %d", size, self.micro_batch)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                continue
            start += size
        return concat_batches(parts, params.pad_token_id)
