"""The decode step's parts, one at a time, side by side: matrix products, sampler, attention.

For each projection of a decode step (q/k/v, o, gate/up, down) at the given batch, the library
GEMM the step uses by default (with its epilogue: bias, residual add, SiLU·mul) is timed against
:mod:`rlcore.rollout.decode_gemm`'s Triton kernel with the default tile rule and with each tile
configuration of a small sweep. Every measurement is a CUDA graph of one call per layer, each on
its own weight copy (so the weights come from memory, not L2, as in a real step); the median of
the replays is reported per call. The fused sampler (exact vs approximate logarithm) and the
decode-attention kernel's tuning knobs are timed the same way, and ``--loop`` profiles a whole
``generate`` call of the engine (device time by kernel and per decode step).

    python bench/bench_decode_parts.py --shapes qwen2-0.5b,qwen2-1.5b --batch 256 --loop --out parts.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from typing import Any, Callable

import torch

sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
from _common import environment, import_rlcore  # noqa: E402

import_rlcore()

from rlcore.rollout import decode_attention, decode_gemm, fused_sampling  # noqa: E402

SHAPES = {  # hidden, layers, heads, kv heads, intermediate, vocabulary
    "qwen2-0.5b": (896, 24, 14, 2, 4864, 151936),
    "qwen2-1.5b": (1536, 28, 12, 2, 8960, 151936),
}


def graph_ms(fn: Callable[[], Any], replays: int = 20) -> float:
    """Median device milliseconds of one replay of a CUDA graph of ``fn``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def projections(shape: str) -> dict[str, dict[str, Any]]:
    hidden, _, heads, kv_heads, inter, _ = SHAPES[shape]
    dim = hidden // heads
    return {
        "qkv": dict(n=(heads + 2 * kv_heads) * dim, k=hidden, bias=True),
        "o": dict(n=hidden, k=hidden, residual=True),
        "gate_up": dict(n=inter, k=hidden, gated=True),
        "down": dict(n=hidden, k=inter, residual=True),
    }


