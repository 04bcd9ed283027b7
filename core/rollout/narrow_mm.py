"""Split-K products for the decode step's narrow projections, in Triton.

At a few hundred rows the q/k/v and o products of a small model (0.5B: 896 -> 1152 and 896 -> 896)
are a few microseconds of mostly fixed latency in the library GEMM: few output tiles, and a serial
walk over the inner dimension. :func:`partial_products` cuts the inner dimension into ``splits``
slices, gives every (row tile, column tile, slice) its own program, and writes the partial
products ``[splits, M, N]`` in the input's dtype; the kernel that reads the result adds them (the
attention kernel for q/k/v, the compiled residual add for o), so there is no reduction kernel.
"""

from __future__ import annotations

import torch

from rlcore.triton_support import interpreting, tl, triton

if triton is not None:

    @triton.jit
    def _partial_mm(a_ptr, w_ptr, out_ptr, M, N, K, sa_m, sa_k, sw_n, sw_k, so_s, so_m, so_n, k_per,
                    IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        part = tl.program_id(2)
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        inner = tl.arange(0, BK)
        row_ok = rows < M
        col_ok = cols < N
        acc = tl.zeros([BM, BN], tl.float32)
        lo = part * k_per
        hi = tl.minimum(lo + k_per, K)
        for start in range(lo, hi, BK):
            k = start + inner
            k_ok = k < hi
            a = tl.load(a_ptr + rows[:, None].to(tl.int64) * sa_m + k[None, :] * sa_k,
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + cols[None, :].to(tl.int64) * sw_n + k[:, None] * sw_k,
                        mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            if IEEE:
                acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(a, w)
        at = out_ptr + part * so_s + rows[:, None].to(tl.int64) * so_m + cols[None, :] * so_n
        tl.store(at, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


#: (BM, BN, BK, splits, num_warps, num_stages) per (inner, outer) shape, from the benchmark's sweep;
#: other shapes use :data:`DEFAULT_CONFIG`
DEFAULT_CONFIG = (64, 64, 64, 2, 4, 3)
CONFIGS: dict[tuple[int, int], tuple[int, int, int, int, int, int]] = {}


def partial_products(x: torch.Tensor, weight: torch.Tensor, splits: int | None = None,
                     config: tuple[int, int, int, int, int, int] | None = None) -> torch.Tensor:
    """``[splits, M, N]`` partial products of ``x [M, K] @ weight[N, K]^T`` over ``splits`` equal
    slices of ``K`` (a multiple of the block), in ``x``'s dtype; their sum is the product.

    ``config``: ``(BM, BN, BK, splits, num_warps, num_stages)``; default :data:`CONFIGS` for the
    shape, else :data:`DEFAULT_CONFIG` (``splits`` overrides its slice count)."""
    m, k = x.shape
    n, k_w = weight.shape
    if k != k_w or x.dtype != weight.dtype or x.device != weight.device:
        raise ValueError(f"narrow product: x {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} "
                         f"{weight.dtype} do not match")
    bm, bn, bk, parts, warps, stages = config or CONFIGS.get((k, n), DEFAULT_CONFIG)
    parts = int(splits or parts)
    blocks = triton.cdiv(k, bk)
    per = triton.cdiv(blocks, parts) * bk
    parts = triton.cdiv(k, per)
    out = torch.empty(parts, m, n, dtype=x.dtype, device=x.device)
    ieee = x.dtype == torch.float32 or interpreting()
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), parts)
    _partial_mm[grid](x, weight, out, m, n, k, *x.stride(), *weight.stride(), *out.stride(), per,
                      IEEE=ieee, BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages)
    return out
