"""Greedy / temperature sampling on CUDA (Triton) in about one read of the logits, for the common
unfiltered case.

The plain PyTorch sampler reads the ``[B, V]`` logits about ten times (cast, noise, log,
subtract, argmax, log-sum-exp). Here each row is cut into contiguous chunks so that even a small
batch fills the GPU: one program per (row, chunk) finds the chunk's maximum and sum of exponentials
(and, greedy or Gumbel, the best score) and writes them; a second, small kernel per row then

* greedy: merges the chunks and picks the token (the lowest index among equal scores, as
  ``torch.argmax``) and its log-probability;
* ``method="cdf"`` (the default for sampling): draws one uniform, finds the chunk whose running
  total of ``exp(logit / T)`` passes it from the chunk sums, and the token inside that chunk
  from a prefix sum over it (the only logits read twice: one chunk of :data:`DRAW_CHUNK` per row);
* ``method="gumbel"``: the first pass also adds Gumbel noise to every scaled logit and keeps the
  best; the merge takes the best over chunks (one random number and two logarithms per logit).

Random numbers come from Triton's counter-based Philox generator keyed by a per-step seed the
caller draws from a seeded host generator and by the row (and, Gumbel, the element's place in
the row), so the draw does not depend on how rows are split, runs are reproducible and nothing
waits for the device.
Only used without top-k / top-p; :func:`available` says whether Triton can run here.
"""

from __future__ import annotations

import torch

from rlcore.kernels.triton_support import interpreting, tl, triton

if triton is not None:
    from triton.language.extra import libdevice

BLOCK = 1024
#: aim for at least this many programs in the first pass (a few per multiprocessor)
TARGET_PROGRAMS = 2048
MAX_SPLITS = 64
#: columns per chunk of the inverse-CDF draw, at most (one chunk is re-read per row)
DRAW_CHUNK = 4096
METHODS = ("cdf", "gumbel")

