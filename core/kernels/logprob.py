"""Log-probs of chosen tokens, and the entropy, in one read of the logits (Triton, CUDA).

The training forward needs ``log_softmax(logits / T)`` at the sampled tokens for ``[B, R, V]``
logits with a vocabulary of up to ~150k. The reference, :func:`rlcore.rlmath.logprobs_from_logits`,
goes chunk by chunk in float32 and reads and writes each chunk several times (cast, log-sum-exp,
gather, entropy), and autograd keeps the float32 chunks for the backward. These kernels (the fast
path, :func:`token_logprobs`) read the logits once in the forward (one program per row: a running
maximum, the sum of exponentials and, for the entropy, their sum weighted by the logits) and once
in the backward, which writes the gradient ``(onehot(label) - softmax(z)) * g / T`` straight in the
logits' dtype.

Rows may have any two strides (the logits of the response are a slice of the model's output);
the last dimension must be contiguous. :func:`available` says where the kernels run: CUDA with
Triton, or Triton's CPU interpreter when ``TRITON_INTERPRET=1`` (for tests). :func:`token_logprobs`
is a ``torch.library`` custom operator (``rlcore::logprob_forward`` with its backward
``rlcore::logprob_backward``) with fake implementations, so compiled code can call it.
"""

from __future__ import annotations

import torch

from rlcore.kernels.triton_support import kernels_run_on as available  # noqa: F401 - part of this API
from rlcore.kernels.triton_support import tl, triton

#: columns a program reads per iteration
BLOCK = 4096

