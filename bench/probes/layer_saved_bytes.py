"""Activation bytes a token one decoder layer keeps for its backward: eager, compiled, and compiled
with ``recompute_pointwise`` (``<role>.compile_recompute_pointwise``), at the Qwen2-1.5B layer shape
in bf16 (random weights, no download). Runs on CPU (Inductor's CPU backend makes the same
forward/backward split as on CUDA).

    python bench/probes/layer_saved_bytes.py [--tokens 512] [--json out.json]

Counted with ``torch.autograd.graph.saved_tensors_hooks``: every tensor saved for the backward, each
storage once, the layer's weights left out.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _common import environment, import_rlcore  # noqa: E402

import_rlcore()


def saved_per_token(layer, x: torch.Tensor, rope) -> tuple[float, list]:
    saved: dict[int, tuple[int, str, tuple]] = {}

    def pack(t):
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = (storage.nbytes(), str(t.dtype).replace("torch.", ""), tuple(t.shape))
        return t

    positions = torch.arange(x.shape[1])[None]
    cos, sin = rope(x, positions)
    call = dict(attention_mask=None, position_ids=positions, position_embeddings=(cos, sin))
    out = layer(x, **call)  # compiles (the split is made here)
    (out[0] if isinstance(out, tuple) else out).float().sum().backward()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, **call)
    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    kept = sorted((v for k, v in saved.items() if k not in weights), key=lambda v: -v[0])
    tokens = x.shape[0] * x.shape[1]
    return sum(v[0] for v in kept) / tokens, [(dtype, shape, b / tokens) for b, dtype, shape in kept]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from rlcore.distributed.fsdp import compile_layers, decoder_layers
    from rlcore.rollout.tiny import tiny_causal_lm

    torch.manual_seed(0)
    model = tiny_causal_lm("qwen2", hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                           num_key_value_heads=2, num_hidden_layers=1, vocab_size=512,
                           max_position_embeddings=max(4096, args.tokens)).to(torch.bfloat16)
    rope = model.model.rotary_emb
    x = torch.randn(1, args.tokens, 1536, dtype=torch.bfloat16, requires_grad=True)
    rows = {}
    for name in ("eager", "compiled", "compiled+recompute_pointwise"):
        torch._dynamo.reset()
        copy_ = copy.deepcopy(model)
        if name != "eager":
            compile_layers(copy_, "probe", recompute_pointwise=name.endswith("pointwise"))
        per_token, kept = saved_per_token(decoder_layers(copy_)[0], x, rope)
        rows[name] = {"bytes_per_token": per_token, "kept": kept}
        print(f"{name:30s} {per_token / 1024:7.1f} KB a token ({len(kept)} tensors)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(), "tokens": args.tokens, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
