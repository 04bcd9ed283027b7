"""The rollout engine against Hugging Face at real model shapes: Qwen3, Qwen2.5 and Llama-3 configs
with random weights (no download), in bf16 on the GPU.

For each shape and engine variant:

* greedy: HF ``generate`` and the engine each write ``--new-tokens`` tokens for ``--prompts`` prompts
  of varied lengths. A row agrees when its tokens are equal, or when they first differ at a step
  where HF's two best logits are within ``--tie-tol`` of each other (a tie that bf16 rounding may
  break either way); ``untied_divergences`` counts the rows that differ anywhere else (0 expected).
  The engine's log-probs of its greedy tokens are compared with the trainer's recomputation
  (teacher forcing through the HF model with rlcore's own log-prob function).
* sampled (temperature 1): the engine's log-probs and HF ``generate``'s, each against the trainer's
  recomputation of its own samples: mean/max absolute difference and KL estimates
  (:func:`_models.mismatch`).

Every RMSNorm weight is drawn from ``1 ± --norm-jitter`` (a norm of weight one would hide Qwen3's
q/k norm applied after RoPE instead of before). Variants: ``default`` (the engine's CUDA defaults:
Triton attention with RoPE in the kernel, compiled step, CUDA graphs) and ``eager`` (PyTorch SDPA
attention, no compilation, no graphs).

Run (GPU):  python bench/check_models.py --out $OUT/check_models.json   (``--budget-s``: start no shape after it)
Smoke (CPU): python bench/check_models.py --shapes tiny-qwen3,tiny-llama3 --dtype fp32 --variants eager

The Triton variants run on CPU through Triton's interpreter (``TRITON_INTERPRET=1``), in ``fp16`` or
``fp32`` only: the interpreter's float32-to-bf16 conversion does not round to nearest as the GPU and
PyTorch do, so bf16 there measures the interpreter. Under it the kernel takes its float32 path, and the
trainer's attention is PyTorch's CPU kernel, so a CPU gap says nothing of the GPU's rounding.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import sys
import time
import traceback
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import environment, import_rlcore, write_json  # noqa: E402

import_rlcore()
from _models import SHAPES, mismatch, random_model, teacher_forced  # noqa: E402

DEFAULT_SHAPES = ("qwen3-1.7b", "qwen3-8b", "qwen2.5-7b")
VARIANTS = {
    "default": {},
    "eager": dict(attention="sdpa", compile=False, use_cuda_graphs=False),
    # the two halves of the default, apart: which one moves the log-probs
    "triton-eager": dict(attention="triton", compile=False),
    # inside the Triton attention path: RoPE applied apart (not in the kernel), the attended length not
    # split across programs
    "triton-eager-rope-apart": dict(attention="triton", compile=False, rope_in_attention=False),
    "triton-eager-one-split": dict(attention="triton", compile=False, attention_tuning={"splits": 1}),
    # the default with RoPE and the cache write apart (compiled: Inductor fuses them), the kernel reading
    # the new column from the cache: what the uncompiled `triton-eager-rope-apart` gained, in the default path
    "rope-apart": dict(rope_in_attention=False),
    # the kernel's block of columns (its running maximum moves a block at a time, and the probabilities
    # are rounded for the value product against it): the trainer's attention folds larger blocks than
    # the default 32 columns at head dim 128 (a paged cache's pages hold whole blocks)
    "block-64": dict(attention_tuning={"block_n": 64}),
    "block-128": dict(attention_tuning={"block_n": 128}, page_size=128),
    "sdpa-compiled": dict(attention="sdpa"),
    # which compiled op rounds apart: RMSNorm kept out of Inductor's fusion (an opaque op running the
    # eager code), and the compiled step without emulate_precision_casts
    "opaque-norm": dict(patch="opaque-norm"),
    "sdpa-opaque-norm": dict(attention="sdpa", patch="opaque-norm"),
    "no-emulate": dict(patch="no-emulate"),
    # the compiled step's split-K products and transposed gate/up: without them, and with the split-K
    # partials rounded to the compute dtype before their sum (as before they were kept in float32)
    "no-split": dict(split_k=None),
    "no-split-no-turn": dict(split_k=None, mlp_transposed=False),
    "rounded-partials": dict(patch="rounded-partials"),
    # the attention kernel's value product on probabilities kept at TF32 / float32 precision instead of
    # rounded to bf16 (rlcore.kernels.decode_attention.PV_PRECISION)
    "pv-tf32": dict(patch="pv-tf32"),
    "pv-ieee": dict(patch="pv-ieee"),
}


@contextlib.contextmanager
def patched(name: str | None):
    """The engine's code as the variant ``name`` changes it while an engine is built and run."""
    from rlcore.rollout.engine import decode, llama

    if name is None:
        yield
        return
    saved = {}
    if name == "opaque-norm":
        original = llama.rms_norm
        if not hasattr(patched, "op"):
            @torch.library.custom_op("rlcore_bench::rms_norm", mutates_args=())
            def op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
                return original(x, weight, eps)

            @op.register_fake
            def _(x, weight, eps):
                return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))

            patched.op = op
        saved = {(decode, "rms_norm"): decode.rms_norm, (llama, "rms_norm"): llama.rms_norm}
        decode.rms_norm = llama.rms_norm = patched.op
    elif name == "no-emulate":
        plain = decode.compile_options

        def without(mode):
            options = plain(mode)
            options.pop("emulate_precision_casts", None)
            return options

        saved = {(decode, "compile_options"): decode.compile_options}
        decode.compile_options = without
    elif name == "rounded-partials":
        exact_partials = decode._partials

        def partials(x, weight, bias, splits, exact=True):
            return exact_partials(x, weight, bias, splits, exact=False)

        saved = {(decode, "_partials"): decode._partials}
        decode._partials = partials
    elif name in ("pv-tf32", "pv-ieee"):
        from rlcore.kernels import decode_attention

        saved = {(decode_attention, "PV_PRECISION"): decode_attention.PV_PRECISION}
        decode_attention.PV_PRECISION = name.removeprefix("pv-")
    else:
        raise ValueError(f"unknown patch {name!r}")
    try:
        yield
    finally:
        for (module, attr), value in saved.items():
            setattr(module, attr, value)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def make_prompts(count: int, vocab: int, seed: int, low: int = 16, high: int = 160) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (count,), generator=gen).tolist()
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def hf_greedy(model, prompts: list[list[int]], new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF greedy tokens ``[B, N]`` and the margin between its two best logits at each step ``[B, N]``."""
    from transformers import GenerationConfig

    from rlcore.rollout.base import left_pad

    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, 0, device)
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, num_beams=1,
                              eos_token_id=None, pad_token_id=0, return_dict_in_generate=True, output_logits=True,
                              temperature=None, top_p=None, top_k=None)
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    logits = torch.stack(out.logits, dim=1).float()  # [B, N, V]
    top = logits.topk(2, dim=-1).values
    return out.sequences[:, ids.shape[1]:].cpu(), (top[..., 0] - top[..., 1]).cpu()


def greedy_check(model, engine, prompts, new_tokens: int, tie_tol: float) -> dict[str, Any]:
    from rlcore.rollout.base import SamplingParams

    expected, margins = hf_greedy(model, prompts, new_tokens)
    batch = engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, temperature=0.0))
    got = batch.response_ids.cpu()
    rows = []
    for row in range(len(prompts)):
        differ = (got[row] != expected[row]).nonzero()
        first = int(differ[0]) if len(differ) else new_tokens
        margin = float(margins[row, first]) if first < new_tokens else None
        rows.append({"agreed_prefix": first, "margin_at_divergence": margin,
                     "tied": margin is not None and margin <= tie_tol})
    trainer = teacher_forced(model, batch, 1.0)
    return {"rows_equal": sum(r["agreed_prefix"] == new_tokens for r in rows),
            "rows_diverged_at_tie": sum(r["tied"] for r in rows),
            "untied_divergences": sum(r["margin_at_divergence"] is not None and not r["tied"] for r in rows),
            "agreed_prefix_min": min(r["agreed_prefix"] for r in rows),
            "agreed_prefix_mean": sum(r["agreed_prefix"] for r in rows) / len(rows),
            "logprob_vs_trainer": mismatch(batch.logprobs.cpu(), trainer.cpu(), batch.response_mask.cpu()),
            "rows": rows}


def sampled_check(model, engine, prompts, new_tokens: int, seed: int) -> dict[str, Any]:
    from rlcore.rollout.base import SamplingParams
    from rlcore.rollout.hf import HFGenerateBackend

    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, top_p=1.0, top_k=0, seed=seed)
    out = {}
    for name, backend in (("engine", engine), ("hf_generate", HFGenerateBackend(model))):
        batch = backend.generate(prompts, params)
        trainer = teacher_forced(model, batch, 1.0)
        out[name] = mismatch(batch.logprobs.cpu(), trainer.cpu(), batch.response_mask.cpu())
    return out


def check_shape(shape: str, args) -> list[dict[str, Any]]:
    from rlcore.rollout.engine import RolloutEngine

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = DTYPES[args.dtype]
    start = time.perf_counter()
    model = random_model(shape, dtype, device, seed=args.seed, norm_jitter=args.norm_jitter)
    build_s = time.perf_counter() - start
    vocab = model.config.vocab_size
    prompts = make_prompts(args.prompts, vocab, args.seed, high=args.max_prompt)
    supported = RolloutEngine.supports(model)
    results = []
    for variant in args.variants:
        row: dict[str, Any] = {"shape": shape, "variant": variant, "supported": supported, "build_s": build_s}
        try:
            if not supported:
                raise RuntimeError(f"RolloutEngine.supports() is False for {shape}")
            start = time.perf_counter()
            options = dict(VARIANTS[variant])
            with patched(options.pop("patch", None)):
                engine = RolloutEngine(model, max_batch_size=len(prompts),
                                       max_seq_len=max(map(len, prompts)) + max(args.new_tokens, args.sampled_tokens),
                                       dtype=dtype, **options)
                row.update(attention=engine.attention, compiled=engine.compile, graphs=engine.use_cuda_graphs,
                           rope_in_attention=engine.rope_in_attention)
                row["greedy"] = greedy_check(model, engine, prompts, args.new_tokens, args.tie_tol)
                row["sampled"] = sampled_check(model, engine, prompts, args.sampled_tokens, args.seed)
            row["seconds"] = time.perf_counter() - start
            del engine
        except Exception as error:  # noqa: BLE001 - one failing variant must not lose the others
            row["error"] = f"{type(error).__name__}: {str(error)[:400]}"
            traceback.print_exc()
        print(summary_line(row), flush=True)
        results.append(row)
        if device == "cuda":
            torch.cuda.empty_cache()
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return results


def summary_line(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"{row['shape']:<13} {row['variant']:<8} FAILED {row['error']}"
    g, s = row["greedy"], row["sampled"]
    lp = g["logprob_vs_trainer"]
    return (f"{row['shape']:<13} {row['variant']:<8} {g['rows_equal']:>3}/{len(g['rows']):<3} "
            f"{g['rows_diverged_at_tie']:>4} {g['untied_divergences']:>7} {g['agreed_prefix_min']:>6} "
            f"{lp['abs_diff_mean']:>9.2e} {lp['abs_diff_max']:>9.2e} "
            f"{s['engine']['abs_diff_mean']:>9.2e} {s['engine']['abs_diff_max']:>9.2e} {s['engine']['kl_k3']:>9.2e} "
            f"{s['hf_generate']['abs_diff_mean']:>9.2e} {s['hf_generate']['abs_diff_max']:>9.2e} "
            f"{s['hf_generate']['kl_k3']:>9.2e}")


HEADER = (f"{'shape':<13} {'variant':<8} {'equal':>7} {'ties':>4} {'untied':>7} {'prefix':>6} "
          f"{'gr_mean':>9} {'gr_max':>9} {'eng_mean':>9} {'eng_max':>9} {'eng_kl':>9} "
          f"{'hf_mean':>9} {'hf_max':>9} {'hf_kl':>9}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-prompt", type=int, default=160, help="longest prompt (shortest: 16 tokens)")
    parser.add_argument("--new-tokens", type=int, default=64, help="greedy tokens compared with HF")
    parser.add_argument("--sampled-tokens", type=int, default=256, help="sampled tokens for the log-prob mismatch")
    parser.add_argument("--tie-tol", type=float, default=0.1,
                        help="a divergence where HF's two best logits are this close counts as a tie")
    parser.add_argument("--norm-jitter", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=0.0,
                        help="start no further shape after this many seconds (0: no limit)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT") or tempfile.gettempdir(), "check_models.json"))
    args = parser.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    for variant in args.variants:
        if variant not in VARIANTS:
            raise SystemExit(f"--variants: unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    shapes = [s for s in args.shapes.split(",") if s]
    for shape in shapes:
        if shape not in SHAPES:
            raise SystemExit(f"--shapes: unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    command = " ".join(["python", "bench/check_models.py", *(argv or sys.argv[1:])])
    payload: dict[str, Any] = {"env": environment(), "command": command,
                               "settings": {k: v for k, v in vars(args).items() if k != "out"}, "results": []}
    print(payload["env"], flush=True)
    start = time.perf_counter()
    for shape in shapes:
        if args.budget_s and time.perf_counter() - start > args.budget_s:
            payload["results"].append({"shape": shape, "error": f"not run: --budget-s {args.budget_s:.0f} spent"})
            continue
        try:
            payload["results"] += check_shape(shape, args)
        except Exception as error:  # noqa: BLE001 - e.g. out of memory building the model
            traceback.print_exc()
            payload["results"].append({"shape": shape, "error": f"{type(error).__name__}: {str(error)[:400]}"})
        write_json(args.out, payload)
    print("\ngreedy: rows equal / rows, rows diverging at a tie, rows diverging elsewhere, shortest agreed prefix,")
    print("        engine log-prob vs trainer mean/max abs diff; sampled: engine and HF generate vs trainer (KL k3)")
    print(HEADER)
    for row in payload["results"]:
        print(summary_line(row) if "variant" in row else f"{row['shape']:<13} FAILED {row['error']}")
    failed = [r for r in payload["results"] if "error" in r or r["greedy"]["untied_divergences"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
