"""Cost of switching the actor between its training and generation layouts.

For each model shape and layout it builds a random-init model (fp32 master weights), shards it,
then repeats: one training step (AdamW, batch 4 x 256 tokens), switch to the generation layout,
a short greedy generation (8 prompts of 64 tokens per rank, 32 new tokens, HF ``generate``), switch back. It reports the
seconds of each switch (first and median of the repeats), the peak device memory during the switch
to generation, the memory held at rest (training layout) and inside the generation layout, and the
training-step and generation times.

Layouts:

* ``fsdp`` — the default policy: FSDP2 FULL_SHARD, bf16 compute; generation gathers every unit.
* ``replica`` (one process only) — the ``remesh`` generation replica over a 1-rank tensor-parallel
  mesh: the cost of filling a separate bf16 copy from the training shards (and freeing it).
* ``remesh-tT-gG`` (several processes) — the ``remesh`` plugin with those sizes.

Run (one GPU):   python bench/bench_reshard.py --out bench/results/reshard.json
Run (N GPUs):    torchrun --nproc_per_node=N bench/bench_reshard.py --layouts fsdp,remesh-t2-g2,remesh-t4-g2
Smoke test:      python bench/bench_reshard.py --tiny        (CPU, gloo, tiny shapes; numbers mean nothing)
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import environment, import_rlcore, write_json  # noqa: E402

import_rlcore()
try:
    import omegaconf  # noqa: F401  (rlcore.config's loader needs it; the schema alone does not)
except ImportError:  # a bare GPU image: load the schema without the package's loader
    import types

    _config = types.ModuleType("rlcore.config")
    _config.__path__ = [os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "core", "config")]
    sys.modules["rlcore.config"] = _config
from rlcore.config.schema import FSDPConfig, RemeshingConfig  # noqa: E402
from rlcore.distributed.fsdp import apply_fsdp, build_mesh  # noqa: E402
from rlcore.distributed.remesh import RemeshPolicy, TensorParallelReplica  # noqa: E402
from rlcore.distributed.reshard import FSDPReshardPolicy, SwitchTimer, gathered  # noqa: E402
from rlcore.protocols import DistInfo  # noqa: E402
from rlcore.rollout.base import SamplingParams  # noqa: E402
from rlcore.rollout.hf import HFGenerateBackend  # noqa: E402

from bench_rollout import SHAPES  # noqa: E402  (Qwen2-0.5B / 1.5B / tiny shapes, shared with the rollout benchmark)


#: 32 new tokens, greedy, no EOS: every layout generates the same number of tokens.
GREEDY = SamplingParams(max_new_tokens=32, temperature=0.0, eos_token_ids=(), pad_token_id=0)


def start_process_group(device: str) -> DistInfo:
    """Join torchrun's group, or make a one-process group so FSDP2 runs exactly as it would on N ranks."""
    import torch.distributed as tdist

    if "WORLD_SIZE" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    local = int(os.environ.get("LOCAL_RANK", 0))
    dev = torch.device("cuda", local) if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    tdist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return DistInfo(rank=tdist.get_rank(), world_size=tdist.get_world_size(), local_rank=local, device=dev)


def build(shape: str, dev: torch.device) -> torch.nn.Module:
    from transformers import Qwen2Config

    from rlcore.rollout.tiny import causal_lm_from_config

    cfg = Qwen2Config(max_position_embeddings=4096, rms_norm_eps=1e-6, **SHAPES[shape])
    return causal_lm_from_config(cfg, dtype=torch.float32, device=dev, seed=0).train()


