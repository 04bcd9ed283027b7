"""The training forward's gradients at several widths, rows moved left without a mask (rlcore's way)
against the rows as they come with their attention mask: the second gives NaN gradients where the
cuDNN SDPA backward fails under a mask (widths 64 past a multiple of 128; pytorch/pytorch#196678).

    python bench/probes/cudnn_masked_nan.py [--widths 192,704,1280,1344] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import environment, import_rlcore  # noqa: E402

import_rlcore()


def nonfinite_grads(width: int, aligned: bool, seed: int = 0) -> int:
    from rlcore.rollout.tiny import tiny_causal_lm
    from rlcore.trainer import aligned as aligned_rows, models

    model = tiny_causal_lm("qwen2", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=512, max_position_embeddings=4096, vocab_size=512)
    model = model.to("cuda", torch.bfloat16).train()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 512, (6, width), generator=g)
    mask = torch.ones(6, width, dtype=torch.long)
    for row in range(6):
        mask[row, :int(torch.randint(1, 60, (1,), generator=g))] = 0
    aligned_rows.ENABLED = aligned
    try:
        logp, _ = models.response_logprobs(model, ids.cuda(), mask.cuda(), width // 2)
        (logp.float() * torch.randn(logp.shape, generator=g).cuda()).sum().backward()
    finally:
        aligned_rows.ENABLED = True
    return sum(not bool(torch.isfinite(p.grad).all()) for p in model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", default="192,704,1280,1344")
    ap.add_argument("--json", "--out", dest="json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (the cuDNN attention kernel)")
    rows = []
    for width in map(int, args.widths.split(",")):
        row = {"width": width, "aligned_nonfinite": nonfinite_grads(width, True),
               "masked_nonfinite": nonfinite_grads(width, False)}
        rows.append(row)
        print(f"width {width:5d} (mod 128 = {width % 128:3d}): non-finite gradients aligned "
              f"{row['aligned_nonfinite']}, masked {row['masked_nonfinite']}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"environment": environment(), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
