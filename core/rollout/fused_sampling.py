"""One-pass greedy / temperature sampling on CUDA (Triton), for the common unfiltered case.

The plain PyTorch sampler reads the ``[B, V]`` logits about ten times (cast, noise, log,
subtract, argmax, log-sum-exp). This kernel reads them once: each program walks one row,
keeping per-lane running maxima and sums for the log-sum-exp and the best Gumbel-perturbed
score for the draw, so a step's sampling costs one read of the logits.

Noise comes from Triton's counter-based Philox generator keyed by a per-step seed the caller
draws from a seeded host generator, so runs are reproducible and nothing waits for the device.
Only used without top-k / top-p; :func:`available` says whether Triton can run here.
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of PyTorch; CPU builds and other accelerators go without
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

if triton is not None:
    _NEG = tl.constexpr(-3.0e38)  # finite "minus infinity": keeps the running sums free of inf - inf

    @triton.jit(do_not_specialize=["seed"])
    def _sample_rows(logits_ptr, stride, vocab, inv_temp, seed, tokens_ptr, logprobs_ptr,
                     GREEDY: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * stride
        lane = tl.arange(0, BLOCK)
        run_max = tl.full([BLOCK], _NEG, tl.float32)
        run_sum = tl.zeros([BLOCK], tl.float32)
        best = tl.full([BLOCK], _NEG, tl.float32)
        best_idx = tl.zeros([BLOCK], tl.int32)
        for start in range(0, vocab, BLOCK):
            offs = start + lane
            valid = offs < vocab
            x = tl.load(base + offs, mask=valid, other=0.0).to(tl.float32) * inv_temp
            x = tl.where(valid, x, _NEG)
            new_max = tl.maximum(run_max, x)
            run_sum = run_sum * tl.exp(run_max - new_max) + tl.where(valid, tl.exp(x - new_max), 0.0)
            run_max = new_max
            if GREEDY:
                key = x
            else:
                u = tl.rand(seed, row * vocab + offs)
                key = tl.where(valid, x - tl.log(-tl.log(u)), _NEG)
            better = key > best
            best = tl.where(better, key, best)
            best_idx = tl.where(better, offs, best_idx)
        top = tl.max(run_max, axis=0)
        total = tl.sum(run_sum * tl.exp(run_max - top), axis=0)
        winner = tl.max(best, axis=0)
        token = tl.min(tl.where(best == winner, best_idx, vocab), axis=0)
        picked = tl.load(base + token).to(tl.float32) * inv_temp
        tl.store(tokens_ptr + row, token.to(tl.int64))
        tl.store(logprobs_ptr + row, picked - top - tl.log(total))


def available(device: torch.device) -> bool:
    """Whether the fused kernel can run on ``device``."""
    return triton is not None and device.type == "cuda"


def sample_rows(logits: torch.Tensor, temperature: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy (``temperature <= 0``) or temperature sampling of each row, in one pass.

    Args:
        logits: ``[B, V]`` raw logits, last dimension contiguous (any float dtype).
        seed: per-call noise seed (ignored when greedy).
    Returns:
        ``(tokens [B] int64, logprobs [B] float32)``, log-probs under ``log_softmax(logits / T)``
        (``T = 1`` when greedy), as :func:`rlcore.rollout.sampling.sample_next` defines them.
    """
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    greedy = temperature <= 0
    inv_temp = 1.0 if greedy else 1.0 / temperature
    _sample_rows[(rows,)](logits, logits.stride(0), vocab, inv_temp, int(seed) & 0x7FFFFFFF, tokens, logprobs,
                          GREEDY=greedy, BLOCK=1024, num_warps=4)
    return tokens, logprobs