if triton is not None:
    _NEG = tl.constexpr(-3.0e38)  # a finite "minus infinity": exp(_NEG - m) is 0 and 0 * _NEG is not NaN

    @triton.jit
    def _row_start(logits_ptr, row, stride_b, stride_r, rows_per_batch):
        """The first logit of ``row`` (``b * R + r``) of a ``[B, R, V]`` tensor with the given strides."""
        return logits_ptr + (row // rows_per_batch).to(tl.int64) * stride_b + (row % rows_per_batch).to(tl.int64) * stride_r

    @triton.jit
    def _forward_rows(logits_ptr, stride_b, stride_r, rows_per_batch, labels_ptr, vocab, inv_temp,
                      logp_ptr, lse_ptr, ent_ptr, WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = _row_start(logits_ptr, row, stride_b, stride_r, rows_per_batch)
        cols = tl.arange(0, BLOCK)
        run_max = tl.max(tl.full([BLOCK], _NEG, tl.float32), axis=0)  # a scalar: one exp per element
        run_sum = tl.zeros([BLOCK], tl.float32)
        run_dot = tl.zeros([BLOCK], tl.float32)  # sum of exp(z - max) * z, for the entropy
        for start in range(0, vocab, BLOCK):
            offs = start + cols
            valid = offs < vocab
            z = tl.load(base + offs, mask=valid, other=0.0).to(tl.float32) * inv_temp
            z = tl.where(valid, z, _NEG)
            new_max = tl.maximum(run_max, tl.max(z, axis=0))
            scale = tl.exp(run_max - new_max)
            e = tl.exp(z - new_max)
            run_sum = run_sum * scale + e
            if WITH_ENTROPY:
                run_dot = run_dot * scale + tl.where(valid, e * z, 0.0)
            run_max = new_max
        total = tl.sum(run_sum, axis=0)
        lse = run_max + tl.log(total)
        label = tl.load(labels_ptr + row)
        picked = tl.load(base + label).to(tl.float32) * inv_temp
        tl.store(logp_ptr + row, picked - lse)
        tl.store(lse_ptr + row, lse)
        if WITH_ENTROPY:
            tl.store(ent_ptr + row, lse - tl.sum(run_dot, axis=0) / total)

    @triton.jit
    def _backward_rows(logits_ptr, stride_b, stride_r, rows_per_batch, labels_ptr, vocab, inv_temp,
                       lse_ptr, grad_out_ptr, grad_ptr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = _row_start(logits_ptr, row, stride_b, stride_r, rows_per_batch)
        out = grad_ptr + row.to(tl.int64) * vocab
        lse = tl.load(lse_ptr + row)
        g = tl.load(grad_out_ptr + row) * inv_temp
        label = tl.load(labels_ptr + row)
        cols = tl.arange(0, BLOCK)
        for start in range(0, vocab, BLOCK):
            offs = start + cols
            valid = offs < vocab
            z = tl.load(base + offs, mask=valid, other=0.0).to(tl.float32) * inv_temp
            d = tl.where(offs == label, 1.0, 0.0) - tl.exp(z - lse)
            tl.store(out + offs, (d * g).to(grad_ptr.dtype.element_ty), mask=valid)


def _rows(logits: torch.Tensor) -> tuple[int, int, int, int]:
    """``(rows, stride_b, stride_r, rows_per_batch)`` of ``logits [B, R, V]``."""
    if logits.dim() != 3 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [B, R, V] with a contiguous last dimension, got shape "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    batch, length, _ = logits.shape
    return batch * length, logits.stride(0), logits.stride(1), length


def forward(logits: torch.Tensor, labels: torch.Tensor, temperature: float, with_entropy: bool):
    """``(logp [B, R], lse [B, R], entropy [B, R] or None)``, float32, under ``softmax(logits / T)``."""
    rows, sb, sr, per = _rows(logits)
    shape = logits.shape[:2]
    labels = labels.reshape(-1).to(torch.int64).contiguous()
    logp = torch.empty(shape, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(logp)
    ent = torch.empty_like(logp) if with_entropy else logp  # placeholder pointer when unused
    if rows:
        _forward_rows[(rows,)](logits, sb, sr, per, labels, logits.shape[-1], 1.0 / temperature,
                               logp, lse, ent, WITH_ENTROPY=bool(with_entropy), BLOCK=BLOCK, num_warps=8)
    return logp, lse, (ent if with_entropy else None)


def backward(logits: torch.Tensor, labels: torch.Tensor, temperature: float, lse: torch.Tensor,
             grad_logp: torch.Tensor) -> torch.Tensor:
    """The gradient of ``sum(grad_logp * logp)`` with respect to ``logits``, in ``logits.dtype``, contiguous."""
    rows, sb, sr, per = _rows(logits)
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    if rows:
        _backward_rows[(rows,)](logits, sb, sr, per, labels.reshape(-1).to(torch.int64).contiguous(),
                                logits.shape[-1], 1.0 / temperature, lse.contiguous(),
                                grad_logp.float().contiguous(), grad, BLOCK=BLOCK, num_warps=8)
    return grad


@torch.library.custom_op("rlcore::logprob_forward", mutates_args=())
def _forward_op(logits: torch.Tensor, labels: torch.Tensor, temperature: float,
                with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logp, lse, ent = forward(logits, labels, temperature, with_entropy)
    return logp, lse, ent if ent is not None else logp.new_empty(0)


@_forward_op.register_fake
def _(logits, labels, temperature, with_entropy):
    logp = logits.new_empty(logits.shape[:2], dtype=torch.float32)
    return logp, torch.empty_like(logp), torch.empty_like(logp) if with_entropy else logp.new_empty(0)


@torch.library.custom_op("rlcore::logprob_backward", mutates_args=())
def _backward_op(logits: torch.Tensor, labels: torch.Tensor, temperature: float, lse: torch.Tensor,
                 grad_logp: torch.Tensor) -> torch.Tensor:
    return backward(logits, labels, temperature, lse, grad_logp)


@_backward_op.register_fake
def _(logits, labels, temperature, lse, grad_logp):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


def _setup_context(ctx, inputs, output) -> None:
    logits, labels, temperature, _ = inputs
    ctx.save_for_backward(logits, labels, output[1])
    ctx.temperature = temperature


def _backward_rule(ctx, grad_logp, grad_lse, grad_ent):
    logits, labels, lse = ctx.saved_tensors
    return _backward_op(logits, labels, ctx.temperature, lse, grad_logp), None, None, None


_forward_op.register_autograd(_backward_rule, setup_context=_setup_context)


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logp [B, R], entropy [B, R] or None)`` float32 under ``softmax(logits / T)``, differentiable in
    ``logits`` through ``logp`` (the backward kernel recomputes the softmax; nothing but the
    log-normalisers is kept); the entropy carries no gradient."""
    logp, _, ent = _forward_op(logits, labels, float(temperature), bool(with_entropy))
    return logp, (ent.detach() if with_entropy else None)
