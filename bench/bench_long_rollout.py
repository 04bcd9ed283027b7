"""Long, variable-length rollouts through the engine's paged KV cache (a reasoning-like workload).

Workload: random-init Qwen2.5 shapes in bf16, 32 prompts x 8 samples, prompt lengths drawn
uniformly from 64-512 tokens, temperature-1 sampling, responses capped at 8,192 tokens and ended
by a *set* of EOS ids: a random-init model's next-token distribution is close to uniform, so ``k``
EOS ids out of a vocabulary of ``V`` stop a sequence with probability about ``k / V`` a step, and
``k = V / mean`` gives lengths of about geometric law with that mean (1,500 by default: a long
tail, a few samples reach the cap).

Reported per shape (one ``generate`` call after a warm-up call):

* new tokens per second and the response-length distribution actually drawn;
* KV memory: the peak of pages in use against the static layout's
  ``[layers, 2, slots, kv_heads, max_seq_len, head_dim]`` and the pool allocated;
* every decode step's device time (CUDA events between step starts: decode, sampling and
  bookkeeping; steps with a prefill or a page-table update in between are left out) against its
  memory floor at its live context, ``(weight bytes + live KV bytes) / measured copy bandwidth``
  (live KV: the prompt and generated tokens of the live slots), as a distribution of the ratio
  (p50 / p90 / max, and the share of steps within 2x);
* ``rollout/preemptions``.

Run (GPU, about 5 minutes):
    python bench/bench_long_rollout.py --shapes qwen2.5-1.5b,qwen2.5-7b --out bench/results/long_rollout.json
Smoke test (CPU, tiny shape, seconds; the numbers mean nothing):
    python bench/bench_long_rollout.py --tiny --out /tmp/long.json
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import environment, import_rlcore, write_json  # noqa: E402

import_rlcore()
from _models import random_model  # noqa: E402
from rlcore.rollout.base import SamplingParams  # noqa: E402
from rlcore.rollout.engine import RolloutEngine  # noqa: E402
from rlcore.rollout.engine import scheduler as scheduler_module  # noqa: E402

def build(shape: str, device: str, dtype: torch.dtype):
    """A random-init model of ``shape`` (:data:`_models.SHAPES`) with no EOS of its own: the workload's stop ids decide."""
    return random_model(shape, dtype, device, bos_token_id=None, eos_token_id=None)


