"""Token log-probs straight from the last hidden states: the vocabulary projection fused with the
log-softmax, so the ``[tokens, V]`` logits never exist whole.

A training forward of ``N`` response tokens through a ``V``-word head materialises ``N x V`` logits
(and as many gradients in the backward): at ``N`` = 32k tokens and ``V`` = 152k that is 10 GB in
bf16, each way. :func:`linear_token_logprobs` takes the hidden states ``[N, d]`` and the head's
weight ``[V, d]`` instead and goes through the tokens a chunk at a time (at most
``chunk_bytes`` of logits at once):

* forward: ``z = h_c @ W^T`` for a chunk, then its log-probs at the labels, log-normalisers and
  (optionally) entropies under ``softmax(z / T)`` (the one-pass kernels of
  :mod:`rlcore.kernels.logprob` on CUDA; float32 PyTorch elsewhere); the chunk's logits are dropped.
  Only the log-normalisers are kept for the backward.
* backward: the chunk's logits are computed again, turned into their gradient
  ``(onehot(label) - softmax(z / T)) * g / T`` in place of the logits, and multiplied out:
  ``dh_c = dz @ W`` and ``dW += dz^T @ h_c`` (accumulated in float32 over chunks).

The price is one more ``h @ W^T`` product in the backward (the head is ~15% of a 1.5B model's
FLOPs, so ~5% of the update); the gain is the memory of the logits and their gradient, which
is what lets a long micro-batch train without activation checkpointing. The entropy carries no
gradient (the caller takes the logits path when an entropy bonus needs one).
"""

from __future__ import annotations

from typing import Optional

import torch

from rlcore.kernels import logprob as logprob_kernels

#: logits held at once (bytes): one chunk of tokens times the vocabulary
CHUNK_BYTES = 1 << 30


def _chunk_forward(z: torch.Tensor, labels: torch.Tensor, temperature: float, with_entropy: bool):
    """``(logp, lse, entropy or None)`` ``[n]`` float32 of one chunk's logits ``z [n, V]``."""
    if logprob_kernels.available(z.device):
        logp, lse, ent = logprob_kernels.forward(z[None], labels[None], temperature, with_entropy)
        return logp[0], lse[0], (ent[0] if ent is not None else None)
    scaled = z.float() / temperature
    lse = torch.logsumexp(scaled, dim=-1)
    logp = scaled.gather(-1, labels[:, None].long())[:, 0] - lse
    ent = (lse - (torch.softmax(scaled, dim=-1) * scaled).sum(-1)) if with_entropy else None
    return logp, lse, ent


def _chunk_backward(z: torch.Tensor, labels: torch.Tensor, temperature: float, lse: torch.Tensor,
                    grad: torch.Tensor) -> torch.Tensor:
    """The gradient of ``sum(grad * logp)`` with respect to ``z [n, V]``, in ``z``'s dtype."""
    if logprob_kernels.available(z.device):
        return logprob_kernels.backward(z[None], labels[None], temperature, lse[None], grad[None])[0]
    probs = torch.exp(z.float() / temperature - lse[:, None])
    onehot = torch.zeros_like(probs).scatter_(-1, labels[:, None].long(), 1.0)
    return ((onehot - probs) * (grad.float() / temperature)[:, None]).to(z.dtype)


def chunk_rows(vocab: int, element_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk so that a chunk's logits take at most ``chunk_bytes`` (at least 64)."""
    return max(64, int(chunk_bytes) // max(1, vocab * element_size))


class _LinearTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, with_entropy, rows):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if with_entropy else None
        for start in range(0, n, rows):
            end = min(n, start + rows)
            z = hidden[start:end] @ weight.t()
            lp, ls, en = _chunk_forward(z, labels[start:end], temperature, with_entropy)
            logp[start:end], lse[start:end] = lp, ls
            if ent is not None:
                ent[start:end] = en
            del z
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.temperature, ctx.rows = temperature, rows
        if ent is None:
            ent = logp.new_empty(0)
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, labels, lse = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = None
        n, rows = hidden.shape[0], ctx.rows
        for start in range(0, n, rows):
            end = min(n, start + rows)
            h = hidden[start:end]
            dz = _chunk_backward(h @ weight.t(), labels[start:end], ctx.temperature, lse[start:end],
                                 grad_logp[start:end])
            if want_h:
                grad_h[start:end] = dz @ weight
            if want_w:
                part = dz.t() @ h
                if n <= rows:  # one chunk: no sum to keep in float32
                    grad_w = part
                elif grad_w is None:
                    grad_w = part.float()
                else:
                    grad_w += part
            del dz
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None


def linear_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float,
                          with_entropy: bool = False, chunk_bytes: int = CHUNK_BYTES
                          ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs of ``labels [N]`` under ``softmax(hidden @ weight^T / T)``: ``hidden [N, d]``,
    ``weight [V, d]`` -> ``(logp [N], entropy [N] or None)`` float32, differentiable in ``hidden``
    and ``weight`` through ``logp`` (see the module docstring)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_token_logprobs: hidden [N, d] and weight [V, d] expected, got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"linear_token_logprobs: labels {tuple(labels.shape)} do not match hidden "
                         f"{tuple(hidden.shape)}")
    rows = chunk_rows(weight.shape[0], hidden.element_size(), chunk_bytes)
    logp, ent = _LinearTokenLogprobs.apply(hidden, weight, labels, float(temperature), bool(with_entropy), rows)
    return logp, (ent if with_entropy else None)
