"""Matrix products of the decode step in Triton, shaped for a few hundred rows.

At decode time every projection multiplies a short, wide activation (one row per slot) by a
weight matrix read from memory. For small models at a few hundred rows the library GEMMs launch
too few thread blocks to fill the GPU (a 256 x 896 output is 56 tiles of 64 x 64), and the MLP
writes its gate and up halves only for the next kernel to read them back. This module's kernel
computes ``a @ w.T`` for a row-major ``w [N, K]`` with, in the same pass:

* ``gated``: ``silu(a @ w[:N].T) * (a @ w[N:2N].T)`` — the SiLU-gated MLP input (``w`` is the
  fused gate/up matrix), so the ``[M, 2N]`` intermediate never reaches memory;
* ``bias`` and ``residual`` added in float32 before the single rounding to the output dtype;
* ``split_k``: the ``K`` loop cut into chunks, each program writing a float32 partial
  ``[split_k, M, N]`` that the caller sums (in the decode step the sum rides in the next fused
  pointwise kernel), which gives the long-``K`` down projection enough programs.

:func:`tile_config` picks the tiles from the shape (a fixed rule, so runs are repeatable);
:func:`linear` launches the kernel, and is registered as a ``torch.library`` Triton op so that
``torch.compile`` traces through it and fuses the work around it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from rlcore.triton_support import kernels_run_on as available  # noqa: F401 - part of this API
from rlcore.triton_support import tl, triton


@dataclass(frozen=True)
class TileConfig:
    """Tiles of one launch: ``block_m x block_n`` outputs per program, ``block_k`` deep steps."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


if triton is not None:

    @triton.jit
    def _linear_kernel(a_ptr, w_ptr, out_ptr, bias_ptr, res_ptr, M, N, K, s_am, s_wn, s_om, s_rm, up_rows,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT_K: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
                       HAS_RES: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr):
        # axis 0 walks the row tiles of one column tile, so programs that run together share the
        # weight tile in L2
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        span = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
        k_lo = pid_k * span
        k_hi = tl.minimum(k_lo + span, K)
        a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * s_am + (k_lo + rk)[None, :]
        w_ptrs = w_ptr + rn.to(tl.int64)[None, :] * s_wn + (k_lo + rk)[:, None]  # [BLOCK_K, BLOCK_N]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in range(k_lo, k_hi, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
                w = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                k_ok = (k + rk) < k_hi
                a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
            if GATED:
                if EVEN_K:
                    u = tl.load(w_ptrs + up_rows * s_wn, mask=n_ok[None, :], other=0.0)
                else:
                    u = tl.load(w_ptrs + up_rows * s_wn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                if IEEE:
                    acc_up += tl.dot(a.to(tl.float32), u.to(tl.float32), input_precision="ieee")
                else:
                    acc_up = tl.dot(a, u, acc_up)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        out_ok = m_ok[:, None] & n_ok[None, :]
        if SPLIT_K > 1:  # float32 partials [SPLIT_K, M, N]; the caller sums them
            at = out_ptr + pid_k.to(tl.int64) * M * N + rm.to(tl.int64)[:, None] * N + rn[None, :]
            tl.store(at, acc, mask=out_ok)
        else:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc = acc / (1.0 + tl.exp(-acc)) * acc_up
            if HAS_RES:
                acc += tl.load(res_ptr + rm.to(tl.int64)[:, None] * s_rm + rn[None, :], mask=out_ok,
                               other=0.0).to(tl.float32)
            at = out_ptr + rm.to(tl.int64)[:, None] * s_om + rn[None, :]
            tl.store(at, acc.to(out_ptr.dtype.element_ty), mask=out_ok)


def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device.index or 0).multi_processor_count


def tile_config(m: int, n: int, k: int, gated: bool = False, sms: int = 132) -> TileConfig:
    """The tiles for an ``[m, k] @ [k, n]`` product on ``sms`` multiprocessors.

    Rule: 64-row tiles; the widest column tile (128, 64 or 32) that still gives at least one
    program per multiprocessor; if even 32 columns leave multiprocessors idle, split ``K`` (into
    at most 8 chunks of at least 512) until there are enough programs. Gated products use at most
    64 columns (two accumulators).
    """
    rows = -(-m // 64)
    widths = (64, 32) if gated else (128, 64, 32)
    block_n = widths[-1]
    for width in widths:
        if rows * -(-n // width) >= sms:
            block_n = width
            break
    programs = rows * -(-n // block_n)
    split = 1
    if not gated:
        while programs * split < sms and split < 8 and k // (split * 2) >= 512:
            split *= 2
    return TileConfig(block_m=64, block_n=block_n, block_k=64, split_k=split)


def linear(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, *, gated: bool = False,
           config: TileConfig | None = None) -> torch.Tensor:
    """``a @ w.T`` with the optional gated / bias / residual epilogue (see the module docstring).

    Args:
        a: ``[M, K]``, last dimension contiguous. w: ``[N, K]`` (``[2N, K]`` when ``gated``), row-major.
        bias: ``[N]``; residual: ``[M, N]`` (last dimension contiguous). Neither with ``split_k > 1``,
            nor ``bias`` with ``gated``.
        config: tiles (default :func:`tile_config`).
    Returns:
        ``[M, N]`` in ``a``'s dtype, or with ``split_k > 1`` float32 partials ``[split_k, M, N]``.
    """
    m, k = a.shape
    rows = w.shape[0]
    n = rows // 2 if gated else rows
    if a.stride(-1) != 1 or w.stride(-1) != 1 or w.shape[1] != k or (gated and rows % 2):
        raise ValueError(f"decode_gemm.linear: bad operands a {tuple(a.shape)} / {a.stride()}, "
                         f"w {tuple(w.shape)} / {w.stride()} (gated={gated})")
    config = config or tile_config(m, n, k, gated, _sms(a.device))
    if config.split_k > 1 and (bias is not None or residual is not None or gated):
        raise ValueError("decode_gemm.linear: split_k > 1 returns partials; add bias/residual after the sum")
    if gated and bias is not None:
        raise ValueError("decode_gemm.linear: a gated product takes no bias")
    if residual is not None and (residual.shape != (m, n) or residual.stride(-1) != 1):
        raise ValueError(f"decode_gemm.linear: residual {tuple(residual.shape)} does not match [{m}, {n}]")
    if config.split_k > 1:
        out = torch.empty(config.split_k, m, n, dtype=torch.float32, device=a.device)
    else:
        out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), config.split_k)
    ieee = a.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"
    even_k = k % (config.block_k * config.split_k) == 0
    _linear_kernel[grid](a, w, out, bias if bias is not None else out, residual if residual is not None else out,
                         m, n, k, a.stride(0), w.stride(0), out.stride(-2),
                         residual.stride(0) if residual is not None else 0, n,
                         BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                         SPLIT_K=config.split_k, GATED=gated, HAS_BIAS=bias is not None,
                         HAS_RES=residual is not None, EVEN_K=even_k, IEEE=ieee,
                         num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def reference(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
              residual: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """The same product in float32 PyTorch: ``[M, N]`` float32."""
    out = a.float() @ w.float().t()
    if gated:
        gate, up = out.chunk(2, dim=-1)
        out = torch.nn.functional.silu(gate) * up
    if bias is not None:
        out = out + bias.float()
    if residual is not None:
        out = out + residual.float()
    return out