def gib(dev: torch.device, peak: bool = False) -> float:
    if dev.type != "cuda":
        return 0.0
    return (torch.cuda.max_memory_allocated(dev) if peak else torch.cuda.memory_allocated(dev)) / 2**30


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Layout:
    """Shard a model and switch it, for one layout name."""

    def __init__(self, name: str, dist: DistInfo, fsdp: FSDPConfig):
        self.name, self.dist, self.fsdp = name, dist, fsdp
        self.timer = SwitchTimer(dist.device)
        self.policy: Any = None
        self.replica: TensorParallelReplica | None = None
        if name.startswith("remesh"):
            t, g = (int(p[1:]) for p in name.split("-")[1:3])
            self.policy = RemeshPolicy(fsdp, RemeshingConfig(True, g, t), dist)
        elif dist.distributed:
            self.policy = FSDPReshardPolicy(fsdp, dist)

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.policy is not None:
            return self.policy.prepare(model, "actor")
        if self.name == "replica":
            mesh = build_mesh("FULL_SHARD", self.dist)  # 1-D over the one rank: training and replica share it
            self.replica = TensorParallelReplica(model, mesh, torch.bfloat16, self.dist.device)
            return apply_fsdp(model, self.fsdp, self.dist, mesh=mesh)
        return apply_fsdp(model, self.fsdp, self.dist)

    def generation(self, model: torch.nn.Module):
        if self.policy is not None:
            return self.policy.generation(model)
        if self.replica is not None:
            return self._replica_context(model)
        return gathered(model, self.timer, True)

    def _replica_context(self, model):
        import contextlib

        @contextlib.contextmanager
        def ctx():
            with self.timer.measure("to_gen"):
                self.replica.load(model, aligned=True)
            try:
                yield self.replica.module
            finally:
                with self.timer.measure("to_train"):
                    self.replica.release()

        return ctx()

    def generate(self, fn, prompts, params):
        """Through the policy, as the trainer does (tensor-parallel replicas pool their ranks' prompts)."""
        if self.policy is None:
            return fn(prompts, params)
        share = self.policy.generation_share(prompts, params)
        return share.own(fn(share.prompts, share.params))

    def stats(self) -> dict[str, float]:
        return self.policy.stats() if self.policy is not None else dict(self.timer.values)


def measure(shape: str, layout_name: str, dist: DistInfo, repeats: int, seq: int) -> dict[str, Any]:
    dev = dist.device
    fsdp = FSDPConfig(param_dtype="bf16" if dev.type == "cuda" else "fp32", reduce_dtype="fp32")
    layout = Layout(layout_name, dist, fsdp)
    model = layout.prepare(build(shape, dev))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    vocab = SHAPES[shape]["vocab_size"]
    g = torch.Generator().manual_seed(dist.rank)
    ids = torch.randint(1, vocab, (4, seq), generator=g).to(dev)
    prompts = torch.randint(1, vocab, (8, 64), generator=g).tolist()
    rows: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        rows.setdefault(key, []).append(value)

    for _ in range(repeats):
        sync(dev)
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(dev)
        add("train_step_s", time.perf_counter() - t0)
        add("rest_gib", gib(dev))
        with torch.no_grad(), layout.generation(model) as gen:
            add("in_generation_gib", gib(dev))
            sync(dev)
            t1 = time.perf_counter()
            fn = lambda p, sp: HFGenerateBackend(gen).generate(p, sp)  # noqa: E731
            layout.generate(fn, prompts, GREEDY)
            sync(dev)
            add("generate_s", time.perf_counter() - t1)
        for k, v in layout.stats().items():
            if k.startswith("reshard/"):
                add(k[len("reshard/"):], v)
    out: dict[str, Any] = {"shape": shape, "layout": layout_name, "world_size": dist.world_size, "repeats": repeats}
    for key, values in rows.items():
        out[key] = {"first": round(values[0], 5), "median": round(statistics.median(values[1:] or values), 5)}
    del model, opt, layout
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen2-0.5b,qwen2-1.5b")
    parser.add_argument("--layouts", default="", help="default: fsdp,replica in one process, fsdp in several")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test with the tiny shape")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.tiny:
        args.shapes, args.seq, args.repeats = "tiny", 16, 2
    dist = start_process_group("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    layouts = args.layouts.split(",") if args.layouts else (["fsdp", "replica"] if dist.world_size == 1 else ["fsdp"])
    results = []
    for shape in args.shapes.split(","):
        for name in layouts:
            try:
                rec = measure(shape, name, dist, args.repeats, args.seq)
            except Exception as e:  # noqa: BLE001 - keep measuring the other layouts; the record says what failed
                import traceback

                rec = {"shape": shape, "layout": name, "error": f"{type(e).__name__}: {e}",
                       "traceback": traceback.format_exc()[-2000:]}
                gc.collect()
            results.append(rec)
            if dist.is_main:
                print(rec, flush=True)
    if dist.is_main:
        write_json(args.out, {"environment": environment(), "command": " ".join(sys.argv), "results": results})
    import torch.distributed as tdist

    tdist.barrier()
    tdist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