def sweep_configs(gated: bool, k: int) -> list[decode_gemm.TileConfig]:
    out = []
    for bm, bn, (bk, stages) in itertools.product((64, 128), (32, 64, 128), ((64, 4), (128, 3))):
        if (gated or bm == 128) and bn > 64:
            continue
        splits = (1,) if gated else tuple(s for s in (1, 2, 4, 8) if k // s >= 448)
        for split in splits:
            warps = 8 if bm * bn >= 128 * 128 else 4
            out.append(decode_gemm.TileConfig(bm, bn, bk, split, warps, stages))
    return out


def bench_gemm(shape: str, batch: int, layers: int, sweep: bool, tunable: bool) -> list[dict[str, Any]]:
    import torch.nn.functional as F

    dev, dtype = torch.device("cuda"), torch.bfloat16
    rows = []
    for name, p in projections(shape).items():
        n, k, gated = p["n"], p["k"], p.get("gated", False)
        ws = [torch.randn(2 * n if gated else n, k, device=dev, dtype=dtype) * 0.02 for _ in range(layers)]
        bias = torch.randn(n, device=dev, dtype=dtype) * 0.02 if p.get("bias") else None
        a = torch.randn(batch, k, device=dev, dtype=dtype)
        res = torch.randn(batch, n, device=dev, dtype=dtype) if p.get("residual") else None

        def library():
            for w in ws:
                if gated:
                    g, u = F.linear(a, w).chunk(2, dim=-1)
                    F.silu(g) * u
                elif res is not None:
                    torch.addmm(res, a, w.t())
                else:
                    F.linear(a, w, bias)

        def triton_call(config):
            def fn():
                for w in ws:
                    out = decode_gemm.linear(a, w, bias if config.split_k == 1 else None,
                                             res if config.split_k == 1 else None, gated=gated, config=config)
                    if config.split_k > 1:  # the sum and epilogue ride in the next fused kernel in the step
                        out = out.sum(0)
            return fn

        weight_mb = ws[0].numel() * 2 / 1e6
        flops = 2 * batch * ws[0].numel()
        row: dict[str, Any] = {"shape": shape, "proj": name, "m": batch, "n": n, "k": k, "weight_mb": weight_mb}
        row["library_us"] = graph_ms(library) * 1e3 / layers
        for blas in ("cublas", "cublaslt"):
            previous = torch.backends.cuda.preferred_blas_library()
            try:
                torch.backends.cuda.preferred_blas_library(blas)
                row[f"library_{blas}_us"] = graph_ms(library) * 1e3 / layers
            finally:
                torch.backends.cuda.preferred_blas_library(previous)
        if tunable:
            torch.cuda.tunable.enable(True)
            torch.cuda.tunable.tuning_enable(True)
            try:
                row["library_tunableop_us"] = graph_ms(library) * 1e3 / layers
            finally:
                torch.cuda.tunable.enable(False)
        ref = decode_gemm.reference(a, ws[0], bias, res, gated)
        rule = decode_gemm.tile_config(batch, n, k, gated, torch.cuda.get_device_properties(0).multi_processor_count)
        got = decode_gemm.linear(a, ws[0], bias if rule.split_k == 1 else None, res if rule.split_k == 1 else None,
                                 gated=gated, config=rule)
        got = got.sum(0) + (bias.float() if bias is not None else 0) + (res.float() if res is not None else 0) \
            if rule.split_k > 1 else got.float()
        row["rule_max_err"] = float((got - ref).abs().max())
        row["rule"] = rule.__dict__
        row["rule_us"] = graph_ms(triton_call(rule)) * 1e3 / layers
        if sweep:
            best = None
            for config in sweep_configs(gated, k):
                try:
                    us = graph_ms(triton_call(config), replays=10) * 1e3 / layers
                except Exception as error:  # noqa: BLE001 - a config the compiler refuses is skipped
                    print(f"      {config}: {type(error).__name__}", flush=True)
                    continue
                if best is None or us < best[0]:
                    best = (us, config)
            if best:
                row["best_us"], row["best"] = best[0], best[1].__dict__
        row["library_tflops"] = flops / row["library_us"] / 1e6
        print(f"    {shape} {name:8s} n={n:5d} k={k:5d}: library {row['library_us']:6.2f} us (cublas "
              f"{row['library_cublas_us']:.2f}, cublaslt {row['library_cublaslt_us']:.2f}, tunableop "
              f"{row.get('library_tunableop_us', float('nan')):.2f}), "
              f"rule {row['rule_us']:6.2f} us {rule}, best {row.get('best_us', float('nan')):6.2f} us "
              f"{row.get('best', '')}, err {row['rule_max_err']:.3g}", flush=True)
        rows.append(row)
        del ws
    return rows


def bench_sampler(batch: int, vocab: int) -> list[dict[str, Any]]:
    logits = torch.randn(batch, vocab, device="cuda", dtype=torch.bfloat16) * 3
    rows = []
    for fast, warps, splits in itertools.product((False, True), (4, 8), (None, 8, 16)):
        us = graph_ms(lambda: fused_sampling.sample_rows(logits, 1.0, 7, splits=splits, fast_math=fast,
                                                         num_warps=warps)) * 1e3
        rows.append({"fast_math": fast, "num_warps": warps, "splits": splits, "us": us})
        print(f"    sampler fast={fast} warps={warps} splits={splits}: {us:7.1f} us", flush=True)
    a, _ = fused_sampling.sample_rows(logits, 1.0, 7, fast_math=False)
    b, _ = fused_sampling.sample_rows(logits, 1.0, 7, fast_math=True)
    rows.append({"tokens_equal_fraction": float((a == b).float().mean())})
    print(f"    exact vs approximate log: {rows[-1]['tokens_equal_fraction']:.4f} of tokens equal", flush=True)
    return rows


def bench_attention(shape: str, batch: int, layers: int, length: int) -> list[dict[str, Any]]:
    hidden, _, heads, kv_heads, _, _ = SHAPES[shape]
    dim = hidden // heads
    caches = [torch.randn(2, batch, kv_heads, length + 64, dim, device="cuda", dtype=torch.bfloat16)
              for _ in range(layers)]
    q = torch.randn(batch, kv_heads, heads // kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    bias = torch.zeros(batch, length + 64, device="cuda", dtype=torch.bfloat16)
    rows = []
    for block_n, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (None, 2, 3, 4)):
        def fn():
            for layer in caches:
                decode_attention.attend(q, layer, bias, length, block_n=block_n, num_warps=warps, num_stages=stages)
        try:
            us = graph_ms(fn, replays=10) * 1e3 / layers
        except Exception as error:  # noqa: BLE001
            print(f"    attention {block_n}/{warps}/{stages}: {type(error).__name__}", flush=True)
            continue
        rows.append({"shape": shape, "block_n": block_n, "num_warps": warps, "num_stages": stages, "us": us})
    rows.sort(key=lambda r: r["us"])
    for r in rows[:5]:
        print(f"    attention {shape} block_n={r['block_n']} warps={r['num_warps']} stages={r['num_stages']}: "
              f"{r['us']:6.2f} us/layer", flush=True)
    return rows


def loop_profile(shape: str, batch: int, prompt: int, new: int, engine_kwargs: dict) -> dict[str, Any]:
    """Device time by kernel over one ``generate`` call of the engine, per decode step."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlcore.rollout.base import SamplingParams
    from rlcore.rollout.engine import RolloutEngine

    hidden, layers, heads, kv_heads, inter, vocab = SHAPES[shape]
    config = Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=inter, vocab_size=vocab,
                         tie_word_embeddings=True, max_position_embeddings=4096)
    model = Qwen2ForCausalLM(config).to("cuda", torch.bfloat16).eval()
    engine = RolloutEngine(model, max_batch_size=batch, max_seq_len=prompt + new, **engine_kwargs)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (prompt,), generator=gen).tolist() for _ in range(batch // 8)]
    prompts = [p for p in prompts for _ in range(8)]
    params = SamplingParams(max_new_tokens=new, temperature=1.0, seed=0)
    engine.warmup([batch])
    engine.generate(prompts, params)
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.generate(prompts, params)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, params)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for e in events:
        by_name.setdefault(e.name[:80], []).append(e.device_time_total / 1e3)
    steps = new - 1
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:25]
    out = {"shape": shape, "batch": batch, "wall_s": wall, "wall_ms_per_step": wall * 1e3 / steps,
           "kernel_ms_per_step": sum(sum(v) for v in by_name.values()) / steps,
           "top": [{"name": k, "calls_per_step": len(v) / steps, "ms_per_step": sum(v) / steps} for k, v in top]}
    print(f"    loop {shape}/{batch}: wall {out['wall_ms_per_step']:.3f} ms/step, kernels "
          f"{out['kernel_ms_per_step']:.3f} ms/step", flush=True)
    for item in out["top"]:
        print(f"      {item['ms_per_step']:7.4f} ms  x{item['calls_per_step']:<6.1f} {item['name']}", flush=True)
    del engine, model
    torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen2-0.5b", help="comma-separated: " + ",".join(SHAPES))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--parts", default="gemm,sampler,attention", help="gemm,sampler,attention (any)")
    parser.add_argument("--sweep", action="store_true", help="also sweep the GEMM tile configurations")
    parser.add_argument("--tunable", action="store_true", help="also time the library GEMMs under TunableOp")
    parser.add_argument("--loop", action="store_true", help="profile a whole generate call per shape")
    parser.add_argument("--loop-variants", default="default",
                        help='engine variants for --loop, separated by ";": "default" or RolloutEngine keywords '
                             'as JSON, e.g. default;{"rope_in_attention": false}')
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode_parts: needs a CUDA GPU", file=sys.stderr)
        return 2
    parts = set(args.parts.split(","))
    results: dict[str, Any] = {"env": environment(), "command": " ".join(sys.argv), "gemm": [], "sampler": [],
                               "attention": [], "loop": []}
    for shape in args.shapes.split(","):
        layers = SHAPES[shape][1]
        if "gemm" in parts:
            results["gemm"] += bench_gemm(shape, args.batch, layers, args.sweep, args.tunable)
            save(results, args.out)
        if "attention" in parts:
            results["attention"] += bench_attention(shape, args.batch, layers, 320)
            save(results, args.out)
        if args.loop:
            for variant in args.loop_variants.split(";"):
                kwargs = {} if variant == "default" else json.loads(variant)
                results["loop"].append({"variant": variant, **loop_profile(shape, args.batch, 128, 65, kwargs)})
                save(results, args.out)
    if "sampler" in parts:
        results["sampler"] = bench_sampler(args.batch, SHAPES["qwen2-0.5b"][5])
    save(results, args.out)
    return 0


def save(results: dict[str, Any], path: str | None) -> None:
    """Write what is measured so far (a later part that fails loses nothing)."""
    if path:
        with open(path, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
