"""The rollout engine's settings: argument checks and the batch and attention-length buckets."""

from __future__ import annotations

from rlcore.rollout.engine import decode, pages


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
