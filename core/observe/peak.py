"""Peak device memory over a window of work, without losing the run's peak.

PyTorch keeps one peak-allocated figure per CUDA device; measuring the peak of one piece of work
(a micro-batch's forward and backward, a weight switch) means resetting it, which would lose the
peak reached before. :func:`window` carries that earlier peak here, and :func:`max_allocated`
reports the larger of the two, so ``memory/peak_gb`` stays the peak since the run began however
many windows were measured in between. Off CUDA there is no allocator to read: the window's
figures stay ``None``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

#: per CUDA device index, the largest peak seen before the last reset by :func:`window`
_carried: dict[int, int] = {}


def _cuda(device: torch.device | str) -> Optional[torch.device]:
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())


def max_allocated(device: torch.device | str) -> int:
    """Peak bytes allocated on ``device`` since the run began (0 off CUDA), windows included."""
    dev = _cuda(device)
    if dev is None:
        return 0
    return max(int(torch.cuda.max_memory_allocated(dev)), _carried.get(dev.index, 0))


@dataclass
class Window:
    """What :func:`window` measured: bytes allocated at its start, and the peak inside it."""

    base: Optional[int] = None
    peak: Optional[int] = None

    @property
    def above_base(self) -> Optional[int]:
        """Bytes the window's work added at its peak (``None`` off CUDA)."""
        return None if self.base is None or self.peak is None else max(0, self.peak - self.base)


@contextlib.contextmanager
def window(device: torch.device | str) -> Iterator[Window]:
    """Measure the peak allocation of the work inside; the run's peak is kept (:func:`max_allocated`).

    Reads the caching allocator's host-side figures only: no device synchronisation."""
    out = Window()
    dev = _cuda(device)
    if dev is None:
        yield out
        return
    _carried[dev.index] = max_allocated(dev)
    out.base = int(torch.cuda.memory_allocated(dev))
    torch.cuda.reset_peak_memory_stats(dev)
    try:
        yield out
    finally:
        out.peak = int(torch.cuda.max_memory_allocated(dev))
