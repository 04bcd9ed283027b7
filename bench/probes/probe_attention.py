"""Probe: the decode-attention kernel as the engine calls it in a GRPO step, against other versions.

Setting: 256 slots, 8 samples a prompt reading the prompt's 128 columns from the first sample's
cache row (prompt sharing), Qwen2-0.5B heads (14 query, 2 key/value, dim 64), one new token per slot
at context ``c`` (its column), RoPE rows gathered beforehand, one call per layer on 24 layer caches
(keys and values come from memory), CUDA-graph replays. Each version is loaded from a file, so a
kernel from an earlier commit can be timed in the same process as the installed one:

    git show 5b61e7c:core/rollout/decode_attention.py > /tmp/attention_before.py
    python bench/probes/probe_attention.py --versions /tmp/attention_before.py --contexts 129,256,383

``--settings`` times the installed version under several kernel settings in the same process:

    python bench/probes/probe_attention.py --settings '[{}, {"subblocks": 4, "num_warps": 4}]'

``unique MB`` counts each prompt's keys and values once and each slot's own columns once.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for _common
from _common import environment, graph_ms, import_rlcore, write_json  # noqa: E402

import_rlcore()

from rlcore.kernels import decode_attention  # noqa: E402

SLOTS, SAMPLES, PROMPT, KV_HEADS, HEADS, DIM, LAYERS, COLUMNS = 256, 8, 128, 2, 14, 64, 24, 448


def load_version(path: str):
    """The module at ``path`` (a copy of ``rlcore/kernels/decode_attention.py``)."""
    spec = importlib.util.spec_from_file_location(f"attention_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_version(module, context: int, tuning: dict) -> tuple[float, float]:
    """Microseconds a layer of ``module.attend_new`` at ``context`` (the new token's column), and the
    largest absolute difference of its output from the PyTorch reference (one call, first layer)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    caches = [torch.randn(2, SLOTS, KV_HEADS, COLUMNS, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
              for _ in range(LAYERS)]
    proj = torch.randn(SLOTS, (HEADS + 2 * KV_HEADS) * DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    bias = torch.zeros(SLOTS, COLUMNS, device="cuda", dtype=torch.bfloat16)
    cos, sin = torch.randn(2, SLOTS, DIM, device="cuda", generator=gen)
    columns = torch.full((SLOTS,), context, device="cuda", dtype=torch.int64)
    source = torch.arange(SLOTS, device="cuda", dtype=torch.int32) // SAMPLES * SAMPLES
    end = torch.full((SLOTS,), PROMPT, device="cuda", dtype=torch.int32)
    length = -(-(context + 1) // 64) * 64
    rotary = (cos, sin, None, columns, HEADS, KV_HEADS)
    got = module.attend_new(proj, caches[0].clone(), bias, length, *rotary, shared=(source, end), **tuning)
    expected = decode_attention.reference_new(proj, caches[0].clone(), bias, length, cos, sin,
                                              torch.arange(SLOTS, device="cuda"), columns, HEADS, KV_HEADS,
                                              (source, end))
    error = float((got.float() - expected).abs().max())

    def step():
        for layer in caches:
            module.attend_new(proj, layer, bias, length, *rotary, shared=(source, end), **tuning)
    return graph_ms(step) * 1e3 / LAYERS, error


def unique_mb(context: int) -> float:
    per_column = KV_HEADS * DIM * 2 * 2  # key and value, bf16
    return (SLOTS // SAMPLES * PROMPT + SLOTS * (context - PROMPT)) * per_column / 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--versions", default="", help="comma-separated files of other kernel versions")
    parser.add_argument("--contexts", default="129,192,256,320,383")
    parser.add_argument("--tuning", default="", help='kernel settings for the --versions files, e.g. '
                        '{"num_warps": 4} (as JSON)')
    parser.add_argument("--settings", default="[{}]", help="a JSON list of kernel settings, each timed for the "
                        'installed version, e.g. \'[{}, {"subblocks": 2}]\'')
    parser.add_argument("--rounds", type=int, default=2, help="times every version is timed, interleaved")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    tuning = json.loads(args.tuning) if args.tuning else {}
    versions = {("installed" if setting == {} else f"installed {json.dumps(setting)}"): (decode_attention, setting)
                for setting in json.loads(args.settings)}
    versions.update({path: (load_version(path), tuning) for path in args.versions.split(",") if path})
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        for round_ in range(args.rounds):
            for name, (module, setting) in versions.items():
                us, error = time_version(module, context, setting)
                rows.append({"version": name, "context": context, "round": round_, "us": us,
                             "unique_mb": unique_mb(context), "max_abs_error": error})
                print(f"context {context:4d}  {name:<32} {us:6.2f} us/layer  "
                      f"({unique_mb(context):5.1f} MB unique, {unique_mb(context) / us:5.2f} TB/s; "
                      f"max abs error {error:.3g})", flush=True)
    write_json(args.out, {"env": environment(), "command": " ".join(sys.argv), "tuning": tuning, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
