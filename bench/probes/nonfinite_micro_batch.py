"""Replay a micro-batch that ``RLCORE_CHECK_FINITE`` saved, through one actor forward and backward,
under several compilations of the decoder layers, and say which ones give non-finite gradients.

    python bench/probes/nonfinite_micro_batch.py SAVED.pt --shape qwen2.5-1.5b --variants eager,compiled,strict

A variant name containing ``logits`` uses the logits head (else the trainer's ``auto``); one ending in
``-gc`` turns activation checkpointing on; one containing ``masked`` runs the forward on the rows as they
come, with their attention mask (as before rlcore.trainer.aligned), ``raw`` too at their own width.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import import_rlcore  # noqa: E402

import_rlcore()
from _models import random_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("saved")
    ap.add_argument("--shape", default="qwen2.5-1.5b")
    ap.add_argument("--variants", default="eager,compiled,strict")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    from collections import defaultdict

    from rlcore.config.schema import PPOConfig
    from rlcore.distributed import fsdp
    from rlcore.trainer import aligned as aligned_rows, models
    from rlcore.trainer.experience import Experience
    from rlcore.trainer.update import actor_micro_loss

    saved = torch.load(args.saved)
    dev = args.device
    exp = Experience(input_ids=saved["input_ids"].to(dev), attention_mask=saved["attention_mask"].to(dev),
                     response_mask=saved["response_mask"].to(dev), old_logprobs=None,
                     scores=torch.zeros(len(saved["input_ids"]), device=dev),
                     advantages=saved["advantages"].to(dev))
    plain = fsdp.layer_compile_options
    safe_width = models.safe_masked_width
    for variant in args.variants.split(","):
        model = random_model(args.shape, torch.bfloat16, dev, seed=args.seed)
        model.train()
        models.set_logprob_head(model, "logits" if "logits" in variant else "auto")
        aligned_rows.ENABLED = "masked" not in variant  # masked: the rows as they come, with their mask
        # raw: at their own width, even 64 past a multiple of 128 (before rlcore.trainer.aligned.safe_masked_width)
        models.safe_masked_width = (lambda width, multiple_of=8: width) if "raw" in variant else safe_width
        if variant.endswith("-gc"):  # activation checkpointing on, as gradient_checkpointing=true/auto trains
            fsdp.enable_gradient_checkpointing(model)
        if variant.startswith("compiled") or variant.startswith("strict"):
            if variant.startswith("strict"):
                fsdp.layer_compile_options = lambda: {k: v for k, v in plain().items() if "mix_order" not in k}
            torch._dynamo.reset()
            fsdp.compile_layers(model, "actor")
        t = time.perf_counter()
        stats = defaultdict(list)
        try:
            actor_micro_loss(model, exp, PPOConfig(), 1.0, 0.0, 1.0, stats, packed=False)
            bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
            print(f"{variant:<16} loss {stats['loss/policy'][-1]:.4g}  non-finite grads: {len(bad)} "
                  f"{bad[:3]}  ({time.perf_counter() - t:.1f} s)", flush=True)
        except Exception as error:  # noqa: BLE001 - report and go on
            print(f"{variant:<16} failed: {type(error).__name__}: {str(error)[:200]}", flush=True)
        finally:
            fsdp.layer_compile_options = plain
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
