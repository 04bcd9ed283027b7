"""The decode step's gate/up product with SiLU·mul in its epilogue, balanced across the GPU (stream-K).

At a few hundred rows the gate/up product of a small model is too small to fill the GPU with
whole output tiles: Qwen2-0.5B at 256 rows has 152 tiles of 128 × 64 (each with a gate and an up
accumulator) for 132 multiprocessors, so a tile-per-program product runs two rounds with the
second one nearly empty. Here each of ``ctas`` programs (one per multiprocessor) takes an equal
share of all (tile, inner-block) iterations and walks it from its end; a tile whose iterations
straddle two programs is begun first by the one and finished last by the other: the first writes
its partial sums to a workspace and raises a flag, which the second waits for, adds and clears (so the flags are zero again for the
next call, and a CUDA graph replay needs no reset). The epilogue applies ``silu(gate) * up`` in
float32 and rounds once, so the ``[n, 2I]`` product is never written.

Loads go through tensor-memory-accelerator descriptors (Hopper and later).
"""

from __future__ import annotations

import functools

import torch

from rlcore.triton_support import tl, triton

try:  # host-side tensor descriptors (Triton 3.4 and later)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the installation
    TensorDescriptor = None

if triton is not None:

    @triton.jit
    def _gate_up_silu(x_desc, w_desc, out_desc, part_ptr, flag_ptr, inter, num_m, iters_per_tile, total_iters,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
        cta = tl.program_id(0)
        ctas = tl.num_programs(0)
        start = cta * total_iters // ctas
        it = (cta + 1) * total_iters // ctas
        rows = tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        part_at = part_ptr + rows[:, None] * BLOCK_N + cols[None, :]
        # the program's share is walked from its end: a tile it shares with the next program (the
        # tile's first iterations) comes first, one it shares with the previous program comes last
        while it > start:
            tile = (it - 1) // iters_per_tile
            first = tile * iters_per_tile
            k0 = tl.maximum(first, start) - first
            k1 = it - first
            off_m = (tile % num_m) * BLOCK_M
            off_n = (tile // num_m) * BLOCK_N
            gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kk in tl.range(k0, k1, num_stages=STAGES):
                k = kk * BLOCK_K
                a = x_desc.load([off_m, k])
                gate = tl.dot(a, w_desc.load([off_n, k]).T, gate)
                up = tl.dot(a, w_desc.load([inter + off_n, k]).T, up)
            if k1 < iters_per_tile:
                # the tile ends in the next program, which finishes it: hand the partial sums over
                mine = part_at + cta * 2 * BLOCK_M * BLOCK_N
                tl.store(mine, gate)
                tl.store(mine + BLOCK_M * BLOCK_N, up)
                tl.debug_barrier()
                tl.atomic_xchg(flag_ptr + cta, 1, sem="release")
            else:
                if k0 > 0:
                    # the tile began in the previous program: wait for its partial sums, add, clear the flag
                    seen = tl.atomic_cas(flag_ptr + cta - 1, 1, 0, sem="acquire")
                    while seen != 1:
                        seen = tl.atomic_cas(flag_ptr + cta - 1, 1, 0, sem="acquire")
                    theirs = part_at + (cta - 1) * 2 * BLOCK_M * BLOCK_N
                    gate += tl.load(theirs, cache_modifier=".cg")
                    up += tl.load(theirs + BLOCK_M * BLOCK_N, cache_modifier=".cg")
                out = gate / (1.0 + tl.exp(-gate)) * up
                out_desc.store([off_m, off_n], out.to(out_desc.dtype))
            it = first + k0


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


_BUFFERS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _buffers(device: torch.device, ctas: int, block_m: int, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Workspace for the partial sums and the flags (zeros, left at zero by the kernel), kept per shape."""
    key = (device, ctas, block_m, block_n)
    if key not in _BUFFERS:
        _BUFFERS[key] = (torch.empty(ctas + 1, 2, block_m, block_n, dtype=torch.float32, device=device),
                         torch.zeros(ctas + 2, dtype=torch.int32, device=device))
    return _BUFFERS[key]


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, *, block_m: int = 128, block_n: int = 64,
                 block_k: int = 64, num_warps: int = 8, stages: int = 3, ctas: int | None = 0) -> torch.Tensor:
    """``silu(x @ W_gate.T) * (x @ W_up.T)`` for ``x [n, H]`` and the fused ``weight [2I, H]`` (gate rows,
    then up rows), both contiguous; ``[n, I]`` in ``x``'s dtype.

    ``ctas``: programs sharing the work (``0``: one per multiprocessor, at most one per tile;
    ``None``: one per tile, no tile shared)."""
    n, hidden = x.shape
    inter = weight.shape[0] // 2
    out = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    num_m, num_n = triton.cdiv(n, block_m), triton.cdiv(inter, block_n)
    tiles, iters = num_m * num_n, triton.cdiv(hidden, block_k)
    programs = tiles if ctas is None else min(ctas or _sm_count(x.device.index or 0), tiles)
    parts, flags = _buffers(x.device, programs, block_m, block_n)
    x_desc = TensorDescriptor.from_tensor(x, [block_m, block_k])
    w_desc = TensorDescriptor.from_tensor(weight, [block_n, block_k])
    out_desc = TensorDescriptor.from_tensor(out, [block_m, block_n])
    _gate_up_silu[(programs,)](x_desc, w_desc, out_desc, parts, flags, inter, num_m, iters, tiles * iters,
                               BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, num_warps=num_warps)
    return out
