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


def compile_for_hopper(kernel, types: dict[str, str], constants: dict[str, object], num_warps: int,
                       num_stages: int | None = None, values: dict[str, int] | None = None,
                       fp_fusion: bool | None = None):
    """Compile the ``@triton.jit`` ``kernel`` for an sm_90 GPU without one (PTX, then a cubin through
    the ``ptxas`` Triton ships); returns Triton's compiled kernel (``.asm["ptx"]``, ``["cubin"]``).

    ``types``: argument name -> Triton type (``"*bf16"``, ``"fp32"``; names not given are 32-bit
    integers); ``constants``: the ``constexpr`` arguments. ``values``: integer arguments as a launch
    would pass them, for the same specialisation: a 1 becomes a constant, a multiple of 16 is marked
    divisible by 16 (pointers always are). ``fp_fusion``: Triton's ``enable_fp_fusion`` (products and sums
    contracted into fused multiply-adds; None: Triton's default).
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    values = values or {}
    signature, fixed, hints = {}, {}, {}
    for index, name in enumerate(kernel.arg_names):
        kind = types.get(name, "i32")
        if name in constants or values.get(name) == 1:
            signature[name], fixed[(index,)] = "constexpr", constants.get(name, 1)
            continue
        signature[name] = kind
        if kind.startswith("*") or (name in values and values[name] % 16 == 0):
            hints[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(kernel, signature, constexprs=fixed, attrs=hints)
    options = {"num_warps": num_warps} | ({"num_stages": num_stages} if num_stages else {})
    if fp_fusion is not None:
        options["enable_fp_fusion"] = bool(fp_fusion)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
