"""Where the engine's RoPE inside the attention kernel and RoPE apart part ways (CUDA, bf16).

The two paths round the same way on paper (the kernel rounds each RoPE product and their sum as the
model does), and on CPU, under Triton's interpreter in float16, they give the same log-probs bit for
bit; on an H100 in bf16 the fused path's log-probs are further from the trainer's (``check_models.py``,
variants ``default`` against ``rope-apart``). This probe runs both engines (Triton attention,
uncompiled, no CUDA graphs) on the same random model and prompts, greedy, and compares:

* after a prefill and ``--new-tokens`` greedy tokens: the KV cache, layer by layer (how many keys
  and values differ and by how much, and which cache columns hold them: the prefill is the same code in
  both, the decode steps' columns are written by the kernel in the fused path, by PyTorch apart);
* the sampled tokens and their log-probs.

Run (GPU): python bench/probes/rope_fused_apart.py --json $OUT/rope_fused_apart.json
Smoke (CPU): TRITON_INTERPRET=1 python bench/probes/rope_fused_apart.py --shape tiny-qwen3 --dtype fp16
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from _common import environment, import_rlcore  # noqa: E402

import_rlcore()
from _models import random_model  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    diff = (a.float() - b.float()).abs()
    return {"elements": a.numel(), "differ": int((a != b).sum()), "max_abs": float(diff.max()) if a.numel() else 0.0}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-1.7b")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the random model")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=96)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    from rlcore.rollout.base import SamplingParams
    from rlcore.rollout.engine import RolloutEngine

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = DTYPES[args.dtype]
    model = random_model(args.shape, dtype, device, seed=0, norm_jitter=0.5, num_hidden_layers=args.layers)
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (int(n),), generator=gen).tolist()
               for n in torch.randint(args.prompt_len // 2, args.prompt_len + 1, (args.prompts,), generator=gen)]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0)
    runs = {}
    for name, fused in (("fused", True), ("apart", False)):
        engine = RolloutEngine(model, max_batch_size=len(prompts), max_seq_len=args.prompt_len + args.new_tokens + 8,
                               dtype=dtype, attention="triton", compile=False, use_cuda_graphs=False,
                               rope_in_attention=fused, admit_fraction=0.0, device=device)
        if engine.rope_in_attention != fused or engine.attention != "triton":
            raise SystemExit(f"{name}: the engine chose attention={engine.attention}, rope_in_attention="
                             f"{engine.rope_in_attention}")
        out = engine.generate(prompts, params)
        runs[name] = (out, engine.cache.clone())
        del engine
    (a, cache_a), (b, cache_b) = runs["fused"], runs["apart"]
    result = {"env": environment(), "settings": vars(args), "tokens_equal": bool(torch.equal(a.response_ids, b.response_ids)),
              "logprobs": compare(a.logprobs.float().cpu(), b.logprobs.float().cpu()), "layers": []}
    # static cache [L, 2, slots, kv_heads, columns, D]
    for layer in range(cache_a.shape[0]):
        row = {"layer": layer}
        for which, part in (("key", 0), ("value", 1)):
            x, y = cache_a[layer, part], cache_b[layer, part]
            row[which] = compare(x, y)
            row[f"{which}_columns"] = sorted(set((x != y).any(-1).any(1).nonzero()[:, 1].tolist()))
        result["layers"].append(row)
        print(f"layer {layer}: keys differ {row['key']['differ']} (columns {row['key_columns']}), values differ "
              f"{row['value']['differ']} (columns {row['value_columns']}), max |dk| {row['key']['max_abs']:.3g}, "
              f"max |dv| {row['value']['max_abs']:.3g}")
    print(f"tokens equal: {result['tokens_equal']}; log-probs differ at {result['logprobs']['differ']} of "
          f"{result['logprobs']['elements']}, max {result['logprobs']['max_abs']:.3g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
