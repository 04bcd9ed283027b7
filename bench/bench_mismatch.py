"""How far rollout log-probs are from the trainer's recomputation: the engine against HF ``generate``.

Both backends sample the same prompts with the same model (``--dtype``, bf16 on the GPU); the
trainer then recomputes the sampled tokens' log-probs by teacher forcing, as a training step does
(``rlcore.trainer.experience.batched_logprobs``), and ``rlcore.rlmath.logprob_mismatch`` measures
the gap over the valid response tokens: mean and max absolute difference and the k3 KL(rollout ||
trainer) per token, the metrics a training step logs as ``rollout/logprob_*``. The issue's target:
the engine's mismatch is at most HF ``generate``'s.

Run (CPU): python bench/bench_mismatch.py --tiny --out mismatch.json
Run (GPU): python3 bench/bench_mismatch.py --device cuda --shape qwen2-1.5b --dtype bf16 --prompts 64 \\
    --max-new-tokens 512 --out mismatch_h200.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import environment, import_rlcore, write_json  # noqa: E402
from bench_update import SHAPES  # noqa: E402 - the same model shapes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke setting)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-0.5b")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import_rlcore()
    from rlcore import rlmath
    from rlcore.rollout.base import SamplingParams
    from rlcore.rollout.engine import RolloutEngine
    from rlcore.rollout.hf import HFGenerateBackend
    from rlcore.rollout.tiny import causal_lm_from_config, tiny_causal_lm
    from rlcore.trainer.experience import batched_logprobs

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if args.tiny:
        model = tiny_causal_lm("qwen2", dtype=dtype).to(args.device)
    else:
        from transformers import Qwen2Config

        cfg = Qwen2Config(**SHAPES[args.shape], max_position_embeddings=32768, tie_word_embeddings=True)
        model = causal_lm_from_config(cfg, dtype=dtype, device=args.device)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (int(torch.randint(args.prompt_len // 2, args.prompt_len + 1, (1,),
                                                           generator=g)),), generator=g).tolist()
               for _ in range(args.prompts)]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=0)
    backends = {"engine": RolloutEngine(model, max_batch_size=len(prompts),
                                        max_seq_len=args.prompt_len + args.max_new_tokens, device=args.device),
                "hf": HFGenerateBackend(model)}
    results = {}
    for name, backend in backends.items():
        batch = backend.generate(prompts, params)
        ids, mask = batch.sequences()
        trainer = batched_logprobs(model, ids, mask, batch.response_ids.shape[1], args.temperature or 1.0, 16,
                                   batch.response_mask)
        m = rlmath.logprob_mismatch(batch.logprobs.float(), trainer, batch.response_mask)
        results[name] = {k: float(v) for k, v in m.items()}
        results[name]["tokens"] = int(batch.response_mask.sum())
    payload = {"environment": environment(), "args": vars(args), "results": results,
               "engine_at_most_hf": results["engine"]["kl"] <= results["hf"]["kl"]}
    if args.out:
        write_json(args.out, payload)
    print(f"{'backend':<8} {'tokens':>7} {'|diff| mean':>12} {'|diff| max':>11} {'KL(k3)':>10}")
    for name, r in results.items():
        print(f"{name:<8} {r['tokens']:7d} {r['abs_diff_mean']:12.3e} {r['abs_diff_max']:11.3e} {r['kl']:10.3e}")


if __name__ == "__main__":
    main()
