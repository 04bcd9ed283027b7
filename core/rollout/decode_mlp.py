"""The decode step's SiLU-gated MLP products in Triton, with the SiLU·mul fused in.

At a few hundred rows the MLP of a decode step is three kernels per layer with library GEMMs:
the gate/up product writes ``[n, 2I]``, a pointwise kernel reads it back and writes
``silu(gate) * up`` ``[n, I]``, the down product reads that. Here the pointwise work rides
inside a product:

* :func:`gate_up_silu` — one product with two accumulators (a gate tile and the matching up
  tile of the fused ``[2I, H]`` weight) and ``silu(gate) * up`` in its epilogue: it writes
  ``[n, I]`` once, and the pointwise kernel is gone;
* :func:`down_partials` — the down product over slices of the inner dimension (split-K, as
  :func:`rlcore.rollout.decode._partials`), optionally reading the gate/up output and forming
  ``silu(gate) * up`` as it loads it (the prologue form).

Both work in float32 inside and round once, like the compiled pointwise kernel they replace.
They are exposed as ``torch.library`` custom ops so that the compiled step functions can call
them inside a full graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlcore.triton_support import tl, triton


@dataclass(frozen=True)
class Tiles:
    """Tile sizes and launch shape of one product."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int


#: defaults picked on an H200 at 64-256 rows, Qwen2-0.5B/1.5B shapes (see bench/bench_decode_parts.py)
GATE_UP_TILES = Tiles(64, 64, 64, 4, 4)
DOWN_TILES = Tiles(64, 64, 64, 4, 4)

if triton is not None:

    @triton.jit
    def _gate_up_silu_kernel(x_ptr, w_ptr, out_ptr, M, N, K, sx_m, sw_n, so_m,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # rows vary fastest: the programs sharing a weight tile run side by side
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        row_ok, col_ok = rows < M, cols < N
        x_ptrs = x_ptr + rows[:, None] * sx_m + ks[None, :]
        g_ptrs = w_ptr + cols[None, :] * sw_n + ks[:, None]  # [BLOCK_K, BLOCK_N] of W_gate^T
        u_ptrs = g_ptrs + N * sw_n
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            k_ok = (k + ks) < K
            a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            wu = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            gate = tl.dot(a, wg, gate)
            up = tl.dot(a, wu, up)
            x_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        h = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + rows[:, None] * so_m + cols[None, :], h.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _down_kernel(a_ptr, w_ptr, out_ptr, M, N, K, WIDTH, sa_m, sw_n, so_s, so_m,
                     GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # program (m, n, s): rows m, output columns n, inner slice s of WIDTH columns
        pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = pid_s * WIDTH + tl.arange(0, BLOCK_K)
        end = pid_s * WIDTH + WIDTH
        row_ok, col_ok = rows < M, cols < N
        a_ptrs = a_ptr + rows[:, None] * sa_m + ks[None, :]
        w_ptrs = w_ptr + cols[None, :] * sw_n + ks[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, WIDTH, BLOCK_K):
            k_ok = (ks + k) < end
            if GATED:  # a = [gate | up] of width 2K: form silu(gate) * up while loading
                g = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
                u = tl.load(a_ptrs + K, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
                a = (g / (1.0 + tl.exp(-g)) * u).to(w_ptr.dtype.element_ty)
            else:
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(a, w, acc)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        tl.store(out_ptr + pid_s * so_s + rows[:, None] * so_m + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


def _launch_gate_up(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, tiles: Tiles) -> None:
    m, k = x.shape
    n = weight.shape[0] // 2
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n))
    _gate_up_silu_kernel[grid](x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
                               BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                               num_warps=tiles.warps, num_stages=tiles.stages)


def _launch_down(a: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, gated: bool, tiles: Tiles) -> None:
    splits, m, n = out.shape
    k = weight.shape[1]
    width = k // splits
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n), splits)
    _down_kernel[grid](a, weight, out, m, n, k, width, a.stride(0), weight.stride(0), out.stride(0), out.stride(1),
                       GATED=gated, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                       num_warps=tiles.warps, num_stages=tiles.stages)


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, tiles: Tiles = GATE_UP_TILES) -> torch.Tensor:
    """``silu(x @ W_gate.T) * (x @ W_up.T)`` for ``x [n, H]``, ``weight [2I, H]`` (gate rows, then up rows)."""
    out = torch.empty(x.shape[0], weight.shape[0] // 2, dtype=x.dtype, device=x.device)
    _launch_gate_up(x, weight, out, tiles)
    return out


def down_partials(a: torch.Tensor, weight: torch.Tensor, splits: int, gated: bool,
                  tiles: Tiles = DOWN_TILES) -> torch.Tensor:
    """``[splits, n, H]`` partial products of ``h @ W_down.T`` over equal slices of the inner dimension,
    where ``h = a`` (``[n, I]``) or, with ``gated``, ``h = silu(gate) * up`` for ``a = [gate | up]`` ``[n, 2I]``."""
    out = torch.empty(splits, a.shape[0], weight.shape[0], dtype=a.dtype, device=a.device)
    _launch_down(a, weight, out, gated, tiles)
    return out
