"""The PPO update on ragged rollouts: padding trimming and length grouping against plain micro-batches.

A rollout of ``--samples`` sequences with prompts of uneven length (left-padded to ``--prompt-len``)
and responses of uneven length (right-padded to ``--response-len``: log-normal lengths, as
responses that stop at EOS are) goes through ``rlcore.trainer.update.ppo_update`` three ways, each
on a fresh copy of the same random-init model:

* ``plain``   — ``ppo.trim_padding=false ppo.group_by_length=false``: every micro-batch is the full width;
* ``trim``    — ``trim_padding=true``: each micro-batch cut to the columns its samples use;
* ``grouped`` — ``trim_padding=true group_by_length=true`` (the defaults): the mini-batch sorted by
  length first, so a micro-batch holds similar lengths and its cut removes most padding.

Two more variants change how the defaults compute rather than what they cut:

* ``chunked``  — the defaults with the log-probs by the reference (``rlcore.rlmath``, PyTorch chunks)
  instead of the one-pass kernels of ``rlcore.kernels.logprob`` (which run on CUDA only; on CPU the two are the same);
* ``compiled`` — the defaults with each decoder layer compiled (``actor.compile=true``).

Variable-length training (same update, other forwards):

* ``packed``  — the defaults with each micro-batch packed into one row (``ppo.pack_sequences=true``;
  ``--attn`` picks the attention: with ``sdpa`` a packed row is one dense masked attention, with
  ``flash_attention_2`` / ``flex_attention`` it is variable-length);
* ``budget``  — the defaults with micro-batches of at most ``--max-tokens`` padded tokens
  (``ppo.max_tokens_per_micro_batch``) instead of ``--micro`` samples;
* ``packed-budget`` — both: micro-batches of ``--max-tokens`` real tokens, each one packed row.

It reports seconds per update (median of ``--repeats`` after one warm-up), the share of the
computed token positions that are padding, and the largest difference of the updated weights
against the first variant (the first three compute the same update;
``tests/unit/test_trainer_trim.py`` checks it). ``--fixed`` gives every sample the full prompt and
response length (the GRPO step benchmark's setting: nothing to trim); ``--profile N`` lists the N
largest kernels of one more (untimed) update of the first variant.

Run (CPU): python bench/bench_update.py --json update.json
Run (GPU): python3 bench/bench_update.py --device cuda --shape qwen2-0.5b --dtype bf16 --samples 256 --micro 32
Run (GPU, the GRPO step's update): python3 bench/bench_update.py --device cuda --shape qwen2-1.5b --dtype bf16 \
    --samples 256 --micro 32 --fixed --variants grouped,chunked,compiled --profile 25
Run (GPU, variable lengths): python3 bench/bench_update.py --device cuda --shape qwen2-1.5b --dtype bf16 \
    --samples 256 --prompt-len 512 --response-len 4096 --micro 8 --max-tokens 32768 \
    --variants grouped,budget,packed,packed-budget --attn sdpa --json update_varlen.json
"""

from __future__ import annotations

import argparse
import contextlib
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
    "qwen2-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                       intermediate_size=8960, vocab_size=151936),
}
#: name -> (trim_padding, group_by_length, log-prob kernels, compiled layers, packed, token budget)
VARIANTS = {"plain": (False, False, True, False, False, False), "trim": (True, False, True, False, False, False),
            "grouped": (True, True, True, False, False, False), "chunked": (True, True, False, False, False, False),
            "compiled": (True, True, True, True, False, False), "packed": (True, True, True, False, True, False),
            "budget": (True, True, True, False, False, True), "packed-budget": (True, True, True, False, True, True),
            "compiled-budget": (True, True, True, True, False, True),
            "compiled-packed-budget": (True, True, True, True, True, True)}
#: how the log-probs leave the last hidden states: the model's logits (the default before ppo.logprob_head),
#: the fused head (rlcore.kernels.linear_logprob), liger-kernel's fused linear cross-entropy per token, or
#: cut-cross-entropy's (``linear_cross_entropy``, exact gradients: ``filter_eps=None``)
HEADS = ("logits", "fused", "liger", "cce")
#: variant suffixes: ``<variant>+<head>`` picks the head, ``...+recompute`` adds
#: gradient_checkpointing=auto with the trainer's token-budget rule (rlcore.trainer.recompute), ``...+keep``
#: keeps the budget as given (checkpointing what does not fit, as before the rule)
#: ``...+masked`` runs the forwards on the rows as they come, with their attention mask (before
#: rlcore.trainer.aligned moved each row's tokens to its first column and dropped the mask)
#: ``...+greedy`` fills padded token-budget micro-batches greedily to the budget (before the least-padding
#: cut, rlcore.trainer.packing.least_padding_groups)
#: ``...+selective`` (with ``+recompute``) checkpoints selectively (``gradient_checkpointing_policy=selective``:
#: the products' and attention's outputs kept, the pointwise work recomputed; the budget lowered to what fits so)
#: ``...+whole`` (with ``+recompute``) checkpoints every layer of a micro-batch that does not fit (the rule before
#: micro-batches checkpointed only the layers they need to)
#: ``...+pointwise`` (compiled variants) compiles the layers with ``recompute_pointwise``
#: (``<role>.compile_recompute_pointwise``: the backward recomputes the pointwise results feeding matrix products)
MODIFIERS = ("recompute", "keep", "masked", "greedy", "selective", "whole", "pointwise")


