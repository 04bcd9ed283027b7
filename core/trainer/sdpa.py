"""``trainer.sdpa_backends``: the scaled-dot-product attention kernels PyTorch may pick for the run's
CUDA forwards (the training forwards under ``attn_implementation=sdpa``, the engine's prefill).

PyTorch chooses among its SDPA kernels per call (``flash``, ``efficient``, ``cudnn``, ``math``); this
setting leaves only the named ones switched on (``torch.backends.cuda.enable_*_sdp``) for as long as
the run lasts and restores the previous switches when it ends. The switches are process-wide and
read again by every call, so a checkpointed layer's recomputation in the backward picks the same
kernel as its forward did.

The reason to choose: a training update meets new shapes all the time (micro-batches of new widths
and row counts every step), and a kernel that prepares a plan per shape (cuDNN builds an execution
graph for each new forward and backward shape) pays it on the host while the device waits
(``bench/probes/sdpa_shapes.py`` measures it per kernel).
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch

log = logging.getLogger(__name__)

#: name -> the torch.backends.cuda switch (getter, setter) of that kernel
SWITCHES = {
    "flash": ("flash_sdp_enabled", "enable_flash_sdp"),
    "efficient": ("mem_efficient_sdp_enabled", "enable_mem_efficient_sdp"),
    "cudnn": ("cudnn_sdp_enabled", "enable_cudnn_sdp"),
    "math": ("math_sdp_enabled", "enable_math_sdp"),
}


def problem(value: Any) -> Optional[str]:
    """Why ``value`` is not a valid ``trainer.sdpa_backends`` (None when it is)."""
    if value is None:
        return None
    names = [] if isinstance(value, str) or not hasattr(value, "__iter__") else list(value)
    if not names:
        return f"must be null or a non-empty list of {', '.join(SWITCHES)}, got {value!r}"
    unknown = [n for n in names if n not in SWITCHES]
    if unknown:
        return f"unknown SDPA kernel(s) {', '.join(map(repr, unknown))} (known: {', '.join(SWITCHES)})"
    return None


class SdpaSwitches:
    """The kernel switches as a run set them; :meth:`close` puts back the ones found (once)."""

    def __init__(self, names: Sequence[str]):
        cuda = torch.backends.cuda
        self.before = {name: bool(getattr(cuda, get)()) for name, (get, _) in SWITCHES.items()}
        self.names = tuple(names)
        for name, (_, enable) in SWITCHES.items():
            getattr(cuda, enable)(name in self.names)
        log.info("trainer.sdpa_backends: SDPA kernels %s", ", ".join(self.names))

    def close(self) -> None:
        before, self.before = self.before, {}
        for name, on in before.items():
            getattr(torch.backends.cuda, SWITCHES[name][1])(on)


def apply(names: Optional[Sequence[str]], device: torch.device) -> Optional[SdpaSwitches]:
    """Switch on only ``names`` for a run on ``device`` (CUDA; elsewhere, or with ``names`` null,
    nothing changes and None is returned)."""
    if names is None or torch.device(device).type != "cuda":
        return None
    return SdpaSwitches(list(names))
