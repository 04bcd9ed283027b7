"""The paged KV cache's host side: which pages are free, who holds them, and how many there are.

The device holds one pool of pages, ``[layers, 2, pages, kv_heads, page_size, head_dim]``, and a
block table ``[slots, pages per slot]`` (int32): column ``c`` of slot ``s`` lives in page
``table[s, c // page_size]``, row ``c % page_size``. Page 0 is the *null page*: it is never handed
out, a table entry that points at it stands for columns that hold nothing of the slot (the left
padding of a prompt, the columns of a freed slot), which the key mask hides. Every other page
has a reference count: the samples of one prompt point at the same prompt pages (GRPO's ``n``),
and a page goes back to the free list when its last holder lets go.

:class:`PagePool` does this accounting on the host, so neither admission nor growth reads the
device; :func:`pool_pages` sizes the pool from the device's free memory.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

#: the default share of the device's free memory (when the engine is built) the page pool may take
KV_MEMORY_FRACTION = 0.5
#: the default page size in cache columns (a multiple of the attention kernel's blocks of 32 or 64)
PAGE_SIZE = 64
KV_CACHE_KINDS = ("paged", "static")


class PagePool:
    """Free list and reference counts of ``pages`` pages (page 0, the null page, excluded)."""

    def __init__(self, pages: int):
        if pages < 2:
            raise ValueError(f"PagePool: needs at least 2 pages (one is the null page), got {pages}")
        self.pages = int(pages)
        self.refs = [0] * self.pages
        self.free_list = list(range(self.pages - 1, 0, -1))  # pop() hands out low page numbers first
        self.peak = 0

    @property
    def free(self) -> int:
        return len(self.free_list)

    @property
    def used(self) -> int:
        return self.pages - 1 - len(self.free_list)

    def take(self, count: int) -> list[int]:
        """``count`` fresh pages (reference count 1 each); ``MemoryError`` if fewer are free."""
        if count > len(self.free_list):
            raise MemoryError(f"KV page pool: {count} pages wanted, {len(self.free_list)} free")
        out = [self.free_list.pop() for _ in range(count)]
        for page in out:
            self.refs[page] = 1
        self.peak = max(self.peak, self.used)
        return out

    def share(self, page: int) -> None:
        """One more holder of ``page`` (the null page is not counted)."""
        if page:
            self.refs[page] += 1

    def drop(self, pages) -> None:
        """Each of ``pages`` loses a holder; those left without one are free again."""
        for page in pages:
            if not page:
                continue
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self.free_list.append(page)
            elif self.refs[page] < 0:
                raise RuntimeError(f"KV page pool: page {page} released more often than taken")


def page_bytes(num_layers: int, kv_heads: int, page_size: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one page: keys and values of ``page_size`` columns in every layer."""
    return num_layers * 2 * kv_heads * page_size * head_dim * torch.empty(0, dtype=dtype).element_size()


def pool_pages(*, slots: int, max_seq_len: int, page_size: int, bytes_per_page: int, device: torch.device,
               kv_pages: int | None, fraction: float, free_bytes: int | None = None, reserve_bytes: int = 0) -> int:
    """Pages in the pool (the null page included).

    ``kv_pages`` when given; otherwise enough for every slot at ``max_seq_len`` (plus one page a slot
    of slack, so admission never waits for pages at this size), capped on CUDA at ``fraction`` of the
    device's free memory (``free_bytes``, default read from the device) less ``reserve_bytes`` (memory
    that work after the rollout will still take, such as gradients and optimizer moments not yet
    allocated). Raises ``ValueError`` when the pool would not hold one sequence of ``max_seq_len`` columns."""
    per_slot = -(-max_seq_len // page_size)
    worst = slots * (per_slot + 1) + 1
    least = per_slot + 2
    if kv_pages is not None:
        pages = int(kv_pages)
        if pages < least:
            raise ValueError(f"RolloutEngine: kv_pages {pages} cannot hold one sequence of max_seq_len "
                             f"{max_seq_len} ({least} pages of {page_size} columns with the null page)")
        return pages
    if device.type != "cuda" and free_bytes is None:
        return worst
    if free_bytes is None:
        free_bytes, _total = torch.cuda.mem_get_info(device)
    available = max(int(free_bytes) - max(int(reserve_bytes), 0), 0)
    budget = int(available * fraction) // bytes_per_page
    pages = min(worst, budget)
    if pages < least:
        raised = f" less {reserve_bytes / 2**30:.2f} GiB kept for the update" if reserve_bytes > 0 else ""
        raise ValueError(f"RolloutEngine: kv_memory_fraction {fraction} of the free {free_bytes / 2**30:.2f} GiB{raised} "
                         f"holds {budget} KV pages of {bytes_per_page / 2**20:.1f} MiB, fewer than one sequence "
                         f"of max_seq_len {max_seq_len} needs ({least}); raise kv_memory_fraction or lower "
                         f"max_seq_len")
    if pages < worst:
        log.info("rollout engine: KV page pool of %d pages (%.2f GiB, %.0f%% of %.2f GiB free less %.2f GiB kept for "
                 "the update) for %d slots x %d columns (%d pages at worst): admission follows free pages", pages,
                 pages * bytes_per_page / 2**30, 100 * fraction, free_bytes / 2**30, max(reserve_bytes, 0) / 2**30,
                 slots, max_seq_len, worst)
    return pages
