"""``ppo.rollout_batch_size=auto``: size the rollout batch from free GPU memory, and survive OOM.

The starting rule is the classic one: ``batch ≈ GPU memory × 0.6 ÷ memory per sample``, with
the *free* memory of the device (so colocated models are accounted for) and a per-sample figure
that is either measured (:func:`measure_sample_bytes`, peak-memory slope between two probe
batches) or estimated from the model config (:func:`estimate_sample_bytes`). If generation still
runs out of memory, :class:`~rlcore.trainer.generation.ActorGeneration` halves the micro-batch
and retries the failed chunk, so no sample is lost, and keeps the smaller size for later calls.

On CPU there is no device memory to read: :func:`auto_rollout_batch_size` plans
:data:`CPU_DEFAULT_BATCH_SIZE` (16) samples, i.e. ``16 // n`` prompts of ``n`` samples (at least
one), enough for the CPU demo and tests, small enough to keep a 2-core machine responsive.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from rlcore.observe import peak
from rlcore.shape import decoder_shape

log = logging.getLogger(__name__)

CPU_DEFAULT_BATCH_SIZE = 16
MEMORY_FRACTION = 0.6


def estimate_sample_bytes(config, seq_len: int, *, dtype_bytes: int = 2, prompt_len: int | None = None) -> int:
    """Generation memory of one sample, from a decoder config.

    KV cache ``2 · layers · kv_heads · head_dim · seq_len · dtype_bytes``, plus float32 logits and
    the sampler's two vocabulary-sized temporaries, plus the prefill activations of the prompt
    (residual, q/k/v and the gated MLP's two intermediate tensors per token).
    """
    shape = decoder_shape(config)
    if shape.missing():
        raise ValueError(f"cannot estimate the generation memory of a sample: the model config has no "
                         f"{', '.join(shape.missing())}")
    prompt = seq_len if prompt_len is None else prompt_len
    kv = 2 * shape.layers * shape.kv * seq_len * dtype_bytes
    logits = 3 * shape.vocab * 4
    activations = prompt * (4 * shape.hidden + 2 * shape.inter) * dtype_bytes
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
        with peak.window(dev) as measured:  # the run's peak is kept
            run(batch)
            torch.cuda.synchronize(dev)
        peaks.append(measured.above_base)
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
