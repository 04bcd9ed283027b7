"""Host time of the training attention on shapes it has not seen: each SDPA backend's first forward
and backward at a new ``(rows, width)`` against a second call at the same shape.

A reasoning update's micro-batches come in new shapes every step (rows x width, widths in
multiples of 8). A backend that builds a plan per shape (cuDNN builds an execution graph for the
forward and one for the backward) pays that on the host at each new shape while the device waits.
This probe draws micro-batch shapes like the update's (about ``--tokens`` tokens, widths from
``--min-width`` to ``--max-width``), runs the attention of one decoder layer of the Qwen2-1.5B shape
(12 query heads, 2 key/value heads, head dim 128, causal, bf16) forward and backward per backend,
and reports per backend the median time of the first call at a shape, of a repeat, and their
difference (the host's per-shape cost). Each backend runs in a fresh process (``--one`` is the
worker), so nothing one builds helps another; ``cudnn-ragged`` is cuDNN with
``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1`` (PyTorch's opt-in path that keeps one graph across sequence
lengths).

    python3 bench/probes/sdpa_shapes.py [--shapes 12] [--backends cudnn,cudnn-ragged,flash,efficient] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

BACKENDS = ("cudnn", "cudnn-ragged", "flash", "efficient")


def draw_shapes(count: int, tokens: int, min_width: int, max_width: int, seed: int) -> list[tuple[int, int]]:
    import random

    rng = random.Random(seed)
    shapes = []
    while len(shapes) < count:
        width = rng.randrange(min_width, max_width + 1) // 8 * 8
        shape = (max(1, tokens // width), width)
        if shape not in shapes:
            shapes.append(shape)
    return shapes


def worker(backend: str, shapes: list[tuple[int, int]], heads: int, kv_heads: int, dim: int) -> dict:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kind = {"cudnn": SDPBackend.CUDNN_ATTENTION, "cudnn-ragged": SDPBackend.CUDNN_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]

    def once(rows: int, width: int) -> float:
        # as Hugging Face lays them out: [B, S, H, D] storage seen as [B, H, S, D]
        q = torch.randn(rows, width, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(rows, width, kv_heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        v = torch.randn_like(k)
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        for t in (q, k, v):
            t.requires_grad_(True)
        grad = torch.randn(rows, width, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        torch.cuda.synchronize()
        start = time.perf_counter()
        with sdpa_kernel([kind]):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    once(2, 256)  # the library's own start-up, not a shape's cost
    first, again = [], []
    for rows, width in shapes:
        first.append(once(rows, width))
        again.append(once(rows, width))
    return {"backend": backend, "first_ms": [1e3 * s for s in first], "again_ms": [1e3 * s for s in again],
            "first_median_ms": 1e3 * statistics.median(first), "again_median_ms": 1e3 * statistics.median(again),
            "host_per_shape_ms": 1e3 * statistics.median(f - a for f, a in zip(first, again))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=int, default=12, help="new micro-batch shapes per backend")
    p.add_argument("--tokens", type=int, default=32768, help="tokens of a micro-batch (rows x width)")
    p.add_argument("--min-width", type=int, default=512)
    p.add_argument("--max-width", type=int, default=8704)
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    shapes = draw_shapes(args.shapes, args.tokens, args.min_width, args.max_width, args.seed)
    if args.one:
        print(json.dumps(worker(args.one, shapes, 12, 2, 128)))
        return
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from _common import environment

    results = []
    for backend in [b for b in args.backends.split(",") if b]:
        if backend not in BACKENDS:
            raise SystemExit(f"--backends: unknown backend {backend!r} (known: {', '.join(BACKENDS)})")
        env = dict(os.environ)
        if backend == "cudnn-ragged":
            env["TORCH_CUDNN_SDPA_AVOID_RECOMPILE"] = "1"
        cmd = [sys.executable, os.path.abspath(__file__), "--one", backend, "--shapes", str(args.shapes),
               "--tokens", str(args.tokens), "--min-width", str(args.min_width), "--max-width",
               str(args.max_width), "--seed", str(args.seed)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            results.append({"backend": backend, "error": done.stderr.strip().splitlines()[-1:]})
            print(f"{backend:13s} failed: {done.stderr.strip().splitlines()[-1:]}")
            continue
        row = json.loads(done.stdout.strip().splitlines()[-1])
        results.append(row)
        print(f"{backend:13s} first {row['first_median_ms']:8.2f} ms  again {row['again_median_ms']:8.2f} ms  "
              f"host per new shape {row['host_per_shape_ms']:8.2f} ms")
    out = {"environment": environment(), "shapes": shapes, "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
