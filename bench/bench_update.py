"""The PPO update on ragged rollouts: padding trimming and length grouping against plain micro-batches.

A rollout of ``--samples`` sequences with prompts of uneven length (left-padded to ``--prompt-len``)
and responses of uneven length (right-padded to ``--response-len``: log-normal lengths, as
responses that stop at EOS are) goes through ``rlcore.trainer.update.ppo_update`` three ways, each
on a fresh copy of the same random-init model:

* ``plain``   — ``ppo.trim_padding=false ppo.group_by_length=false``: every micro-batch is the full width;
* ``trim``    — ``trim_padding=true``: each micro-batch cut to the columns its samples use;
* ``grouped`` — ``trim_padding=true group_by_length=true`` (the defaults): the mini-batch sorted by
  length first, so a micro-batch holds similar lengths and its cut removes most padding.

It reports seconds per update (median of ``--repeats`` after one warm-up), the share of the
computed token positions that are padding, and the largest difference of the updated weights
against ``plain`` (the three compute the same update; ``tests/unit/test_trainer_trim.py`` checks it).

Run (CPU): python bench/bench_update.py --json update.json
Run (GPU): python3 bench/bench_update.py --device cuda --shape qwen2-0.5b --dtype bf16 --samples 256 --micro 32
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import environment, import_rlcore, write_json  # noqa: E402

SHAPES = {
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=768, vocab_size=8192),
    "qwen2-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       intermediate_size=4864, vocab_size=151936),
}
VARIANTS = {"plain": (False, False), "trim": (True, False), "grouped": (True, True)}


def build_model(shape: str, dtype: torch.dtype, device: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg).to(device=device, dtype=dtype)


def ragged_rollout(args: argparse.Namespace, vocab: int, device: str):
    """Experience of ragged prompts and responses; returns it and the padding share of its full width."""
    from rlcore.trainer.experience import Experience

    g = torch.Generator().manual_seed(0)
    b, p, r = args.samples, args.prompt_len, args.response_len
    ids = torch.randint(3, vocab, (b, p + r), generator=g)
    mask = torch.zeros(b, p + r, dtype=torch.long)
    resp = torch.zeros(b, r)
    prompt_lens = torch.randint(p // 4, p + 1, (b,), generator=g)
    resp_lens = torch.exp(torch.randn(b, generator=g) * 0.6 + torch.log(torch.tensor(r / 3.0))).clamp(1, r).long()
    for i in range(b):
        mask[i, p - int(prompt_lens[i]):p + int(resp_lens[i])] = 1
        resp[i, :int(resp_lens[i])] = 1
    exp = Experience(input_ids=ids.to(device), attention_mask=mask.to(device), response_mask=resp.to(device),
                     old_logprobs=None, scores=torch.zeros(b, device=device),
                     advantages=(torch.randn(b, r, generator=g) * resp).to(device))
    return exp, 1.0 - float(mask.sum()) / mask.numel()


def run_variant(model, exp, args, trim: bool, group: bool) -> tuple[list[float], list[torch.Tensor]]:
    from rlcore.config.schema import PPOConfig
    from rlcore.trainer.update import ppo_update

    times, last = [], []
    for _ in range(args.repeats + 1):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        ppo = PPOConfig(micro_batch_size=args.micro, trim_padding=trim, group_by_length=group)
        if args.device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        ppo_update(exp, actor=m, actor_opt=opt, actor_sched=sched, actor_grad_clip=1.0, ppo=ppo, grad_accum=1,
                   temperature=1.0, kl_loss_coef=0.0, generator=torch.Generator().manual_seed(0))
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        last = [p.detach().float().cpu() for p in m.parameters()]
        del m, opt
    return times[1:], last


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="small")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    import_rlcore()
    model = build_model(args.shape, torch.bfloat16 if args.dtype == "bf16" else torch.float32, args.device)
    exp, padding = ragged_rollout(args, model.config.vocab_size, args.device)
    results: dict[str, Any] = {}
    reference = None
    for name, (trim, group) in VARIANTS.items():
        times, weights = run_variant(model, exp, args, trim, group)
        reference = reference or weights
        results[name] = {"s_per_update": statistics.median(times), "times": times,
                         "max_weight_diff_vs_plain": max(float((a - b).abs().max()) for a, b in zip(weights, reference))}
        print(f"{name:<8} {results[name]['s_per_update']:8.3f} s/update  "
              f"max |w - w_plain| {results[name]['max_weight_diff_vs_plain']:.2e}", flush=True)
    base = results["plain"]["s_per_update"]
    for r in results.values():
        r["speedup_vs_plain"] = base / r["s_per_update"]
    print(f"padding share of the full width: {padding:.1%}; speed-up trim {results['trim']['speedup_vs_plain']:.2f}x, "
          f"grouped {results['grouped']['speedup_vs_plain']:.2f}x")
    payload = {"environment": environment(), "args": vars(args), "padding_share": padding, "results": results,
               "threads": torch.get_num_threads()}
    if args.json:
        write_json(args.json, payload)


if __name__ == "__main__":
    main()
