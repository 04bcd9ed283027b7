"""Overlap of the ``async`` plugin: step time with generation and training on separate ranks,
synchronous (``max_staleness=0``) against one- or more-step off-policy, under a long-tailed
generation time.

Each setting is one ``rlcore train --plugins async`` job of ``--nproc`` processes under
``torch.distributed.run`` (``--rollout-ranks`` of them generate, the others train), on the demo task
unless ``--set`` points the run elsewhere (``--set actor.model_path=DIR --set data.train_files=[...]``).
On top of the real work, every rollout rank sleeps ``G_k`` in step ``k``'s generation, drawn from a
log-normal distribution (median ``--gen-ms``, shape ``--gen-sigma``; the same draw for every rank and
setting: the long tail of reasoning rollouts, where the longest sample decides), and every training
rank sleeps ``--train-ms`` in each update. ``--gen-ms 0 --train-ms 0`` measures the real work alone
(on GPUs, with a real model).

The model: from the synchronous run, each measured step ``k`` gives the trainers' own time ``T_k``
(step time less the wait for samples) and the generation time ``G_k`` (the wait: with
``max_staleness=0`` the rollout ranks start step ``k`` when the trainers ask for it). With staleness
``s`` the trainers queue step ``j`` when they begin step ``j - s``, a rollout rank generates the
queued steps in order, and a step trains once its samples are in::

    start_k = end_{k-1};  submit_j = start_{max(1, j - s)}
    gen_end_j = max(gen_end_{j-1}, submit_j) + G_j;  end_k = max(start_k, gen_end_k) + T_k

which predicts each setting's mean step time; the results list it next to the measured one, with
both speed-ups over the synchronous run. Steps up to ``--warmup`` (engine and graph set-up) are left
out of the means.

Run (N GPUs):  python bench/bench_async.py --nproc N --rollout-ranks R --device cuda --out results/async.json
CPU:           python bench/bench_async.py --nproc 3 --out results/async_cpu.json
Smoke test:    python bench/bench_async.py --nproc 2 --steps 3 --warmup 1 --gen-ms 20 --train-ms 20 --staleness 0,1
Needs rlcore installed (``pip install -e .``: the ``async`` plugin is found through its entry point).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))

#: ``rlcore train`` with the simulated generation and training times added (see the module docstring).
WRAPPER = r"""
import math, os, random, sys, time
from rlcore.plugins import async_rl
from rlcore.trainer import loop

GEN_S, SIGMA, TRAIN_S = (float(os.environ[k]) for k in ("BENCH_GEN_S", "BENCH_GEN_SIGMA", "BENCH_TRAIN_S"))

def gen_delay(step):
    return GEN_S * math.exp(SIGMA * random.Random(1000 + step).gauss(0.0, 1.0)) if GEN_S > 0 else 0.0

original_generate = async_rl.RolloutWorker._generate
def _generate(self, prompts, params):
    self._bench_step = getattr(self, "_bench_step", 0) + 1  # one generation call per step, in step order
    time.sleep(gen_delay(self._bench_step))
    return original_generate(self, prompts, params)
async_rl.RolloutWorker._generate = _generate

original_update = loop.Trainer.update
def update(self, exp, *args, **kwargs):
    time.sleep(TRAIN_S)
    return original_update(self, exp, *args, **kwargs)
loop.Trainer.update = update

from rlcore.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run_setting(args: argparse.Namespace, staleness: int, workdir: str) -> dict[str, Any]:
    out_dir = os.path.join(workdir, f"s{staleness}")
    script = os.path.join(workdir, "wrapper.py")
    with open(script, "w") as f:
        f.write(WRAPPER)
    env = dict(os.environ, BENCH_GEN_S=str(args.gen_ms / 1000), BENCH_GEN_SIGMA=str(args.gen_sigma),
               BENCH_TRAIN_S=str(args.train_ms / 1000), TOKENIZERS_PARALLELISM="false")
    if args.device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}", script,
           "train", "--plugins", "async", f"trainer.device={args.device}", f"trainer.max_steps={args.steps}",
           "trainer.progress=false", "trainer.log_steps=1", "trainer.save_steps=0", "trainer.eval_samples=0",
           "trainer.export_final=false", "trainer.gpu_monitor=false", "trainer.resume=disable",
           f"trainer.output_dir={out_dir}", "ppo.rollout_is=token", f"plugin_config.async.max_staleness={staleness}",
           f"plugin_config.async.rollout_ranks={args.rollout_ranks}", *args.set]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"setting max_staleness={staleness} failed ({proc.returncode}):\n"
                         f"{(proc.stdout + proc.stderr)[-6000:]}")
    records = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    steps = sorted((r for r in records if r.get("split") == "train"), key=lambda r: r["step"])
    return {"staleness": staleness, "wall_s": wall,
            "steps": [{"step": r["step"], "step_s": r["time/step_s"], "wait_s": r["async/wait_s"],
                       "staleness": r["async/staleness"], "weights_sync_s": r["async/weights_sync_s"]}
                      for r in steps]}


