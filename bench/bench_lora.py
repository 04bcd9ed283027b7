"""A LoRA GRPO step at 7B shape on one GPU, next to full fine-tuning at 1.5B (rlcore ``Trainer``).

Setup: the GRPO step of ``bench_grpo_step.py`` (32 prompts x 8 samples, prompts of 128 random tokens,
responses of exactly 256 tokens, temperature-1 sampling, bf16 weights, AdamW, a constant reward, no KL
term, one optimizer step per rollout, micro-batches of ``--micro`` sequences), run by rlcore's
``Trainer`` on random-init models saved with ``save_pretrained``:

* ``full-1.5b``: Qwen2-1.5B shape, every weight trains (the default rollout engine, gradient
  checkpointing off);
* ``lora-7b``: Qwen2.5-7B shape (hidden 3584, 28 layers, 28/4 heads, intermediate 18944, vocab 152064,
  untied embeddings), LoRA adapters of rank ``--rank`` (alpha 2 x rank) on every attention and MLP
  projection (``actor.lora``), gradient checkpointing on; the rollout engine holds its own merged copy
  of the weights, so the step fits with room for the rollout's KV cache when the peak stays well under
  the card's memory.

Each configuration runs in its own subprocess (``bench_grpo_step.py --worker``); seconds per step is the
mean of the measured steps after the warm-up ones. The table gives s/step, tokens/s (prompt +
completion tokens of the step), the peak memory the trainer recorded (``memory/peak_gb``) and the step
breakdown; the raw results go to ``--out`` as JSON.

Run (one H100/H200):  python bench/bench_lora.py --out $OUT/bench_lora.json
Smoke test (CPU):      python bench/bench_lora.py --tiny   (tiny shapes; the numbers mean nothing)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))

#: Qwen2.5-7B's shape (a Llama-3-8B-class decoder: 7.6B parameters).
QWEN2_7B = dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False)
TARGETS = "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"


def configurations(tiny: bool, rank: int) -> list[dict[str, Any]]:
    """(name, shape, gradient checkpointing, extra overrides) of the compared runs."""
    lora = [f"actor.lora.rank={rank}", f"actor.lora.alpha={2 * rank}", f"actor.lora.target_modules={TARGETS}"]
    return [dict(name="full-1.5b", shape="tiny" if tiny else "qwen2-1.5b", system="rlcore", overrides=[]),
            dict(name=f"lora-7b-r{rank}", shape="tiny" if tiny else "qwen2-7b", system="rlcore-gc",
                 overrides=lora)]


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'config':<14} {'s/step':>8} {'tokens/s':>10} {'peak GB':>8}  breakdown (s)")
    for r in rows:
        if "step_s" not in r:
            print(f"{r['config']:<14} failed: {r.get('error')}")
            continue
        peak = r.get("last", {}).get("memory/peak_gb")
        parts = "  ".join(f"{k[5:-2]} {v:.3f}" for k, v in r["breakdown"].items() if k != "time/step_s")
        print(f"{r['config']:<14} {r['step_s']:8.3f} {r['tokens_per_s']:10.0f} "
              f"{peak if peak is None else round(peak, 1)!s:>8}  {parts}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT") or tempfile.gettempdir(), "bench_lora.json"))
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test with tiny shapes")
    parser.add_argument("--rank", type=int, default=64, help="LoRA rank of the 7B run")
    parser.add_argument("--micro", type=int, default=None, help="sequences per forward/backward micro-batch")
    parser.add_argument("--configs", default=None, help="comma list of configuration names (default: all)")
    parser.add_argument("--workdir", default=None, help="models, runs and results (default: a temp dir)")
    parser.add_argument("--timeout-s", type=float, default=540.0, help="per configuration")
    args = parser.parse_args(argv)
    sys.path.insert(0, HERE)
    import torch
    from _common import environment, write_json

    import bench_grpo_step as step
    from bench_rollout import SHAPES

    SHAPES.setdefault("qwen2-7b", QWEN2_7B)  # build_model_dir reads the shape from here
    workdir = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="bench_lora_"))
    os.makedirs(workdir, exist_ok=True)
    reward_file = os.path.join(workdir, "constant_reward.py")
    with open(reward_file, "w") as f:
        f.write(step.REWARD_SOURCE)
    payload: dict[str, Any] = {"env": environment(), "command": " ".join(["python", "bench/bench_lora.py", *argv]),
                               "results": []}
    print(payload["env"], flush=True)
    wanted = set(args.configs.split(",")) if args.configs else None
    for conf in configurations(args.tiny, args.rank):
        if wanted is not None and conf["name"] not in wanted:
            continue
        spec = dict(step.PRESETS["tiny" if args.tiny else "full"], shape=conf["shape"])
        if args.micro is not None:
            spec["micro"] = args.micro
        spec.update(device="cuda" if torch.cuda.is_available() and not args.tiny else "cpu",
                    rlcore_overrides=conf["overrides"], vocab=SHAPES[conf["shape"]]["vocab_size"],
                    workdir=os.path.join(workdir, conf["name"]), reward_file=reward_file)
        spec["rows"] = spec["prompts"] * (spec["warmup"] + spec["steps"] + 1)
        os.makedirs(spec["workdir"], exist_ok=True)
        t0 = time.perf_counter()
        spec["model_dir"] = step.build_model_dir(os.path.join(workdir, f"model-{conf['shape']}"), conf["shape"],
                                                 spec["dtype"])
        result = step.launch(conf["system"], spec, args.timeout_s)
        result.update(config=conf["name"], shape=conf["shape"], overrides=conf["overrides"],
                      build_model_s=time.perf_counter() - t0 - result.get("wall_s", 0.0))
        payload["results"].append(result)
        write_json(args.out, payload)
    print_table(payload["results"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