if triton is not None:
    _NEG = tl.constexpr(-3.0e38)  # finite "minus infinity": keeps the running sums free of inf - inf

    @triton.jit
    def _fold(base, offs, hi, inv_temp, noise, run_max, run_sum, best, best_idx, GREEDY: tl.constexpr,
              FAST: tl.constexpr):
        """Load the logits at ``offs`` (below ``hi``), scale them by ``inv_temp`` and fold them into
        the per-lane running state."""
        valid = offs < hi
        x = tl.load(base + offs, mask=valid, other=0.0).to(tl.float32) * inv_temp
        x = tl.where(valid, x, _NEG)
        new_max = tl.maximum(run_max, x)
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.where(valid, tl.exp(x - new_max), 0.0)
        if GREEDY:
            key = x
        elif FAST:  # the hardware's approximate logarithm: the Gumbel noise needs no more
            key = tl.where(valid, x - libdevice.fast_logf(-libdevice.fast_logf(noise)), _NEG)
        else:
            key = tl.where(valid, x - tl.log(-tl.log(noise)), _NEG)
        better = key > best
        return new_max, run_sum, tl.where(better, key, best), tl.where(better, offs, best_idx)

    @triton.jit(do_not_specialize=["seed"])
    def _partial_rows(logits_ptr, stride, vocab, chunk, inv_temp, seed, max_ptr, sum_ptr, key_ptr, idx_ptr,
                      splits, GREEDY: tl.constexpr, FAST: tl.constexpr, BLOCK: tl.constexpr):
        # A block of BLOCK columns is four sub-blocks of SUB lanes; one Philox call gives each lane
        # four uniforms, one per sub-block, keyed by (row, block index in the row, lane).
        SUB: tl.constexpr = BLOCK // 4
        row = tl.program_id(0)
        part = tl.program_id(1)
        base = logits_ptr + row.to(tl.int64) * stride
        lane = tl.arange(0, SUB)
        run_max = tl.full([SUB], _NEG, tl.float32)
        run_sum = tl.zeros([SUB], tl.float32)
        best = tl.full([SUB], _NEG, tl.float32)
        best_idx = tl.zeros([SUB], tl.int32)
        row_blocks = tl.cdiv(vocab, BLOCK)
        lo = part * chunk
        hi = tl.minimum(lo + chunk, vocab)
        for start in range(lo, hi, BLOCK):
            if GREEDY:  # no noise; the placeholders are ignored
                u0 = run_sum
                u1 = run_sum
                u2 = run_sum
                u3 = run_sum
            else:
                r0, r1, r2, r3 = tl.randint4x(seed, (row * row_blocks + start // BLOCK) * SUB + lane)
                u0 = tl.uint_to_uniform_float(r0)
                u1 = tl.uint_to_uniform_float(r1)
                u2 = tl.uint_to_uniform_float(r2)
                u3 = tl.uint_to_uniform_float(r3)
            run_max, run_sum, best, best_idx = _fold(base, start + lane, hi, inv_temp, u0,
                                                     run_max, run_sum, best, best_idx, GREEDY, FAST)
            run_max, run_sum, best, best_idx = _fold(base, start + SUB + lane, hi, inv_temp, u1,
                                                     run_max, run_sum, best, best_idx, GREEDY, FAST)
            run_max, run_sum, best, best_idx = _fold(base, start + 2 * SUB + lane, hi, inv_temp, u2,
                                                     run_max, run_sum, best, best_idx, GREEDY, FAST)
            run_max, run_sum, best, best_idx = _fold(base, start + 3 * SUB + lane, hi, inv_temp, u3,
                                                     run_max, run_sum, best, best_idx, GREEDY, FAST)
        top = tl.max(run_max, axis=0)
        total = tl.sum(run_sum * tl.exp(run_max - top), axis=0)
        winner = tl.max(best, axis=0)
        token = tl.min(tl.where(best == winner, best_idx, vocab), axis=0)
        out = row * splits + part
        tl.store(max_ptr + out, top)
        tl.store(sum_ptr + out, total)
        tl.store(key_ptr + out, winner)
        tl.store(idx_ptr + out, token)

    @triton.jit
    def _merge_rows(logits_ptr, stride, vocab, inv_temp, max_ptr, sum_ptr, key_ptr, idx_ptr, splits,
                    tokens_ptr, logprobs_ptr, SPLITS: tl.constexpr):
        row = tl.program_id(0)
        part = tl.arange(0, SPLITS)
        valid = part < splits
        at = row * splits + part
        weight, top = _chunk_weights(max_ptr, sum_ptr, at, valid)
        total = tl.sum(weight, axis=0)
        part_key = tl.load(key_ptr + at, mask=valid, other=_NEG)
        part_idx = tl.load(idx_ptr + at, mask=valid, other=vocab)
        winner = tl.max(part_key, axis=0)
        token = tl.min(tl.where(part_key == winner, part_idx, vocab), axis=0)
        picked = tl.load(logits_ptr + row.to(tl.int64) * stride + token).to(tl.float32) * inv_temp
        tl.store(tokens_ptr + row, token.to(tl.int64))
        tl.store(logprobs_ptr + row, picked - top - tl.log(total))

    @triton.jit
    def _chunk_weights(max_ptr, sum_ptr, at, valid):
        """A row's chunk statistics at ``at`` -> (each chunk's sum of exponentials relative to the
        row's maximum, that maximum)."""
        part_max = tl.load(max_ptr + at, mask=valid, other=_NEG)
        part_sum = tl.load(sum_ptr + at, mask=valid, other=0.0)
        top = tl.max(part_max, axis=0)
        return tl.where(valid, part_sum * tl.exp(part_max - top), 0.0), top

    @triton.jit
    def _chunk_stats(logits_ptr, stride, vocab, chunk, inv_temp, max_ptr, sum_ptr, CHUNK: tl.constexpr):
        # one (row, chunk): the chunk's maximum of logits / T and the sum of exp(. - maximum)
        row = tl.program_id(0)
        part = tl.program_id(1)
        lane = tl.arange(0, CHUNK)
        offs = part * chunk + lane
        ok = (lane < chunk) & (offs < vocab)
        x = tl.load(logits_ptr + row.to(tl.int64) * stride + offs, mask=ok, other=0.0).to(tl.float32) * inv_temp
        x = tl.where(ok, x, _NEG)
        top = tl.max(x, axis=0)
        at = row * tl.num_programs(1) + part
        tl.store(max_ptr + at, top)
        tl.store(sum_ptr + at, tl.sum(tl.where(ok, tl.exp(x - top), 0.0), axis=0))

    @triton.jit
    def _mix32(x):
        # rlcore.rollout.sampling._mix32 in int64 (values below 2^32, products below 2^63): the same bits
        x = x ^ (x >> 16)
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x = x ^ (x >> 15)
        x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
        return x ^ (x >> 16)

    @triton.jit(do_not_specialize=["seed", "key_lo", "key_hi"])
    def _draw_rows(logits_ptr, stride, vocab, chunk, inv_temp, seed, uniforms_ptr, max_ptr, sum_ptr, splits,
                   tokens_ptr, logprobs_ptr, key_lo, key_hi, SPLITS: tl.constexpr, CHUNK: tl.constexpr,
                   KEYED: tl.constexpr, HASHED: tl.constexpr):
        # inverse CDF: one uniform per row (drawn from the seed, given: KEYED, or hashed from the row's
        # key: HASHED, as keyed_uniforms does) picks the chunk whose cumulative weight passes it, then
        # the token inside that chunk (the only logits read again)
        row = tl.program_id(0)
        part = tl.arange(0, SPLITS)
        valid = part < splits
        weight, top = _chunk_weights(max_ptr, sum_ptr, row * splits + part, valid)
        total = tl.sum(weight, axis=0)
        if HASHED:
            key = tl.load(uniforms_ptr + row).to(tl.int64)
            x = _mix32((key & 0xFFFFFFFF) ^ key_lo.to(tl.int64))
            x = _mix32(x ^ ((key >> 32) & 0xFFFFFFFF) ^ key_hi.to(tl.int64))
            uniform = (x >> 8).to(tl.float32) * (1.0 / 16777216.0)
        elif KEYED:
            uniform = tl.load(uniforms_ptr + row)
        else:
            uniform = tl.rand(seed, row)
        target = uniform * total
        # the first chunk whose running total passes the target (rounding: the last one with weight)
        below = tl.sum((tl.cumsum(weight, axis=0) <= target).to(tl.int32), axis=0)
        pick = tl.minimum(below, tl.max(tl.where(weight > 0, part, 0), axis=0))
        rest = target - tl.sum(tl.where(part < pick, weight, 0.0), axis=0)
        base = logits_ptr + row.to(tl.int64) * stride
        lane = tl.arange(0, CHUNK)
        offs = pick * chunk + lane
        ok = (lane < chunk) & (offs < vocab)
        x = tl.load(base + offs, mask=ok, other=0.0).to(tl.float32) * inv_temp
        mass = tl.where(ok, tl.exp(x - top), 0.0)
        inside = tl.sum((tl.cumsum(mass, axis=0) <= rest).to(tl.int32), axis=0)
        token = tl.minimum(pick * chunk + inside, tl.max(tl.where(mass > 0, offs, 0), axis=0))
        picked = tl.load(base + token).to(tl.float32) * inv_temp
        tl.store(tokens_ptr + row, token.to(tl.int64))
        tl.store(logprobs_ptr + row, picked - top - tl.log(total))


def available(device: torch.device) -> bool:
    """Whether the fused kernels can run on ``device``."""
    return triton is not None and device.type == "cuda"


def plan(rows: int, vocab: int, splits: int | None = None) -> tuple[int, int]:
    """``(splits, chunk)``: how many chunks each row is cut into and their width (a multiple of
    :data:`BLOCK`; every chunk holds at least one column)."""
    if splits is None:
        splits = max(1, min(MAX_SPLITS, -(-TARGET_PROGRAMS // max(rows, 1))))
    per = -(-vocab // max(1, splits))
    chunk = -(-per // BLOCK) * BLOCK
    return -(-vocab // chunk), chunk


@torch.library.custom_op("rlcore::sample_rows", mutates_args=())
def sample_rows(logits: torch.Tensor, temperature: float, seed: int, splits: int | None = None,
                fast_math: bool | None = None, num_warps: int | None = None,
                method: str = "cdf", uniforms: torch.Tensor | None = None, keys: torch.Tensor | None = None,
                key_seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy (``temperature <= 0``) or temperature sampling of each row (a ``torch.library`` custom
    operator, ``rlcore::sample_rows``, with a fake implementation).

    Args:
        logits: ``[B, V]`` raw logits, last dimension contiguous (any float dtype).
        seed: per-call noise seed (ignored when greedy).
        splits: chunks per row for greedy and ``"gumbel"`` (default: enough for about
            :data:`TARGET_PROGRAMS` programs); ``"cdf"`` always cuts rows into :data:`DRAW_CHUNK` columns.
        fast_math: ``"gumbel"`` only: the noise through the hardware's approximate logarithm
            (default: on CUDA; the interpreter has only the exact one).
        method: ``"cdf"`` (default): one pass for each chunk's log-sum-exp, then one uniform per row
            finds its token by inverse CDF, re-reading one chunk; ``"gumbel"``: one pass adding
            Gumbel noise to every logit (one random number and two logarithms per logit).
        uniforms: ``[B]`` float32 in ``[0, 1)``: each row's uniform for the inverse-CDF draw instead
            of one drawn from ``seed`` (``method`` is then ``"cdf"``; a caller that keys the draws of a
            sequence by its own position, see :func:`rlcore.rollout.sampling.keyed_uniforms`).
        keys, key_seed: ``[B]`` int64 keys (>= 0): each row's uniform is
            ``keyed_uniforms(key_seed, keys)`` (the same bits), computed inside the kernel instead of by
            some thirty elementwise launches (``uniforms`` must then be None).
    Returns:
        ``(tokens [B] int64, logprobs [B] float32)``, log-probs under ``log_softmax(logits / T)``
        (``T = 1`` when greedy), as :func:`rlcore.rollout.sampling.sample_next` defines them.
    """
    if method not in METHODS:
        raise ValueError(f"fused sampler: method {method!r} is not one of {METHODS}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    dev = logits.device
    greedy = temperature <= 0
    if keys is not None and uniforms is not None:
        raise ValueError("fused sampler: give uniforms or keys, not both")
    draw = (method == "cdf" or uniforms is not None or keys is not None) and not greedy
    splits, chunk = plan(rows, vocab, -(-vocab // DRAW_CHUNK) if draw else splits)
    part = torch.empty(3, rows, splits, dtype=torch.float32, device=dev)
    part_idx = torch.empty(rows, splits, dtype=torch.int32, device=dev)
    tokens = torch.empty(rows, dtype=torch.long, device=dev)
    logprobs = torch.empty(rows, dtype=torch.float32, device=dev)
    inv_temp = 1.0 if greedy else 1.0 / temperature
    if fast_math is None:
        fast_math = not interpreting()
    if num_warps is None:  # measured per method: docs/benchmarks.md, "Settings chosen by measurement"
        num_warps = 4 if draw else 8
    seed = int(seed) & 0x7FFFFFFF
    if draw:
        width = triton.next_power_of_2(chunk)
        _chunk_stats[(rows, splits)](logits, logits.stride(0), vocab, chunk, inv_temp, part[0], part[1],
                                     CHUNK=width, num_warps=num_warps)
        keyed, hashed = uniforms is not None, keys is not None
        given = uniforms.float().contiguous() if keyed else keys.long().contiguous() if hashed else part[0]
        _draw_rows[(rows,)](logits, logits.stride(0), vocab, chunk, inv_temp, seed, given, part[0], part[1], splits,
                            tokens, logprobs, int(key_seed) & 0xFFFFFFFF, (int(key_seed) >> 32) & 0xFFFFFFFF,
                            SPLITS=max(2, triton.next_power_of_2(splits)), CHUNK=width, KEYED=keyed, HASHED=hashed,
                            num_warps=num_warps)
        return tokens, logprobs
    _partial_rows[(rows, splits)](logits, logits.stride(0), vocab, chunk, inv_temp, seed,
                                  part[0], part[1], part[2], part_idx, splits,
                                  GREEDY=greedy, FAST=bool(fast_math), BLOCK=BLOCK, num_warps=num_warps)
    _merge_rows[(rows,)](logits, logits.stride(0), vocab, inv_temp, part[0], part[1], part[2], part_idx, splits,
                         tokens, logprobs, SPLITS=max(2, triton.next_power_of_2(splits)), num_warps=1)
    return tokens, logprobs


@sample_rows.register_fake
def _(logits, temperature, seed, splits=None, fast_math=None, num_warps=None, method="cdf", uniforms=None, keys=None,
      key_seed=0):
    rows = logits.shape[0]
    return (logits.new_empty(rows, dtype=torch.long), logits.new_empty(rows, dtype=torch.float32))

