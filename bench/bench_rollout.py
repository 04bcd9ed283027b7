"""Rollout benchmark: HF generate (dynamic cache, static cache) against rlcore's engine, one process.

Setup (the issue's): random-init Qwen2-0.5B and Qwen2-1.5B shapes in bf16, 32 prompts x 8 samples
(batch 256) and batch 64, prompt 128 tokens, 256 new tokens at fixed length (EOS ignored),
temperature-1 sampling. For each (model, batch) it reports new tokens per second, an estimate of
the per-decode-step time ``(T(256 tokens) - T(1 token)) / 255`` and the roofline floors of a decode
step: bytes (weights + the KV cache at the mean context) over the measured copy bandwidth, and
FLOPs over the measured bf16 matmul rate.

The engine is timed in several configurations (``--variants``: the defaults, without
``torch.compile``, with SDPA attention, with the PyTorch sampler, with the Triton decode
attention), each after capturing its graphs; its 1-token and full calls are each the median of
``--repeats`` calls (HF's are timed once); for each the device time of one replayed decode
graph (at the mean context's attention length) and of one sampling call are reported too, and
``--profile`` lists the kernels of one un-graphed step. ``--skip-dynamic`` and
``--static-batches`` leave out the slow HF runs.

Before timing, ``--check`` (on by default on GPU) compares the engine with HF ``generate`` on the
device: greedy tokens of a tiny float32 model (must be equal, CUDA graphs on, continuous batching
with EOS), greedy agreement of the bf16 0.5B shape (reported), and sampled log-probs against a
teacher-forced forward (reported).

The TRL GRPOTrainer comparison of the issue is not part of this script.

Run (GPU):  python bench/bench_rollout.py --out results/rollout.json
            python bench/bench_rollout.py --skip-dynamic --static-batches 256 --profile   (about 150 s)
Smoke test: python bench/bench_rollout.py --tiny        (CPU, tiny shapes; the numbers mean nothing)
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import device_ceilings, environment, import_rlcore, timed, write_json  # noqa: E402

import_rlcore()
from rlcore.rollout.base import SamplingParams  # noqa: E402
from rlcore.rollout.engine import RolloutEngine  # noqa: E402
from rlcore.rollout.hf import HFGenerateBackend  # noqa: E402
from rlcore.rollout.tiny import causal_lm_from_config, tiny_causal_lm  # noqa: E402

SHAPES = {
    "qwen2-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "qwen2-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                       intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512, tie_word_embeddings=True),
}


def build(shape: str, device: str, dtype=torch.bfloat16):
    from transformers import Qwen2Config

    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, bos_token_id=None, eos_token_id=None)
    model = causal_lm_from_config(config, dtype=dtype, device=device)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def make_prompts(n_prompts: int, samples: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(10, vocab, (n_prompts, length), generator=g).tolist()
    return [p for p in base for _ in range(samples)]


def hf_generate(model, prompts, new_tokens: int, static: bool):
    """Plain ``model.generate`` as a user would call it, with temperature-1 sampling."""
    from transformers import GenerationConfig

    ids = torch.tensor(prompts, device=model.device)
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=0, do_sample=True, temperature=1.0,
                              top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=0,
                              cache_implementation="static" if static else None)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)


def roofline(model, batch: int, prompt: int, new: int, ceilings: dict[str, float], samples: int = 1) -> dict[str, float]:
    """Floors of one decode step at the mean context ``prompt + new / 2``: every sequence's keys
    and values read (``memory_floor_ms``), and with each prompt's keys/values read once for its
    ``samples`` sequences (``unique_memory_floor_ms``)."""
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    elem = next(model.parameters()).element_size()
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    context = prompt + new / 2
    kv_bytes = batch * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * elem * context
    # every parameter is one multiply-add per token (the tied matrix as LM head; the lookup is free)
    flops = 2 * batch * params + 4 * batch * cfg.num_hidden_layers * cfg.hidden_size * context
    unique_kv_bytes = kv_bytes * (prompt / max(samples, 1) + new / 2) / context
    out = {"weight_bytes": params * elem, "kv_bytes": kv_bytes, "unique_kv_bytes": unique_kv_bytes, "flops": flops}
    if ceilings:
        out["memory_floor_ms"] = (params * elem + kv_bytes) / ceilings["copy_bytes_per_s"] * 1e3
        out["unique_memory_floor_ms"] = (params * elem + unique_kv_bytes) / ceilings["copy_bytes_per_s"] * 1e3
        out["compute_floor_ms"] = flops / ceilings["bf16_matmul_flops"] * 1e3
    return out


def guarded(case: dict[str, Any], name: str, body) -> None:
    """Run one system's measurement; a failure is recorded, not fatal for the other systems."""
    try:
        case["systems"].append(body())
    except Exception as error:  # noqa: BLE001 - the benchmark reports and moves on
        import traceback

        traceback.print_exc()
        case["systems"].append({"system": name, "error": repr(error)[:500]})
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def median_seconds(call, repeats: int) -> float:
    """Median wall seconds of ``repeats`` timed calls."""
    times = sorted(timed(call)[0] for _ in range(max(1, repeats)))
    return times[len(times) // 2]


def run_system(name: str, call, batch: int, new: int, prefill_s: float | None, repeats: int = 1) -> dict[str, Any]:
    seconds = median_seconds(call, repeats)
    row = {"system": name, "seconds": seconds, "new_tokens_per_s": batch * new / seconds, "repeats": repeats}
    if prefill_s is not None:
        row["decode_step_ms"] = max(seconds - prefill_s, 0.0) / (new - 1) * 1e3
    print(f"    {name:<16} {seconds:7.2f} s  {row['new_tokens_per_s']:9.0f} tok/s  "
          f"{row.get('decode_step_ms', float('nan')):7.2f} ms/step", flush=True)
    return row


#: engine configurations timed per case: name -> RolloutEngine keyword arguments
VARIANTS = {
    "engine": {},
    "engine_uncompiled": {"compile": False},
    "engine_torch_sampler": {"fused_sampling": False},
    "engine_sdpa_attn": {"attention": "sdpa"},
    "engine_rope_separate": {"rope_in_attention": False},
    "engine_no_split_k": {"split_k": None},
    "engine_no_sharing": {"prompt_sharing": False},
    # the static KV cache (one row of max_seq_len per slot) the paged default replaced
    "engine_static_cache": {"kv_cache": "static"},
    # the products as before rollout run 14: q/k/v in one piece, gate/up not transposed
    "engine_products_before": {"split_k": {"o": 2, "down": 4}, "mlp_transposed": False},
    "engine_no_qkv_split": {"split_k": {"o": 2, "down": 4}},
    "engine_mlp_rows": {"mlp_transposed": False},
    "engine_down2": {"split_k": {"o": 2, "down": 2, "qkv": 2}},
    "engine_down8": {"split_k": {"o": 2, "down": 8, "qkv": 2}},
    # the step's bookkeeping as PyTorch kernels (before rollout run 15), not an engine option
    "engine_torch_bookkeeping": {"_torch_bookkeeping": True},
    "engine_split2_stages1": {"attention_tuning": {"splits": 2, "num_stages": 1}},
    "engine_split2_stages2": {"attention_tuning": {"splits": 2, "num_stages": 2}},
    "engine_stages1": {"attention_tuning": {"num_stages": 1}},
    "engine_stages2": {"attention_tuning": {"num_stages": 2}},
    "engine_warps1": {"attention_tuning": {"num_warps": 1}},
    # each warp of the attention kernel on its own sub-block of columns, with its own softmax state
    "engine_sub2": {"attention_tuning": {"subblocks": 2}},
    "engine_sub4_warps4": {"attention_tuning": {"subblocks": 4, "num_warps": 4, "block_n": 64}},
    "engine_sub4_warps4_block128": {"attention_tuning": {"subblocks": 4, "num_warps": 4, "block_n": 128}},
    # the attention kernel as before rollout run 10: 4 warps, RoPE position looked up in every layer
    "engine_attn_before": {"attention_tuning": {"num_warps": 4, "rope_rows": False}},
    "engine_autotune": {"compile_mode": "max-autotune-no-cudagraphs"},
}


def engine_run(name: str, model, prompts, batch: int, args, kwargs: dict, profile: bool) -> dict[str, Any]:
    """Time one engine configuration: capture its graphs first, then 1 token and ``new`` tokens."""
    from rlcore.rollout import sampling

    from rlcore.kernels import step_kernels

    new, prompt = args.new_tokens, args.prompt_len
    kwargs = dict(kwargs)
    if kwargs.pop("_torch_bookkeeping", False):
        available = step_kernels.available
        step_kernels.available = lambda device: False
        try:
            return engine_run(name, model, prompts, batch, args, kwargs, profile)
        finally:
            step_kernels.available = available
    engine = RolloutEngine(model, max_batch_size=batch, max_seq_len=prompt + new, **kwargs)
    if "attention_tuning" in kwargs and engine.attention != "triton":  # its self-check failed: say so
        print(f"      {name}: the tuned Triton attention is unusable here, timing {engine.attention!r}", flush=True)
    warm_s, _ = timed(lambda: (engine.warmup([batch]),
                               engine.generate(prompts, SamplingParams(max_new_tokens=4, temperature=1.0, seed=0))))
    prefill_s = median_seconds(lambda: engine.generate(prompts, SamplingParams(max_new_tokens=1, seed=0)),
                               args.repeats)
    sample = SamplingParams(max_new_tokens=new, temperature=1.0, seed=0)
    row = run_system(name, lambda: engine.generate(prompts, sample), batch, new, prefill_s, args.repeats)
    row.update(prefill_s=prefill_s, warmup_s=warm_s, cuda_graphs=engine.use_cuda_graphs, compiled=engine.compile,
               attention=engine.attention,
               fused_sampler=bool(engine.fused_sampling and sampling._FUSED_OK.get(str(engine.device))))
    if engine.device.type == "cuda":
        try:
            row.update(step_parts(engine, batch, engine._length_bucket(prompt + new // 2 + 1), profile))
        except Exception as error:  # noqa: BLE001 - the timings above stand without the breakdown
            row["step_parts_error"] = repr(error)[:300]
    engine = None  # free the GPU memory (the closures above refer to it)
    return row


def step_parts(engine, batch: int, length: int, profile: bool) -> dict[str, Any]:
    """Device time of the replayed decode graph and of one sampling call (mid-length cache)."""
    from _common import cuda_ms
    from rlcore.rollout.sampling import Sampler

    out: dict[str, Any] = {"graph_step_ms": cuda_ms(lambda: engine._decode(batch, length)), "graph_length": length}
    logits = engine._decode(batch, length)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=0), engine.device, fused=engine.fused_sampling)
    out["sampler_ms"] = cuda_ms(lambda: sampler(logits))
    if profile:
        out["kernels"] = kernel_profile(lambda: engine._decode_eager(batch, length))
    print(f"      graph step {out['graph_step_ms']:.3f} ms (length {length}), sampler {out['sampler_ms']:.3f} ms",
          flush=True)
    return out


def kernel_times(fn, width: int = 90) -> dict[str, list[float]]:
    """Device milliseconds of every kernel ``fn`` launches (run once before, to warm up), by name
    (cut to ``width`` characters)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name.setdefault(e.name[:width], []).append(e.device_time_total / 1e3)
    return by_name


def kernel_profile(fn) -> dict[str, Any]:
    """Kernels one un-graphed decode step launches: count and the largest by device time."""
    by_name = kernel_times(fn)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]
    summary = {"count": sum(len(v) for v in by_name.values()), "total_ms": sum(sum(v) for v in by_name.values()),
               "top": [{"name": k, "calls": len(v), "ms": sum(v)} for k, v in top]}
    print(f"      kernels per un-graphed step: {summary['count']}, {summary['total_ms']:.3f} ms", flush=True)
    for item in summary["top"]:
        print(f"        {item['ms']:7.3f} ms  x{item['calls']:<4} {item['name']}", flush=True)
    return summary


def bench_case(model, shape: str, batch: int, args, ceilings, results: list, deadline: float) -> None:
    new, prompt = args.new_tokens, args.prompt_len
    prompts = make_prompts(batch // args.samples, args.samples, prompt, model.config.vocab_size)
    case = {"model": shape, "batch": batch, "prompt_len": prompt, "new_tokens": new,
            "roofline": roofline(model, batch, prompt, new, ceilings, args.samples), "systems": []}
    results.append(case)
    print(f"== {shape} batch {batch} (at {time.time() - deadline + args.budget_s:.0f} s)", flush=True)
    for index, name in enumerate(args.variants.split(",")):
        profile = args.profile and index == 0 and not any("kernels" in r for c in results for r in c["systems"])
        guarded(case, name, lambda: engine_run(name, model, prompts, batch, args, VARIANTS[name], profile))
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    hf_prefill: list[float] = []

    def dynamic_run():
        hf_generate(model, prompts[:8], 4, static=False)
        hf_prefill.append(timed(lambda: hf_generate(model, prompts, 1, static=False))[0])
        if args.skip_dynamic:
            print(f"    hf_dynamic       skipped (1-token call {hf_prefill[0]:.3f} s)", flush=True)
            return {"system": "hf_dynamic", "skipped": "flag", "prefill_s": hf_prefill[0]}
        return run_system("hf_dynamic", lambda: hf_generate(model, prompts, new, False), batch, new, hf_prefill[0])

    def static_run():
        compile_s, _ = timed(lambda: hf_generate(model, prompts, new, True))
        row = run_system("hf_static", lambda: hf_generate(model, prompts, new, True), batch, new,
                         hf_prefill[0] if hf_prefill else None)
        row["first_call_s"] = compile_s
        return row

    guarded(case, "hf_dynamic", dynamic_run)
    static_batches = {int(b) for b in args.static_batches.split(",")} if args.static_batches else None
    skip_static = args.skip_static or (static_batches is not None and batch not in static_batches)
    if skip_static or time.time() > deadline:
        case["systems"].append({"system": "hf_static", "skipped": "flag" if skip_static else "time budget"})
        print("    hf_static        skipped", flush=True)
    else:
        guarded(case, "hf_static", static_run)
    summarize_case(case)
    torch._dynamo.reset() if hasattr(torch, "_dynamo") else None
    gc.collect()


def summarize_case(case: dict[str, Any]) -> None:
    by = {r["system"]: r for r in case["systems"] if "seconds" in r}
    eng = by.get("engine")
    if not eng:
        return
    for other in ("hf_dynamic", "hf_static"):
        if other in by:
            case[f"speedup_vs_{other}"] = eng["new_tokens_per_s"] / by[other]["new_tokens_per_s"]
    floor = case["roofline"].get("memory_floor_ms")
    if floor and "decode_step_ms" in eng:
        case["engine_step_over_memory_floor"] = eng["decode_step_ms"] / floor
        case["engine_step_over_unique_memory_floor"] = eng["decode_step_ms"] / case["roofline"]["unique_memory_floor_ms"]


def print_table(results: list[dict[str, Any]]) -> None:
    print("\n| model | batch | system | new tok/s | ms/decode step | vs HF dynamic | vs HF static | step / mem floor "
          "| step / unique-bytes floor |")
    print("|---|---|---|---|---|---|---|---|---|")
    for case in results:
        by = {r["system"]: r for r in case["systems"] if "seconds" in r}
        order = ["hf_dynamic", "hf_static"] + [name for name in by if name.startswith("engine")]
        for name in order:
            row = by.get(name)
            if row is None:
                continue
            floor = case["roofline"].get("memory_floor_ms")
            unique = case["roofline"].get("unique_memory_floor_ms")
            ratio_dyn = row["new_tokens_per_s"] / by["hf_dynamic"]["new_tokens_per_s"] if "hf_dynamic" in by else None
            ratio_sta = row["new_tokens_per_s"] / by["hf_static"]["new_tokens_per_s"] if "hf_static" in by else None
            step = row.get("decode_step_ms")
            print(f"| {case['model']} | {case['batch']} | {name} | {row['new_tokens_per_s']:,.0f} | "
                  f"{step:.2f} | {_fmt(ratio_dyn)} | {_fmt(ratio_sta)} | {_fmt(step / floor if floor else None)} | "
                  f"{_fmt(step / unique if unique else None)} |")
        roof = case["roofline"]
        if "memory_floor_ms" in roof:
            print(f"| {case['model']} | {case['batch']} | floor (memory / unique bytes / compute) | | "
                  f"{roof['memory_floor_ms']:.3f} / {roof['unique_memory_floor_ms']:.3f} / "
                  f"{roof['compute_floor_ms']:.3f} | | | | |")


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def gpu_checks(device: str) -> dict[str, Any]:
    """Engine against HF on the device (see the module docstring)."""
    out: dict[str, Any] = {}
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [3], [5, 6, 7], [100, 101, 102]]
    tiny = tiny_causal_lm("qwen2").to(device)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    ref = HFGenerateBackend(tiny).generate(prompts, greedy)
    engine = RolloutEngine(tiny, max_batch_size=8, max_seq_len=32)
    got = engine.generate(prompts, greedy)
    out["tiny_fp32_greedy_equal"] = bool(torch.equal(ref.response_ids, got.response_ids))
    out["tiny_engine_compiled"] = engine.compile
    eos = int(ref.response_ids[0, 3])
    stop = SamplingParams(max_new_tokens=12, temperature=0.0, eos_token_ids=(eos,))
    ref = HFGenerateBackend(tiny).generate(prompts, stop)
    engine = RolloutEngine(tiny, max_batch_size=2, max_seq_len=32, eos_check_interval=2, graph_batch_buckets=(2,),
                           attention_length_step=8)
    got = engine.generate(prompts, stop)
    out["tiny_cb_engine_compiled"] = engine.compile
    out["tiny_fp32_continuous_batching_eos_equal"] = bool(torch.equal(ref.response_ids, got.response_ids)
                                                          and torch.equal(ref.response_mask, got.response_mask))
    model = build("qwen2-0.5b", device)
    long_prompts = make_prompts(16, 1, 64, model.config.vocab_size, seed=1)
    greedy = SamplingParams(max_new_tokens=32, temperature=0.0)
    ref = HFGenerateBackend(model).generate(long_prompts, greedy)
    engine = RolloutEngine(model, max_batch_size=16, max_seq_len=96)
    got = engine.generate(long_prompts, greedy)
    first_diff = (ref.response_ids != got.response_ids).int().argmax(-1)
    same = (ref.response_ids == got.response_ids).all(-1)
    out["bf16_0.5b_engine_compiled"] = engine.compile
    out["bf16_0.5b_greedy_rows_identical"] = f"{int(same.sum())}/{len(same)}"
    out["bf16_0.5b_greedy_first_divergence_mean"] = float(torch.where(same, 32, first_diff).float().mean())
    batch = RolloutEngine(model, max_batch_size=16, max_seq_len=96).generate(
        long_prompts, SamplingParams(max_new_tokens=32, temperature=1.0, seed=0))
    ids, mask = batch.sequences()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    tf = torch.log_softmax(logits[:, 63:-1], -1).gather(-1, batch.response_ids[..., None]).squeeze(-1)
    out["bf16_0.5b_sampled_logprob_max_abs_err"] = float((tf - batch.logprobs).abs().max())
    out["bf16_0.5b_sampled_logprob_mean_abs_err"] = float((tf - batch.logprobs).abs().mean())
    from rlcore.rollout import sampling

    out["fused_sampler_ok"] = sampling._FUSED_OK.get(str(tiny.device))
    print("checks:", out, flush=True)
    del model
    gc.collect()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT") or tempfile.gettempdir(), "bench_rollout.json"))
    parser.add_argument("--models", default="qwen2-0.5b,qwen2-1.5b")
    parser.add_argument("--batches", default="256,64")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3,
                        help="engine: the 1-token and the full call are each the median of this many calls")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--budget-s", type=float, default=300.0,
                        help="after this many seconds, skip the (compiling) HF static-cache runs")
    parser.add_argument("--skip-static", action="store_true")
    parser.add_argument("--static-batches", default="", help="run HF static cache only at these batch sizes")
    parser.add_argument("--skip-dynamic", action="store_true",
                        help="time only HF's 1-token call (for the static-cache step estimate), not its full run")
    parser.add_argument("--variants", default=",".join(v for v in VARIANTS if v != "engine_autotune"),
                        help=f"engine configurations to time, from {', '.join(VARIANTS)}")
    parser.add_argument("--profile", action="store_true", help="list the kernels of one decode step (first case)")
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test with tiny shapes")
    args = parser.parse_args(argv)
    start = time.time()
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown --variants {unknown}; choose from {', '.join(VARIANTS)}")
    if args.tiny:
        args.models, args.batches, args.prompt_len, args.new_tokens, args.samples = "tiny", "8", 16, 8, 4
    payload: dict[str, Any] = {"env": environment(), "command": " ".join(sys.argv), "results": []}
    print(payload["env"], flush=True)
    payload["ceilings"] = device_ceilings() if device == "cuda" else {}
    print("ceilings:", payload["ceilings"], flush=True)
    if device == "cuda" and not args.no_check:
        try:
            payload["checks"] = gpu_checks(device)
        except Exception as error:  # noqa: BLE001 - report and go on to the timings
            import traceback

            traceback.print_exc()
            payload["checks"] = {"error": repr(error)[:1000]}
        torch._dynamo.reset()  # the timed cases compile for their own batch size, statically
        print(f"checks done at {time.time() - start:.0f} s", flush=True)
    write_json(args.out, payload)
    for shape in args.models.split(","):
        model = build(shape, device, torch.bfloat16 if device == "cuda" else torch.float32)
        for batch in (int(b) for b in args.batches.split(",")):
            bench_case(model, shape, batch, args, payload["ceilings"], payload["results"], start + args.budget_s)
            write_json(args.out, payload)
        del model
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    payload["elapsed_s"] = time.time() - start
    write_json(args.out, payload)
    print_table(payload["results"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