def parse_variant(name: str) -> tuple[str, str, set[str]]:
    """``"budget+fused+recompute"`` -> ``("budget", "fused", {"recompute"})``."""
    base, *mods = name.split("+")
    heads = [m for m in mods if m in HEADS]
    unknown = [m for m in mods if m not in HEADS and m not in MODIFIERS]
    if base not in VARIANTS or unknown or len(heads) > 1:
        raise ValueError(name)
    return base, (heads[0] if heads else "logits"), set(mods) - set(HEADS)


def liger_token_logprobs(hidden, weight, labels, temperature, with_entropy=False, chunk_bytes=0):
    """liger-kernel's fused linear cross-entropy, per token (``reduction="none"``): ``-loss`` is the
    log-prob; it computes no entropy (zeros, for the metric)."""
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    loss = LigerFusedLinearCrossEntropyFunction.apply(hidden / temperature, weight, labels.long(), None, None, -100,
                                                      0.0, 0.0, "none")[0]
    logp = -loss.float()
    return logp, (torch.zeros_like(logp) if with_entropy else None)


def cce_token_logprobs(hidden, weight, labels, temperature, with_entropy=False, chunk_bytes=0):
    """cut-cross-entropy's linear cross-entropy per token (``reduction="none"``, no gradient filtering, so
    the gradient is exact): ``-loss`` is the log-prob; it computes no entropy (zeros, for the metric)."""
    from cut_cross_entropy import linear_cross_entropy

    loss = linear_cross_entropy(hidden / temperature, weight, labels.long(), reduction="none", filter_eps=None)
    logp = -loss.float()
    return logp, (torch.zeros_like(logp) if with_entropy else None)


def update_flops(config, exp) -> float:
    """Forward + backward FLOPs of the update's sequences (``rlcore.observe.flops``, each at its own length)."""
    from rlcore.observe.flops import estimate_flops

    lengths = exp.attention_mask.sum(-1).tolist()
    return sum(estimate_flops(config, n, n) for n in lengths)


def build_model(shape: str, dtype: torch.dtype, device: str, attn: str = "sdpa"):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, tie_word_embeddings=True)
    cfg._attn_implementation = attn
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
    if args.geometric:  # the reasoning workload's lengths: geometric with this mean, cut at the response length
        u = torch.rand(b, generator=g).clamp(min=1e-12)
        resp_lens = (torch.log(u) / torch.log1p(torch.tensor(-1.0 / args.geometric))).ceil().clamp(1, r).long()
    if args.fixed:
        prompt_lens, resp_lens = torch.full((b,), p), torch.full((b,), r)
    for i in range(b):
        mask[i, p - int(prompt_lens[i]):p + int(resp_lens[i])] = 1
        resp[i, :int(resp_lens[i])] = 1
    exp = Experience(input_ids=ids.to(device), attention_mask=mask.to(device), response_mask=resp.to(device),
                     old_logprobs=None, scores=torch.zeros(b, device=device),
                     advantages=(torch.randn(b, r, generator=g) * resp).to(device))
    return exp, 1.0 - float(mask.sum()) / mask.numel()


