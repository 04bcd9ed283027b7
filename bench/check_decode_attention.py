"""Decode attention on the GPU: the Triton kernel (``attention="triton"``) against cuDNN/SDPA.

For Qwen2-0.5B and 1.5B decode shapes (bf16, batches 256 and 64, attended length 320 of a
384-column cache, ragged key masks, q a strided view of a projection as in the decode step):

1. accuracy: max abs difference of the kernel (default split rule and unsplit) to
   ``decode.attend(kind="sdpa")`` and to a float32 reference;
2. speed: one CUDA graph per method replaying ``attend`` over every layer of a full cache (so the
   keys and values come from memory, not L2, as in the real step), timed with CUDA events; the
   median over ``--repeats`` gives microseconds per layer, next to the floor of reading that
   layer's keys and values at ``--bandwidth-gbs`` (default: measured copy bandwidth).

Kernel variants (``--variants``): the default plan, fixed split counts, other ``block_n`` and
``num_warps``, to check the split rule and the tuning. One JSON line per case is printed and
all of them are written to ``--out``.

Run (GPU): python bench/check_decode_attention.py
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import sys
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import copy_bandwidth, environment, graph_ms, import_rlcore, write_json  # noqa: E402

import_rlcore()
from rlcore.kernels import decode_attention  # noqa: E402
from rlcore.rollout.engine import decode  # noqa: E402

#: name -> (layers, kv heads, query heads per kv head, head dim)
SHAPES = {"qwen2-0.5b": (24, 2, 7, 64), "qwen2-1.5b": (28, 2, 6, 128)}
#: name -> keyword arguments of decode_attention.attend
VARIANTS = {
    "triton": {},
    "triton_split1": {"splits": 1},
    "triton_split2": {"splits": 2},
    "triton_split4": {"splits": 4},
    "triton_block32": {"block_n": 32},
    "triton_block128": {"block_n": 128},
    "triton_warps8": {"num_warps": 8},
    "triton_warps2": {"num_warps": 2},
}


def make_inputs(shape: str, batch: int, length: int, columns: int, seed: int = 0) -> dict[str, Any]:
    """A full cache ``[L, 2, B, KVH, S, D]``, q ``[B, KVH, G, D]`` (strided view) and a ragged ``[B, S]`` mask."""
    layers, kv_heads, group, dim = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cache = torch.randn(layers, 2, batch, kv_heads, columns, dim, device="cuda", generator=gen,
                        dtype=torch.bfloat16)
    proj = torch.randn(batch, (kv_heads * group + kv_heads) * dim, device="cuda", generator=gen,
                       dtype=torch.bfloat16)
    q = proj.view(batch, -1, dim)[:, :kv_heads * group].reshape(batch, kv_heads, group, dim)
    filled = torch.randint(length - 63, length + 1, (batch,), device="cuda", generator=gen)
    pad = torch.randint(0, 48, (batch,), device="cuda", generator=gen)
    col = torch.arange(columns, device="cuda")
    visible = (col[None] < filled[:, None]) & (col[None] >= pad[:, None])
    bias = torch.zeros(batch, columns, device="cuda", dtype=torch.bfloat16).masked_fill_(~visible, float("-inf"))
    return {"cache": cache, "q": q, "bias": bias, "length": length}


def accuracy(inputs: dict[str, Any]) -> dict[str, float]:
    q, layer, bias, length = inputs["q"], inputs["cache"][0], inputs["bias"], inputs["length"]
    sdpa = decode.attend(q, layer, bias, length, "sdpa").float()
    ref = decode_attention.reference(q, layer, bias, length)
    out = {"sdpa_vs_fp32": float((sdpa - ref).abs().max())}
    for name, kwargs in (("triton", {}), ("triton_split1", {"splits": 1})):
        got = decode_attention.attend(q, layer, bias, length, **kwargs).float()
        out[f"{name}_vs_sdpa"] = float((got - sdpa).abs().max())
        out[f"{name}_vs_fp32"] = float((got - ref).abs().max())
    return out


def graph_us_per_layer(call: Callable[[int], Any], layers: int, repeats: int, replays: int = 10) -> float:
    """Median microseconds per layer of a CUDA graph calling ``call(i)`` for every layer."""
    def every_layer():
        for i in range(layers):
            call(i)
    return graph_ms(every_layer, repeats, replays, warmup=1) * 1e3 / layers


def run_case(shape: str, batch: int, args, bandwidth: float) -> dict[str, Any]:
    inputs = make_inputs(shape, batch, args.length, args.columns)
    layers, kv_heads, group, dim = SHAPES[shape]
    q, cache, bias, length = inputs["q"], inputs["cache"], inputs["bias"], inputs["length"]
    kv_bytes = 2 * batch * kv_heads * length * dim * cache.element_size()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits, _ = decode_attention.plan(batch * kv_heads, length, sms)
    row: dict[str, Any] = {"shape": shape, "batch": batch, "length": length, "dtype": "bf16", "default_splits": splits,
                           "kv_mb_per_layer": kv_bytes / 1e6, "floor_us": kv_bytes / bandwidth * 1e6,
                           "accuracy": accuracy(inputs), "us_per_layer": {}}
    methods: dict[str, Callable[[int], Any]] = {
        "sdpa": lambda i: decode.attend(q, cache[i], bias, length, "sdpa")}
    for name in args.variants.split(","):
        kwargs = VARIANTS[name]
        methods[name] = lambda i, kwargs=kwargs: decode_attention.attend(q, cache[i], bias, length, **kwargs)
    for name, call in methods.items():
        try:
            row["us_per_layer"][name] = round(graph_us_per_layer(call, layers, args.repeats), 2)
        except Exception as error:  # noqa: BLE001 - one failing variant does not stop the others
            row["us_per_layer"][name] = f"error: {error!r}"[:300]
    timed = {k: v for k, v in row["us_per_layer"].items() if isinstance(v, float)}
    if "sdpa" in timed and "triton" in timed:
        row["triton_speedup_vs_sdpa"] = round(timed["sdpa"] / timed["triton"], 3)
    if timed:
        best = min(timed, key=timed.get)
        row["best"], row["best_over_floor"] = best, round(timed[best] / row["floor_us"], 3)
    inputs = q = cache = bias = None  # free the GPU memory (the closures above refer to them)
    torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--batches", default="256,64")
    parser.add_argument("--length", type=int, default=320, help="attended columns (a length bucket)")
    parser.add_argument("--columns", type=int, default=384, help="cache columns per slot")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--bandwidth-gbs", type=float, default=None,
                        help="memory bandwidth (GB/s) for the floor; default: measured copy bandwidth")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"kernel variants, from {', '.join(VARIANTS)}")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT") or tempfile.gettempdir(),
                                                      "check_decode_attention.json"))
    args = parser.parse_args(argv)
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    unknown += [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown shapes/variants {unknown}")
    if not 0 < args.length <= args.columns:
        parser.error(f"--length {args.length} must be in 1..--columns {args.columns}")
    if not torch.cuda.is_available() or not decode_attention.available("cuda"):
        print("check_decode_attention: needs a CUDA device and Triton", file=sys.stderr)
        return 2
    bandwidth = args.bandwidth_gbs * 1e9 if args.bandwidth_gbs else copy_bandwidth()
    payload: dict[str, Any] = {"env": environment(), "command": " ".join(sys.argv),
                               "bandwidth_bytes_per_s": bandwidth, "cases": []}
    for shape in args.shapes.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            row = run_case(shape, batch, args, bandwidth)
            payload["cases"].append(row)
            print(json.dumps(row), flush=True)
            write_json(args.out, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
