"""The decode step's parts, one at a time: the fused sampler, decode attention, and a whole loop.

* ``sampler``: :func:`rlcore.kernels.fused_sampling.sample_rows` with the exact and the
  approximate logarithm, several warp counts and row splits;
* ``gemm``: the decode projections as one GEMM or as split-K batched products;
* ``attention``: the decode-attention kernel's tuning knobs, one call per layer, each on its own
  cache (so keys and values come from memory, not L2, as in a real step);
* ``--loop``: device time by kernel over a whole ``generate`` call of the engine, per decode step,
  for one or more engine configurations.

Every part is timed as the median replay of a CUDA graph.

    python bench/bench_decode_parts.py --shapes qwen2-0.5b --loop --loop-variants 'default;{"rope_in_attention": false}'
    python bench/bench_decode_parts.py --shapes qwen2-1.5b --batch 8 --parts none --loop --loop-prompt 4096 --loop-new 257

The second is the few-row decode step of a reasoning rollout's tail (8 rows, 4k-token contexts): its
wall time per step against the device time of its kernels (the difference: gaps between kernels).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from typing import Any

import torch

sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
from _common import environment, graph_ms, import_rlcore, timed, write_json  # noqa: E402
from bench_rollout import SHAPES, build, kernel_times, make_prompts  # noqa: E402 - the rollout benchmark's parts

import_rlcore()

from rlcore.kernels import decode_attention, fused_sampling  # noqa: E402


def bench_sampler(batch: int, vocab: int) -> list[dict[str, Any]]:
    logits = torch.randn(batch, vocab, device="cuda", dtype=torch.bfloat16) * 3
    rows = []
    for warps in (4, 8):
        us = graph_ms(lambda: fused_sampling.sample_rows(logits, 1.0, 7, num_warps=warps, method="cdf")) * 1e3
        rows.append({"method": "cdf", "num_warps": warps, "us": us})
        print(f"    sampler cdf warps={warps}: {us:7.1f} us", flush=True)
    for fast, warps, splits in itertools.product((False, True), (4, 8), (None, 8, 16)):
        us = graph_ms(lambda: fused_sampling.sample_rows(logits, 1.0, 7, splits=splits, fast_math=fast,
                                                         num_warps=warps, method="gumbel")) * 1e3
        rows.append({"method": "gumbel", "fast_math": fast, "num_warps": warps, "splits": splits, "us": us})
        print(f"    sampler gumbel fast={fast} warps={warps} splits={splits}: {us:7.1f} us", flush=True)
    a, _ = fused_sampling.sample_rows(logits, 1.0, 7, fast_math=False, method="gumbel")
    b, _ = fused_sampling.sample_rows(logits, 1.0, 7, fast_math=True, method="gumbel")
    rows.append({"tokens_equal_fraction": float((a == b).float().mean())})
    print(f"    gumbel, exact vs approximate log: {rows[-1]['tokens_equal_fraction']:.4f} of tokens equal", flush=True)
    # the two methods draw from the same distribution: compare the mean log-probability of the drawn tokens
    means = {m: float(torch.stack([fused_sampling.sample_rows(logits, 1.0, seed, method=m)[1]
                                   for seed in range(16)]).mean()) for m in fused_sampling.METHODS}
    rows.append({"mean_logprob_of_draw": means})
    print(f"    mean log-prob of the drawn tokens: {means}", flush=True)
    return rows


#: block_n 64 (the default for head dim 64); 32/64/128, 1-4 chunks, a 128-register cap and the merge kernel were
#: swept at commit 1b0714d (bench/results/history/decode_parts_h200_run8_attention_sweep.json)
#: loading the first block before the RoPE work ("peel", commit f594770) was slower at every setting
#: (bench/results/history/decode_parts_h200_run9_attention.json)
ATTENTION_SWEEPS = {
    "rope": [dict(rope_rows=rope_rows, num_warps=warps, num_stages=stages)
             for rope_rows, warps, stages in itertools.product((False, True), (2, 4, 8), (2, 3))],
    # columns per block against warps and pipeline stages (RoPE rows gathered once)
    "blocks": [dict(block_n=block, num_warps=warps, num_stages=stages)
               for block, warps, stages in itertools.product((16, 32, 64, 128), (2, 4), (1, 2, 3, 4))],
    # samples of one prompt (8 a prompt, the prompt in the first 128 columns) reading it from one row
    "shared": [dict(share="rows")],
    # more programs per multiprocessor: the columns cut into chunks, fewer pipeline stages
    "splits": [dict(splits=splits, num_stages=stages, share="rows") for splits, stages in itertools.product((1, 2), (1, 2))],
}


def bench_attention(shape: str, batch: int, layers: int, lengths=(64, 192, 320),
                    sweep: str = "rope") -> list[dict[str, Any]]:
    """The decode step's attention kernel as the engine calls it (RoPE, cache write and attention,
    :func:`rlcore.kernels.decode_attention.attend_new`), one call per layer, each on its own cache
    (keys and values come from memory, not L2). Each slot's new column lies in the last 64 columns
    below the attended length, as in a step of a 64-column length bucket. The floor is the keys
    and values read at copy bandwidth. ``rope_rows``: the RoPE rows gathered once beforehand
    (once a step in the engine, not timed here)."""
    from _common import copy_bandwidth

    spec = SHAPES[shape]
    heads, kv_heads = spec["num_attention_heads"], spec["num_key_value_heads"]
    dim = spec["hidden_size"] // heads
    columns_total = max(lengths) + 64
    caches = [torch.randn(2, batch, kv_heads, columns_total, dim, device="cuda", dtype=torch.bfloat16)
              for _ in range(layers)]
    proj = torch.randn(batch, (heads + 2 * kv_heads) * dim, device="cuda", dtype=torch.bfloat16)
    bias = torch.zeros(batch, columns_total, device="cuda", dtype=torch.bfloat16)
    cos, sin = torch.randn(2, columns_total, dim, device="cuda")
    bandwidth = copy_bandwidth()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    group_rows = [slot - slot % 8 for slot in range(batch)]
    share_source = torch.tensor(group_rows, dtype=torch.int32, device="cuda")
    for length in lengths:
        at = length - 1 - torch.randint(0, 64, (batch,), device="cuda", generator=gen)
        # the prompt: the first 128 columns, or all below the last 64 (every new column after it)
        prompt = min(128, length - 64)
        share_end = torch.full((batch,), prompt, dtype=torch.int32, device="cuda")
        sharing = {"rows": (share_source, share_end)}
        floor_us = float((at + 1).sum()) * kv_heads * dim * 2 * 2 / bandwidth * 1e6
        found = []
        rows_cos, rows_sin = cos[at], sin[at]
        for tuning in [{}] + ATTENTION_SWEEPS[sweep]:
            kwargs = {k: v for k, v in tuning.items() if k not in ("rope_rows", "share")}
            if tuning.get("share"):
                kwargs["shared"] = sharing[tuning["share"]]
            rope = (rows_cos, rows_sin, None) if tuning.get("rope_rows", True) else (cos, sin, at)

            def fn():
                for layer in caches:
                    decode_attention.attend_new(proj, layer, bias, length, *rope, at, heads, kv_heads, **kwargs)
            try:
                us = graph_ms(fn, repeats=10) * 1e3 / layers
            except Exception as error:  # noqa: BLE001 - a setting that does not compile is skipped
                print(f"    attention {shape} length {length} {tuning}: {type(error).__name__}", flush=True)
                continue
            found.append({"shape": shape, "batch": batch, "length": length, "tuning": tuning or "default",
                          "us": us, "floor_us": floor_us})
        default = found[0]["us"]
        found.sort(key=lambda r: r["us"])
        print(f"    attention {shape}/{batch} length {length}: default {default:6.2f} us/layer, floor {floor_us:5.2f}",
              flush=True)
        for r in found[:8]:
            print(f"      {r['us']:6.2f} us  {r['tuning']}", flush=True)
        rows += found
    return rows


def bench_gemm(shape: str, batch: int, layers: int) -> list[dict[str, Any]]:
    """The decode projections at ``batch`` rows: one library GEMM against split-K batched products
    (:func:`rlcore.rollout.engine.decode._partials`), each over ``layers`` weight copies (from memory, not L2)."""
    from rlcore.rollout.engine.decode import _partials

    spec = SHAPES[shape]
    hidden, inter, heads, kv_heads = (spec["hidden_size"], spec["intermediate_size"], spec["num_attention_heads"],
                                      spec["num_key_value_heads"])
    qkv = hidden + 2 * kv_heads * (hidden // heads)
    rows = []
    for name, (out_f, in_f) in {"qkv": (qkv, hidden), "o": (hidden, hidden), "gate_up": (2 * inter, hidden),
                                "down": (hidden, inter)}.items():
        weights = [torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
        x = torch.randn(batch, in_f, device="cuda", dtype=torch.bfloat16)
        floor_us = out_f * in_f * 2 / 3.3e12 * 1e6
        for splits in (1, 2, 3, 4, 6, 8):
            if in_f % splits:
                continue
            us = graph_ms(lambda: [_partials(x, w, None, splits) for w in weights], repeats=10) * 1e3 / layers
            rows.append({"shape": shape, "gemm": name, "splits": splits, "us": us, "weight_floor_us": floor_us})
            print(f"    gemm {shape} {name:8s} [{batch}x{in_f}]x[{in_f}x{out_f}] splits={splits}: {us:6.2f} us "
                  f"(weights at 3.3 TB/s: {floor_us:5.2f})", flush=True)
        # the transposed product (weight x input^T): the library picks its tiles for a tall, narrow output
        us = graph_ms(lambda: [torch.mm(w, x.t()) for w in weights], repeats=10) * 1e3 / layers
        rows.append({"shape": shape, "gemm": name, "transposed": True, "us": us, "weight_floor_us": floor_us})
        print(f"    gemm {shape} {name:8s} transposed: {us:6.2f} us", flush=True)
    return rows


def loop_profile(shape: str, batch: int, prompt: int, new: int, engine_kwargs: dict) -> dict[str, Any]:
    """Device time by kernel over one ``generate`` call of the engine, per decode step."""
    from rlcore.rollout.base import SamplingParams
    from rlcore.rollout.engine import RolloutEngine

    model = build(shape, "cuda").eval()
    engine = RolloutEngine(model, max_batch_size=batch, max_seq_len=prompt + new, **engine_kwargs)
    prompts = make_prompts(batch // 8, 8, prompt, SHAPES[shape]["vocab_size"])
    params = SamplingParams(max_new_tokens=new, temperature=1.0, seed=0)
    engine.warmup([batch])

    def generate():
        return engine.generate(prompts, params)

    generate()  # first call: prefill shapes, sampler
    wall, _ = timed(generate)
    by_name = kernel_times(generate, width=80)
    steps = new - 1
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:25]
    out = {"shape": shape, "batch": batch, "wall_s": wall, "wall_ms_per_step": wall * 1e3 / steps,
           "kernel_ms_per_step": sum(sum(v) for v in by_name.values()) / steps,
           "top": [{"name": k, "calls_per_step": len(v) / steps, "ms_per_step": sum(v) / steps} for k, v in top]}
    print(f"    loop {shape}/{batch}: wall {out['wall_ms_per_step']:.3f} ms/step, kernels "
          f"{out['kernel_ms_per_step']:.3f} ms/step", flush=True)
    for item in out["top"]:
        print(f"      {item['ms_per_step']:7.4f} ms  x{item['calls_per_step']:<6.1f} {item['name']}", flush=True)
    engine = model = None  # free the GPU memory (the closures above refer to them)
    torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen2-0.5b", help="comma-separated: " + ",".join(SHAPES))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--parts", default="sampler,attention", help="sampler,attention,gemm (any, or none)")
    parser.add_argument("--loop", action="store_true", help="profile a whole generate call per shape")
    parser.add_argument("--loop-variants", default="default",
                        help='engine variants for --loop, separated by ";": "default" or RolloutEngine keywords '
                             'as JSON, e.g. default;{"rope_in_attention": false}; "fp_fusion": true compiles '
                             'the attention kernel with Triton\'s fused multiply-adds; "pv_precision": "tf32" '
                             'keeps its probabilities at TF32 for the value product')
    parser.add_argument("--loop-new", type=int, default=65, help="new tokens per sequence in --loop")
    parser.add_argument("--loop-prompt", type=int, default=128,
                        help="prompt tokens per sequence in --loop (a reasoning rollout's tail: --batch 8 "
                             "--loop-prompt 4096, few rows with long contexts)")
    parser.add_argument("--attention-sweep", default="rope", choices=sorted(ATTENTION_SWEEPS),
                        help="attention kernel settings to time with --parts attention")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode_parts: needs a CUDA GPU", file=sys.stderr)
        return 2
    parts = set(args.parts.split(","))
    results: dict[str, Any] = {"env": environment(), "command": " ".join(sys.argv), "sampler": [],
                               "attention": [], "gemm": [], "loop": []}
    for shape in args.shapes.split(","):
        layers = SHAPES[shape]["num_hidden_layers"]
        if "gemm" in parts:
            results["gemm"] += bench_gemm(shape, args.batch, layers)
            write_json(args.out, results)
        if "attention" in parts:
            results["attention"] += bench_attention(shape, args.batch, layers, sweep=args.attention_sweep)
            write_json(args.out, results)  # after each part: a later failure loses nothing
        if args.loop:
            for variant in args.loop_variants.split(";"):
                kwargs = {} if variant == "default" else json.loads(variant)
                from rlcore.kernels import decode_attention

                saved = decode_attention.FP_FUSION, decode_attention.PV_PRECISION
                # "fp_fusion": the attention kernel's enable_fp_fusion; "pv_precision": its value product's
                decode_attention.FP_FUSION = bool(kwargs.pop("fp_fusion", saved[0]))
                decode_attention.PV_PRECISION = kwargs.pop("pv_precision", saved[1])
                try:
                    profiled = loop_profile(shape, args.batch, args.loop_prompt, args.loop_new, kwargs)
                finally:
                    decode_attention.FP_FUSION, decode_attention.PV_PRECISION = saved
                results["loop"].append({"variant": variant, **profiled})
                write_json(args.out, results)  # after each part: a later failure loses nothing
    if "sampler" in parts:
        results["sampler"] = bench_sampler(args.batch, SHAPES["qwen2-0.5b"]["vocab_size"])
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