def workload(prompts: int, samples: int, low: int, high: int, vocab: int, mean: int,
             seed: int = 0) -> tuple[list[list[int]], tuple[int, ...]]:
    """``samples`` copies of ``prompts`` random prompts of lengths in ``[low, high]``, and the EOS ids
    (``vocab // mean`` of them, drawn from the vocabulary) that give responses of about ``mean`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (prompts,), generator=gen).tolist()
    base = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
    eos = torch.randperm(vocab, generator=gen)[:max(1, round(vocab / mean))].tolist()
    return [p for p in base for _ in range(samples)], tuple(sorted(eos))


class StepClock:
    """Times every decode step of one ``generate`` call and records its live context.

    Wraps ``engine._decode``: each call records an event (CUDA) or a host time (CPU) and the live
    tokens (prompt + generated of every live slot, read from the scheduler's host bookkeeping).
    A step's time is the gap to the next step's start; gaps with a prefill or a page-table update
    in between (the scheduler's admission / growth) are dropped."""

    def __init__(self, engine: RolloutEngine):
        self.engine, self.cuda = engine, engine.device.type == "cuda"
        self.marks: list[Any] = []
        self.live_tokens: list[int] = []
        self.clean: list[bool] = []
        self.scheduler = None
        self._dirty = False

    def __enter__(self):
        engine, clock = self.engine, self
        plain_decode, plain_prefill, plain_add = engine._decode, engine._prefill, getattr(engine, "_add_pages", None)
        plain_init = scheduler_module.Scheduler.__init__

        def init(sched, *args, **kwargs):
            plain_init(sched, *args, **kwargs)
            clock.scheduler = sched

        def decode(n, length):
            sched = clock.scheduler
            tokens = sum(len(sched.prompts[sched.slot_req[s]]) + sched.steps - sched.born[s] for s in sched.live)
            clock._mark(tokens)
            return plain_decode(n, length)

        def prefill(*args, **kwargs):
            clock._dirty = True
            return plain_prefill(*args, **kwargs)

        def add_pages(*args, **kwargs):
            clock._dirty = True
            return plain_add(*args, **kwargs)

        self._saved = (plain_decode, plain_prefill, plain_add, plain_init)
        engine._decode, engine._prefill = decode, prefill
        if plain_add is not None:
            engine._add_pages = add_pages
        scheduler_module.Scheduler.__init__ = init
        return self

    def __exit__(self, *exc):
        scheduler_module.Scheduler.__init__ = self._saved[3]
        for name in ("_decode", "_prefill", "_add_pages"):  # back to the class's methods
            self.engine.__dict__.pop(name, None)
        self._mark(0)  # the end of the last step
        return False

    def _mark(self, tokens: int) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())
        self.live_tokens.append(tokens)
        self.clean.append(not self._dirty)
        self._dirty = False

    def steps(self) -> list[tuple[float, int]]:
        """``(seconds, live tokens)`` of every clean step."""
        if self.cuda:
            torch.cuda.synchronize()
            gaps = [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        else:
            gaps = [b - a for a, b in zip(self.marks, self.marks[1:])]
        # step i runs from mark i to mark i + 1; it is clean when nothing ran between (mark i + 1 clean)
        return [(gap, self.live_tokens[i]) for i, gap in enumerate(gaps) if self.clean[i + 1]]


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second of a large copy (1 GiB on CUDA, 64 MiB on CPU)."""
    numel = 2**28 if device.type == "cuda" else 2**24
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - begin)
    times.sort()
    return 2 * numel * 4 / times[len(times) // 2]


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def run_shape(shape: str, args, device: torch.device, bandwidth: float) -> dict[str, Any]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build(shape, str(device), dtype)
    config = model.config
    prompts, eos = workload(args.prompts, args.samples, args.prompt_min, args.prompt_max, config.vocab_size,
                            args.mean_new, args.seed)
    max_seq_len = args.prompt_max + args.max_new
    engine_kwargs = dict(page_size=args.page_size)
    if args.kv_memory_fraction is not None:
        engine_kwargs["kv_memory_fraction"] = args.kv_memory_fraction
    engine = RolloutEngine(model, max_batch_size=len(prompts), max_seq_len=max_seq_len, **engine_kwargs)
    params = SamplingParams(max_new_tokens=args.max_new, temperature=1.0, seed=args.seed, eos_token_ids=eos,
                            pad_token_id=0)
    warm_s = time.perf_counter()  # every graph captured (and the step compiled) before the timed call
    engine.warmup()
    engine.generate(prompts[:min(len(prompts), 16)], SamplingParams(max_new_tokens=8, temperature=1.0, seed=1))
    warm_s = time.perf_counter() - warm_s
    if device.type == "cuda":
        torch.cuda.synchronize()
    with StepClock(engine) as clock:
        begin = time.perf_counter()
        batch = engine.generate(prompts, params)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - begin
    spec = engine.spec
    item = torch.empty(0, dtype=engine.dtype).element_size()
    token_bytes = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * item
    seen, weight_bytes = set(), 0
    for tensor in engine.weights.tensors():
        if tensor is not None and tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            weight_bytes += tensor.numel() * tensor.element_size()
    ratios = [sec / ((weight_bytes + tokens * token_bytes) / bandwidth) for sec, tokens in clock.steps()]
    lengths = batch.response_mask.sum(-1).float()
    stats = batch.stats
    row = {
        "shape": shape, "prompts": args.prompts, "samples": args.samples, "max_seq_len": max_seq_len,
        "page_size": engine.page_size, "eos_ids": len(eos), "seconds": seconds, "warmup_s": warm_s,
        "new_tokens": stats["rollout/new_tokens"], "tokens_per_s": stats["rollout/new_tokens"] / seconds,
        "response_len": {"mean": float(lengths.mean()), "p50": float(lengths.median()),
                         "p90": float(lengths.quantile(0.9)), "max": float(lengths.max()),
                         "at_cap": int((lengths >= args.max_new).sum())},
        "decode_steps": stats["rollout/decode_steps"], "prefill_calls": stats["rollout/prefill_calls"],
        "preemptions": stats["rollout/preemptions"],
        "kv_peak_bytes": stats["rollout/kv_bytes_peak"], "kv_pool_bytes": engine.kv_bytes,
        "kv_static_bytes": len(prompts) * max_seq_len * token_bytes, "weight_bytes": weight_bytes,
        "step_floor_ratio": {"p50": quantile(ratios, 0.5), "p90": quantile(ratios, 0.9),
                             "max": max(ratios, default=float("nan")),
                             "within_2x": sum(r <= 2 for r in ratios) / max(1, len(ratios)), "steps": len(ratios)},
        "step_ratios": ratios if args.keep_steps else None,
        "cuda_graphs": engine.use_cuda_graphs, "compiled": engine.compile, "attention": engine.attention,
    }
    del engine, model, batch
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen2.5-1.5b,qwen2.5-7b")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-min", type=int, default=64)
    parser.add_argument("--prompt-max", type=int, default=512)
    parser.add_argument("--mean-new", type=int, default=1500, help="mean response length the EOS set aims at")
    parser.add_argument("--max-new", type=int, default=8192)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--kv-memory-fraction", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-steps", action="store_true", help="write every step's ratio to the JSON")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny shape, short sequences")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.tiny:
        args.shapes, args.prompts, args.samples = "tiny-qwen2", 4, 2
        args.prompt_min, args.prompt_max, args.mean_new, args.max_new, args.page_size = 8, 24, 24, 64, 16
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    bandwidth = copy_bandwidth(device)
    rows = []
    for shape in args.shapes.split(","):
        print(f"== {shape}", flush=True)
        try:
            rows.append(run_shape(shape, args, device, bandwidth))
        except Exception as error:  # noqa: BLE001 - the other shapes still run; the error is recorded
            rows.append({"shape": shape, "error": f"{type(error).__name__}: {str(error)[:500]}"})
            print(f"   failed: {rows[-1]['error']}", flush=True)
        write_json(args.out, {"env": environment(), "command": " ".join(sys.argv), "device": str(device),
                              "copy_bytes_per_s": bandwidth, "rows": rows})
    print(f"\ncopy bandwidth {bandwidth / 1e9:.0f} GB/s; step/floor = step time over (weights + live KV) / bandwidth")
    print(f"{'shape':<14} {'tok/s':>9} {'mean len':>8} {'max':>5} {'KV peak GiB':>11} {'static GiB':>10} "
          f"{'pool GiB':>8} {'preempt':>7} | {'p50':>5} {'p90':>5} {'max':>6} {'<=2x':>5}")
    for row in rows:
        if "error" in row:
            print(f"{row['shape']:<14} error: {row['error'][:80]}")
            continue
        r, gib = row["step_floor_ratio"], 2**30
        print(f"{row['shape']:<14} {row['tokens_per_s']:>9.0f} {row['response_len']['mean']:>8.0f} "
              f"{row['response_len']['max']:>5.0f} {row['kv_peak_bytes'] / gib:>11.2f} "
              f"{row['kv_static_bytes'] / gib:>10.2f} {row['kv_pool_bytes'] / gib:>8.2f} {row['preemptions']:>7.0f} | "
              f"{r['p50']:>5.2f} {r['p90']:>5.2f} {r['max']:>6.2f} {r['within_2x']:>5.0%}")
    return 0 if all("error" not in row for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
