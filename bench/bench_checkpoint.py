"""Checkpoint and logging benchmark: what a save, a verified resume and a logged step cost.

Model: a random-init Qwen2-shaped causal LM (``--hidden``, ``--layers``, ``--vocab``; defaults are
Qwen2-0.5B's width with 6 layers) plus AdamW state after one step, saved through
``DefaultCheckpointPolicy`` in a temporary run directory on the disk of ``--dir``.

Reported:

* ``save_s`` (synchronous: write + fsync + manifest hashing + rename), and its parts
  ``write_s`` / ``manifest_s``; bytes written and GB/s;
* ``async_block_s``: how long an asynchronous save holds the training loop (the CPU copy into the
  buffers of the previous save; ``async_block_first_s`` for the first one, which allocates them),
  and ``async_total_s`` until it is on disk;
* ``verify_s`` (sizes + sha256 of every file) and ``resume_s`` (verify + load into model and optimizer);
* ``log_call_us``: one ``sparse-logging`` metrics call (JSONL line + console line, 40 metrics);
  steps that are not logged make no call at all.

Run:   python bench/bench_checkpoint.py --dir /tmp/rlcore-bench-ckpt --json ckpt.json
       python bench/bench_checkpoint.py --hidden 64 --layers 2 --vocab 1000   (smoke)
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import environment, import_rlcore, write_json  # noqa: E402

import_rlcore()

import torch  # noqa: E402


def build_state(hidden: int, layers: int, vocab: int):
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlcore.trainer.checkpoint import RNGState

    cfg = Qwen2Config(hidden_size=hidden, intermediate_size=int(hidden * 5.43), num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 448),
                      vocab_size=vocab, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return {"actor": model, "actor_optim": opt, "rng": RNGState()}


def measure_saves(root: str, state: dict) -> dict:
    from rlcore.config.schema import TrainerConfig
    from rlcore.protocols import DistInfo
    from rlcore.trainer.store import manifest as store
    from rlcore.trainer.checkpoint import DefaultCheckpointPolicy

    manifest_s: list[float] = []  # per save, in order
    original = store.write_manifest

    def timed_manifest(*a, **kw):
        t = time.perf_counter()
        original(*a, **kw)
        manifest_s.append(time.perf_counter() - t)

    store.write_manifest = timed_manifest
    try:
        policy = DefaultCheckpointPolicy(TrainerConfig(output_dir=root, save_total_limit=0), DistInfo())
        t = time.perf_counter()
        path = policy.save(1, state)
        save_s = time.perf_counter() - t
        nbytes = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
        asynchronous = DefaultCheckpointPolicy(TrainerConfig(output_dir=root, save_total_limit=0,
                                                             async_save=True), DistInfo())
        blocks, totals = [], []
        for step in (2, 3):  # the first allocates the CPU copy, the next ones refill it
            t = time.perf_counter()
            asynchronous.save(step, state)
            blocks.append(time.perf_counter() - t)
            asynchronous.wait()
            totals.append(time.perf_counter() - t)
    finally:
        store.write_manifest = original
    t = time.perf_counter()
    problems = store.verify(Path(path))
    verify_s = time.perf_counter() - t
    if problems:
        raise RuntimeError(problems)
    resume = DefaultCheckpointPolicy(TrainerConfig(output_dir=root, resume=path), DistInfo())
    t = time.perf_counter()
    resume.resume(state)
    resume_s = time.perf_counter() - t
    return {"bytes": nbytes, "save_s": save_s, "write_s": save_s - manifest_s[0], "manifest_s": manifest_s[0],
            "save_gb_per_s": nbytes / save_s / 1e9,
            "async_block_first_s": blocks[0], "async_block_s": blocks[1], "async_total_s": totals[1],
            "verify_s": verify_s, "resume_s": resume_s}


def measure_logging(root: str, calls: int = 2000) -> float:
    from rlcore.plugins.metrics_file import METRICS_FILE, JsonlSink
    from rlcore.plugins.sparse_logging import SparseLogger

    metrics = {f"group{i % 8}/metric{i}": 0.123456 * i for i in range(40)}
    metrics["time/step_s"] = 1.234
    logger = SparseLogger(root, tensorboard=False, stream=io.StringIO())
    record = JsonlSink(os.path.join(root, METRICS_FILE), fresh=True)  # every run's metrics.jsonl
    t = time.perf_counter()
    for step in range(calls):
        record.metrics(step, metrics, "train")
        logger.metrics(step, metrics, "train")
    per_call = (time.perf_counter() - t) / calls
    record.close(calls, "completed", {})
    logger.close(calls, "completed", {})
    return per_call * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--dir", default=None, help="parent of the temporary run directory")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="rlcore-bench-ckpt-", dir=args.dir)
    try:
        state = build_state(args.hidden, args.layers, args.vocab)
        params = sum(p.numel() for p in state["actor"].parameters())
        result = {"params": params, **measure_saves(os.path.join(root, "run"), state),
                  "log_call_us": measure_logging(os.path.join(root, "log"))}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    payload = {"env": environment(), "args": vars(args), "result": result}
    for k, v in result.items():
        print(f"{k:>16}: {v:.4g}" if isinstance(v, float) else f"{k:>16}: {v}")
    write_json(args.json, payload)


if __name__ == "__main__":
    main()