def predict(gen: list[float], own: list[float], s: int) -> list[float]:
    """Step times of staleness ``s`` from generation times ``gen`` and the trainers' own times ``own``
    (the recurrence of the module docstring); index 0 is step 1."""
    n = len(gen)
    start, end = [0.0] * n, [0.0] * n
    gen_end = 0.0  # the rollout ranks generate the steps in order
    for k in range(n):
        start[k] = end[k - 1] if k else 0.0
        queued = start[max(0, k - s)]  # step k was queued when the trainers began step k - s (or step 1)
        gen_end = max(gen_end, queued) + gen[k]
        end[k] = max(start[k], gen_end) + own[k]
    return [end[k] - start[k] for k in range(n)]


def mean(values: list[float]) -> float:
    return sum(values) / max(1, len(values))


def summarise(results: list[dict[str, Any]], warmup: int) -> list[dict[str, Any]]:
    base = next(r for r in results if r["staleness"] == 0)
    gen = [st["wait_s"] for st in base["steps"]]
    own = [st["step_s"] - st["wait_s"] for st in base["steps"]]
    sync_measured = mean([st["step_s"] for st in base["steps"][warmup:]])
    sync_predicted = mean(predict(gen, own, 0)[warmup:])
    rows = []
    for r in results:
        measured = mean([st["step_s"] for st in r["steps"][warmup:]])
        predicted = mean(predict(gen, own, r["staleness"])[warmup:])
        rows.append({"max_staleness": r["staleness"], "step_s": measured, "predicted_step_s": predicted,
                     "speedup": sync_measured / measured, "predicted_speedup": sync_predicted / predicted,
                     "wait_s": mean([st["wait_s"] for st in r["steps"][warmup:]]),
                     "weights_sync_s": mean([st["weights_sync_s"] for st in r["steps"][warmup:]]),
                     "staleness_max": max(st["staleness"] for st in r["steps"])})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=3, help="processes of the job (GPUs on a GPU machine)")
    p.add_argument("--rollout-ranks", type=int, default=1, help="how many of them generate")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--staleness", default="0,1,2", help="max_staleness settings; 0 (the baseline) is always run")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the means")
    p.add_argument("--gen-ms", type=float, default=600.0, help="median simulated generation time per step")
    p.add_argument("--gen-sigma", type=float, default=0.8, help="log-normal shape of the generation time")
    p.add_argument("--train-ms", type=float, default=600.0, help="simulated training time per step")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="further rlcore overrides")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds each setting may take")
    p.add_argument("--out", default=None, help="results JSON")
    args = p.parse_args(argv)
    if args.warmup >= args.steps:
        p.error("--warmup must be smaller than --steps")
    settings = sorted({0, *(int(s) for s in args.staleness.split(",") if s.strip())})
    sys.path.insert(0, HERE)
    from _common import environment

    with tempfile.TemporaryDirectory(prefix="bench_async_") as workdir:
        results = [run_setting(args, s, workdir) for s in settings]
    rows = summarise(results, args.warmup)
    # the long tail the draws had: mean over median of the simulated generation times
    tail = math.exp(args.gen_sigma ** 2 / 2)
    print(f"{args.nproc} processes ({args.rollout_ranks} generating), {args.device}; simulated generation "
          f"median {args.gen_ms:.0f} ms (mean/median {tail:.2f}), training {args.train_ms:.0f} ms")
    print(f"{'max_staleness':>13} {'step s':>8} {'model s':>8} {'speed-up':>9} {'model':>6} {'wait s':>7}")
    for r in rows:
        print(f"{r['max_staleness']:>13} {r['step_s']:>8.3f} {r['predicted_step_s']:>8.3f} {r['speedup']:>9.2f} "
              f"{r['predicted_speedup']:>6.2f} {r['wait_s']:>7.3f}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"environment": environment(), "settings": vars(args), "rows": rows, "runs": results}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