def run_variant(model, exp, args, variant: str, profile: int = 0) -> tuple[list[float], list[torch.Tensor], dict]:
    from rlcore.config.schema import PPOConfig
    from rlcore.distributed.fsdp import compile_layers, enable_gradient_checkpointing
    from rlcore.kernels import linear_logprob
    from rlcore.trainer import aligned as aligned_rows, models, packing
    from rlcore.trainer import recompute as recompute_module
    from rlcore.trainer.recompute import Recompute
    from rlcore.trainer.update import ppo_update

    base, head, mods = parse_variant(variant)
    recompute = "recompute" in mods
    floor = recompute_module.MIN_BUDGET
    if "keep" in mods:
        recompute_module.MIN_BUDGET = 1 << 62
    trim, group, kernels, compiled, packed, budget = VARIANTS[base]
    times, last, metrics = [], [], {}
    models.LOGPROB_KERNELS = kernels
    aligned_rows.ENABLED = "masked" not in mods
    packing.LEAST_PADDING = "greedy" not in mods
    fused_impl = linear_logprob.linear_token_logprobs
    if head in ("liger", "cce"):
        linear_logprob.linear_token_logprobs = liger_token_logprobs if head == "liger" else cce_token_logprobs
    try:
        for repeat in range(args.repeats + 1 + bool(profile)):  # warm-up, timed repeats, profiled run
            profiled = repeat == args.repeats + 1
            m = copy.deepcopy(model)
            models.set_logprob_head(m, "logits" if head == "logits" else "fused")
            policies = None
            if recompute:
                enable_gradient_checkpointing(m, selective="selective" in mods)
                policies = {"actor": Recompute(m, "auto", m.config, torch.device(args.device),
                                               logits=head == "logits", selective="selective" in mods,
                                               partial="whole" not in mods)}
            if compiled:
                compile_layers(m, "actor", recompute_pointwise="pointwise" in mods)
            opt = torch.optim.SGD(m.parameters(), lr=1e-3)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
            ppo = PPOConfig(micro_batch_size=args.micro, trim_padding=trim, group_by_length=group,
                            max_tokens_per_micro_batch=args.max_tokens if budget else 0)
            if args.device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            with _profiled(profile if profiled else 0, args.device):
                metrics = ppo_update(exp, actor=m, actor_opt=opt, actor_sched=sched, actor_grad_clip=1.0, ppo=ppo,
                                     grad_accum=1, temperature=1.0, kl_loss_coef=0.0,
                                     generator=torch.Generator().manual_seed(0), packed=packed, recompute=policies)
                if args.device == "cuda":
                    torch.cuda.synchronize()
            if profiled:
                continue
            times.append(time.perf_counter() - t)
            if policies:
                metrics.update(policies["actor"].take_metrics())
            if args.device == "cuda":
                metrics["memory_peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
            last = [p.detach().float().cpu() for p in m.parameters()]
            del m, opt
    finally:
        models.LOGPROB_KERNELS = True
        aligned_rows.ENABLED = True
        packing.LEAST_PADDING = True
        linear_logprob.linear_token_logprobs = fused_impl
        recompute_module.MIN_BUDGET = floor
    return times[1:], last, metrics


@contextlib.contextmanager
def _profiled(top: int, device: str):
    """Print the ``top`` largest kernels (or CPU operators) of the enclosed work; nothing when 0."""
    if not top:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        yield
    key = "cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=70), flush=True)


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
    p.add_argument("--max-tokens", type=int, default=4096, help="token budget of the budget variants")
    p.add_argument("--attn", default="sdpa", help="attention implementation: sdpa | eager | flash_attention_2 | ...")
    p.add_argument("--fixed", action="store_true", help="every prompt and response at full length")
    p.add_argument("--geometric", type=float, default=0.0, metavar="MEAN",
                   help="response lengths geometric with this mean (cut at --response-len), as bench_reasoning draws")
    p.add_argument("--variants", default="plain,trim,grouped",
                   help=f"comma list of {sorted(VARIANTS)}, each with optional +<head> ({', '.join(HEADS)}) and +recompute")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="list the N largest kernels of one update")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    names = [v for v in args.variants.split(",") if v]
    unknown = []
    for name in names:
        try:
            parse_variant(name)
        except ValueError:
            unknown.append(name)
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {sorted(VARIANTS)}")
    import_rlcore()
    model = build_model(args.shape, torch.bfloat16 if args.dtype == "bf16" else torch.float32, args.device, args.attn)
    exp, padding = ragged_rollout(args, model.config.vocab_size, args.device)
    results: dict[str, Any] = {}
    reference = None
    flops = update_flops(model.config, exp)
    peak = None
    if args.device == "cuda":
        from rlcore.observe.flops import peak_flops

        peak = peak_flops(args.device)
    for i, name in enumerate(names):
        try:
            times, weights, metrics = run_variant(model, exp, args, name, args.profile if i == 0 else 0)
        except torch.OutOfMemoryError as error:  # recorded, the other variants still run
            results[name] = {"error": f"out of memory: {str(error).splitlines()[0]}"}
            print(f"{name:<28} out of memory", flush=True)
            torch.cuda.empty_cache()
            continue
        reference = reference or weights
        sec = statistics.median(times)
        results[name] = {"s_per_update": sec, "times": times, "mfu": (flops / sec / peak) if peak else None,
                         "metrics": {k: v for k, v in metrics.items() if isinstance(v, float)},
                         "max_weight_diff_vs_first": max(float((a - b).abs().max())
                                                         for a, b in zip(weights, reference))}
        mfu = f"MFU {results[name]['mfu']:.1%}  " if peak else ""
        print(f"{name:<28} {sec:8.3f} s/update  {mfu}micro-batches {metrics.get('actor/micro_batches', 0):.0f} "
              f"budget {metrics.get('actor/micro_batch_token_budget', 0):.0f} recompute "
              f"{metrics.get('actor/recompute_frac', 0):.2f} peak {metrics.get('memory_peak_gb', 0):.1f} GB  "
              f"max |w - w_{names[0]}| {results[name]['max_weight_diff_vs_first']:.2e}", flush=True)
    names = [n for n in names if "s_per_update" in results[n]]
    if not names:
        return
    base = results[names[0]]["s_per_update"]
    for r in results.values():
        r[f"speedup_vs_{names[0]}"] = base / r["s_per_update"]
    print(f"padding share of the full width: {padding:.1%}; speed-up vs {names[0]}: " +
          ", ".join(f"{n} {results[n][f'speedup_vs_{names[0]}']:.2f}x" for n in names[1:]))
    payload = {"environment": environment(), "args": vars(args), "padding_share": padding, "results": results,
               "update_flops": flops,
               "threads": torch.get_num_threads()}
    if args.json:
        write_json(args.json, payload)


if __name__ == "__main__":
    main()
