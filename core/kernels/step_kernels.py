"""The decode step's bookkeeping in one kernel each, instead of a handful of tiny PyTorch kernels.

* :func:`begin_step` — at the start of a step (inside its CUDA graph): mark each slot's new cache
  column valid in the key mask, note the column, gather the slot's RoPE rows, and advance the
  slot's position and column (clamped to the cache) for the next step. Seven kernels in PyTorch.
* :func:`record` — after sampling: each slot's token becomes its next input and, with its
  log-prob, is written at the slot's output column; the column advances and the slot's finished
  flag picks up an end-of-sequence token. Six to seven kernels in PyTorch.

Both take the same tensors as the PyTorch code they replace (:func:`begin_step_reference`,
:func:`record_reference`) and run where Triton kernels run (CUDA, or the interpreter).
"""

from __future__ import annotations

import torch

from rlcore.kernels.triton_support import kernels_run_on as available  # noqa: F401 - part of this API
from rlcore.kernels.triton_support import tl, triton

if triton is not None:

    # sizes are not specialised on (Triton compiles a kernel per value class of 1 / multiple of 16):
    # one compiled kernel serves every batch, cache length and response width
    @triton.jit(do_not_specialize=["s_table", "sb_n", "n", "last"])
    def _begin_step(cos_ptr, sin_ptr, s_table, pos_ptr, col_ptr, bias_ptr, sb_n, cos_out, sin_out, col_out, n,
                    last, dim, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        slots = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = slots < n
        feats = tl.arange(0, BLOCK_D)
        position = tl.load(pos_ptr + slots, mask=ok, other=0)
        column = tl.load(col_ptr + slots, mask=ok, other=0)
        tl.store(bias_ptr + slots.to(tl.int64) * sb_n + column, tl.zeros([BLOCK_N], bias_ptr.dtype.element_ty),
                 mask=ok)
        tl.store(col_out + slots, column, mask=ok)
        rows_ok = ok[:, None] & (feats < dim)[None, :]
        src = position.to(tl.int64)[:, None] * s_table + feats[None, :]
        dst = slots.to(tl.int64)[:, None] * dim + feats[None, :]
        tl.store(cos_out + dst, tl.load(cos_ptr + src, mask=rows_ok, other=0.0), mask=rows_ok)
        tl.store(sin_out + dst, tl.load(sin_ptr + src, mask=rows_ok, other=0.0), mask=rows_ok)
        tl.store(pos_ptr + slots, tl.minimum(position + 1, last), mask=ok)
        tl.store(col_ptr + slots, tl.minimum(column + 1, last), mask=ok)

    @triton.jit(do_not_specialize=["n", "width", "n_eos"])
    def _record(tok_ptr, lp_ptr, next_ptr, out_tok_ptr, out_lp_ptr, col_ptr, done_ptr, eos_ptr, n, width, n_eos,
                BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
        slots = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = slots < n
        token = tl.load(tok_ptr + slots, mask=ok, other=0)
        tl.store(next_ptr + slots, token, mask=ok)
        column = tl.load(col_ptr + slots, mask=ok, other=0)
        at = slots.to(tl.int64) * width + tl.minimum(column, width - 1)
        tl.store(out_tok_ptr + at, token, mask=ok)
        tl.store(out_lp_ptr + at, tl.load(lp_ptr + slots, mask=ok, other=0.0), mask=ok)
        tl.store(col_ptr + slots, column + 1, mask=ok)
        if BLOCK_E > 0:
            e = tl.arange(0, BLOCK_E)
            eos = tl.load(eos_ptr + e, mask=e < n_eos, other=-1)
            hit = tl.max((token[:, None] == eos[None, :]).to(tl.int32), axis=1)
            done = tl.load(done_ptr + slots, mask=ok, other=0).to(tl.int32)
            tl.store(done_ptr + slots, (done | hit).to(done_ptr.dtype.element_ty), mask=ok)


@torch.library.custom_op("rlcore::begin_step", mutates_args=("positions", "columns", "bias"))
def begin_step(cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor, columns: torch.Tensor,
               bias: torch.Tensor, last: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A ``torch.library`` custom operator (``rlcore::begin_step``, with a fake implementation):
    ``(cos rows [n, D], sin rows [n, D], this step's columns [n])`` for slots ``0..n-1``
    (``n = positions.shape[0]``); sets ``bias[i, columns[i]] = 0`` and advances ``positions`` and
    ``columns`` in place by one, clamped to ``last``. Tables ``[S, D]`` row-major."""
    n, dim = positions.shape[0], cos_table.shape[1]
    if cos_table.stride(1) != 1 or sin_table.stride() != cos_table.stride() or bias.stride(1) != 1:
        raise ValueError("begin_step: RoPE tables and key mask must be row-major")
    cos_rows = torch.empty(n, dim, dtype=cos_table.dtype, device=cos_table.device)
    sin_rows = torch.empty_like(cos_rows)
    now = torch.empty_like(columns)
    if n:
        block = 32
        _begin_step[(triton.cdiv(n, block),)](cos_table, sin_table, cos_table.stride(0), positions, columns, bias,
                                              bias.stride(0), cos_rows, sin_rows, now, n, last, dim, BLOCK_N=block,
                                              BLOCK_D=triton.next_power_of_2(dim), num_warps=4)
    return cos_rows, sin_rows, now


@begin_step.register_fake
def _(cos_table, sin_table, positions, columns, bias, last):
    n, dim = positions.shape[0], cos_table.shape[1]
    rows = cos_table.new_empty(n, dim)
    return rows, torch.empty_like(rows), torch.empty_like(columns)


def begin_step_reference(cos_table, sin_table, positions, columns, bias, last):
    """:func:`begin_step` in PyTorch (where Triton does not run)."""
    n = positions.shape[0]
    bias[:n].scatter_(1, columns[:, None], torch.zeros(n, 1, dtype=bias.dtype, device=bias.device))
    now = columns.clone()
    rows = cos_table.index_select(0, positions), sin_table.index_select(0, positions)
    positions.add_(1).clamp_(max=last)
    columns.add_(1).clamp_(max=last)
    return (*rows, now)


@torch.library.custom_op("rlcore::record", mutates_args=("next_tokens", "out_tokens", "out_logprobs", "out_col",
                                                    "done"))
def record(tokens: torch.Tensor, logprobs: torch.Tensor, next_tokens: torch.Tensor, out_tokens: torch.Tensor,
           out_logprobs: torch.Tensor, out_col: torch.Tensor, done: torch.Tensor, eos: torch.Tensor) -> None:
    """A ``torch.library`` custom operator (``rlcore::record``, with a fake implementation).
    For slots ``0..n-1`` (``n = tokens.shape[0]``): ``next_tokens[i] = tokens[i]``; token and
    log-prob written at row ``i``, column ``min(out_col[i], width - 1)`` of ``out_tokens`` /
    ``out_logprobs`` ``[B, width]`` (contiguous); ``out_col[i] += 1``; ``done[i] |= tokens[i] in eos``."""
    n, width = tokens.shape[0], out_tokens.shape[1]
    if not (out_tokens.is_contiguous() and out_logprobs.is_contiguous()):
        raise ValueError("record: output buffers must be contiguous")
    if n:
        block = 128
        n_eos = eos.numel()
        _record[(triton.cdiv(n, block),)](tokens, logprobs, next_tokens, out_tokens, out_logprobs, out_col, done,
                                          eos if n_eos else tokens, n, width, n_eos, BLOCK_N=block,
                                          BLOCK_E=triton.next_power_of_2(n_eos) if n_eos else 0, num_warps=4)


@record.register_fake
def _(tokens, logprobs, next_tokens, out_tokens, out_logprobs, out_col, done, eos) -> None:
    return None


def record_reference(tokens, logprobs, next_tokens, out_tokens, out_logprobs, out_col, done, eos) -> None:
    """:func:`record` in PyTorch (where Triton does not run)."""
    n, width = tokens.shape[0], out_tokens.shape[1]
    next_tokens[:n].copy_(tokens)
    col = out_col[:n].clamp(max=width - 1)
    flat = torch.arange(n, device=tokens.device) * width + col
    out_tokens.view(-1).index_copy_(0, flat, tokens)
    out_logprobs.view(-1).index_copy_(0, flat, logprobs)
    out_col[:n] += 1
    if eos.numel():
        done[:n] |= torch.isin(tokens, eos)
