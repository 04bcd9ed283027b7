"""The rollout engine's settings: argument checks, the batch and attention-length buckets, and the
choices made from the device (the attention kernel, the decode step's split products)."""

from __future__ import annotations

import logging

import torch

from rlcore.kernels import decode_attention
from rlcore.rollout.engine import decode, pages

log = logging.getLogger(__name__)


def _check_attention(value) -> None:
    if value != "auto" and value not in decode.ATTENTION_KINDS:
        raise ValueError(f"RolloutEngine: attention {value!r} is not one of {('auto',) + tuple(decode.ATTENTION_KINDS)}")


def _check_compile_mode(value) -> None:
    if value not in decode.COMPILE_MODES:
        raise ValueError(f"RolloutEngine: compile_mode {value!r} is not one of {decode.COMPILE_MODES}")


def _check_mlp_transposed(value) -> None:
    if value != "auto" and not isinstance(value, bool):
        raise ValueError(f"RolloutEngine: mlp_transposed must be 'auto', True or False, got {value!r}")


def _check_kv_cache(value) -> None:
    if value not in pages.KV_CACHE_KINDS:
        raise ValueError(f"RolloutEngine: kv_cache {value!r} is not one of {pages.KV_CACHE_KINDS}")


def check_page_size(value) -> None:
    """``page_size``: a power of two >= 16 (a multiple of the attention kernel's column block)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value & (value - 1):
        raise ValueError(f"RolloutEngine: page_size must be a power of two >= 16, got {value!r}")


def _check_kv_pages(value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 2):
        raise ValueError(f"RolloutEngine: kv_pages must be null or an integer >= 2, got {value!r}")


def _check_kv_memory_fraction(value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"RolloutEngine: kv_memory_fraction must be in (0, 1], got {value!r}")


DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
#: batch buckets of at most this many rows are a rollout's tail: they count as ``rollout/tail_steps`` and
#: decode with the engine's ``split_k_few_rows``
FEW_ROWS = 8


def length_step(max_seq_len: int) -> int:
    """Granularity of the attention-length buckets: 64 columns, coarser for long caches (at most
    about 16 buckets above 1024 columns)."""
    step = 64
    while max_seq_len > 16 * step and step < 4096:
        step *= 2
    return step


def check_settings(max_batch_size: int, max_seq_len: int, attention: str, compile_mode: str, mlp_transposed,
                   kv_cache: str, page_size: int, kv_pages, kv_memory_fraction: float) -> None:
    """:class:`RolloutEngine`'s arguments checked before anything is built.

    :raises ValueError: naming the argument."""
    if max_batch_size < 1:
        raise ValueError(f"RolloutEngine: max_batch_size must be >= 1, got {max_batch_size}")
    if max_seq_len < 2:
        raise ValueError(f"RolloutEngine: max_seq_len must be >= 2, got {max_seq_len}")
    _check_attention(attention)
    _check_compile_mode(compile_mode)
    _check_mlp_transposed(mlp_transposed)
    _check_kv_cache(kv_cache)
    check_page_size(page_size)
    _check_kv_pages(kv_pages)
    _check_kv_memory_fraction(kv_memory_fraction)


def check_limits(limits, prompts: int, most: int, episodes: bool) -> None:
    """Check ``RolloutEngine.generate``'s per-prompt ``max_new_tokens``: one per prompt, each from 1 to
    ``most`` (``params.max_new_tokens``), and single-turn prompts only (``episodes``: some carry one).

    :raises ValueError: naming the first limit out of range."""
    if episodes:
        raise ValueError("RolloutEngine.generate: per-prompt max_new_tokens is for single-turn prompts; an "
                         "episode's budget is its environment's max_tokens")
    limits = [int(v) for v in limits]
    if len(limits) != prompts:
        raise ValueError(f"RolloutEngine.generate: {len(limits)} max_new_tokens for {prompts} prompts")
    bad = next((i for i, v in enumerate(limits) if not 1 <= v <= most), None)
    if bad is not None:
        raise ValueError(f"RolloutEngine.generate: max_new_tokens[{bad}] = {limits[bad]} is outside "
                         f"1..{most} (params.max_new_tokens)")


def choose_attention(attention: str, device: torch.device, dtype: torch.dtype, spec, tuning: dict,
                     page_size: int | None) -> str:
    """``attention``, or ``"sdpa"`` when the Triton kernel cannot run here or fails its check
    (``"auto"`` picks the kernel where it runs, quietly ``"sdpa"`` off CUDA). ``spec``: the model's
    :class:`~rlcore.rollout.engine.llama.DecoderSpec`; ``tuning``: the checked ``attention_tuning``;
    ``page_size``: the paged cache's (``None``: a static cache).

    :raises ValueError: a tuning or page size that cannot work for this model (an error, not a fallback)."""
    if attention not in ("triton", "auto"):
        return attention
    if attention == "auto" and device.type != "cuda":
        return "sdpa"
    if "subblocks" in tuning:
        try:
            decode_attention.check_subblocks(tuning["subblocks"], tuning.get("block_n"), spec.head_dim)
        except ValueError as error:
            raise ValueError(f"RolloutEngine: attention_tuning['subblocks']: {error}") from None
    settings = {key: tuning[key] for key in ("block_n", "num_warps", "num_stages", "subblocks") if key in tuning}
    block = tuning.get("block_n") or decode_attention.default_block(spec.head_dim)
    if page_size is not None and page_size % block:
        raise ValueError(f"RolloutEngine: page_size {page_size} is not a multiple of the attention kernel's "
                         f"block of {block} columns (attention_tuning['block_n'])")
    ok, reason = decode_attention.usable(device, dtype, spec.num_kv_heads, spec.num_heads // spec.num_kv_heads,
                                         spec.head_dim, settings, page_size)
    if ok:
        return "triton"
    log.warning("rollout engine: attention 'triton' unavailable (%s); using 'sdpa'", reason)
    return "sdpa"


def choose_products(split_k, mlp_transposed, compiled: bool, device: torch.device) -> tuple[tuple[int, ...], bool]:
    """``(split_k tuple, mlp_transposed)`` with ``"auto"`` resolved: both on for a step compiled on CUDA
    (:data:`rlcore.rollout.engine.decode.AUTO_SPLIT_K`), off otherwise. With split products, checks once
    whether their partials can stay float32 (:func:`rlcore.rollout.engine.decode.probe_float32_partials`)."""
    on = compiled and device.type == "cuda"
    if split_k == "auto":
        split_k = decode.AUTO_SPLIT_K if on else None
    split = decode.split_k_tuple(split_k)
    if any(k > 1 for k in split):
        decode.probe_float32_partials(device)
    return split, on if mlp_transposed == "auto" else mlp_transposed
