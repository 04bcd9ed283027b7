"""Triton where it is installed, and where the project's Triton kernels can run.

Triton ships with CUDA builds of PyTorch; CPU builds and other accelerators go without, so every
kernel module imports it from here and defines its kernels only when ``triton`` is not ``None``.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None
    tl = None


def interpreting() -> bool:
    """Whether Triton's CPU interpreter is on (``TRITON_INTERPRET=1``, for tests): it multiplies
    half-precision numbers as raw integers and has no fast-math intrinsics, so kernels take their
    float32 / exact paths under it."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def kernels_run_on(device: torch.device | str) -> bool:
    """Whether Triton kernels can run on ``device``: CUDA with Triton, or Triton's CPU interpreter."""
    device = torch.device(device)
    if triton is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpreting())
