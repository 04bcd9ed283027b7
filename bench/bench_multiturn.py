"""Multi-turn rollout throughput against single-turn, at the same number of model tokens.

A random-init decoder of a real shape plays episodes in the engine: a turn ends when the model
samples one of ``--end-fraction`` of the vocabulary (so turns average about ``1 / end_fraction``
tokens), an environment answers after ``--tool-ms`` (an ``asyncio.sleep``: a tool that takes that
long) with ``--obs-tokens`` observation tokens, up to ``--turns`` turns. Two single-turn references
run on the same engine: one generates the mean number of model tokens per sequence in one turn
(every sequence the same length: the issue's reference, ``ratio``), the other each sequence exactly
its episode's model tokens in one turn (``generate(max_new_tokens=[...])``: the same length spread,
``ratio_matched``), which leaves out what the spread of episode lengths costs any rollout (the
longest episode sets the call's length; ``model_tokens_max`` against ``model_tokens_mean``) and
keeps what the turns cost. All report
model tokens per second (observation tokens excluded); the target is multi-turn within 1.5x of
single-turn (ratio single/multi <= 1.5).

Each KV cache kind of ``--kv-cache`` (default both, paged first) gets its own engine and its own
single-turn reference, side by side. Each row also reports the decode loop's counters from the
batch stats: decode steps, batch occupancy (rows decoding / batch bucket run), extend forwards and
their tokens, prefill tokens, host reads, graph and eager steps, time blocked waiting for
environments. ``--profile`` writes a ``torch.profiler`` table of one multi-turn call per kind to
``--out``'s directory.

Run (GPU):  python bench/bench_multiturn.py --out bench/results/multiturn.json
CPU smoke:  python bench/bench_multiturn.py --shape tiny --device cpu --sequences 8 --budget 64 --tool-ms 5
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import environment, import_rlcore, timed, write_json  # noqa: E402

import_rlcore()

from bench_rollout import SHAPES, build, make_prompts  # noqa: E402
from rlcore.envs import Step  # noqa: E402
from rlcore.envs.runner import EpisodeLimits, EpisodePrompt, EpisodeRunner, Environments, episode_metrics  # noqa: E402
from rlcore.rollout.base import SamplingParams  # noqa: E402
from rlcore.rollout.engine import RolloutEngine, extend  # noqa: E402


class NumberTokenizer:
    """Token ids written as numbers: what the runner needs (decode, encode, no chat template)."""

    chat_template = None
    unk_token_id = None

    def __init__(self, eos: int):
        self.eos_token_id = eos

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids)

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [int(w) for w in text.split()]}


class SlowTool:
    """Answers each turn after ``delay`` seconds with ``obs`` tokens; done after ``turns`` turns."""

    observation_role = "user"

    def __init__(self, config):
        self.delay, self.obs, self.turns = float(config["delay"]), list(config["obs"]), int(config["turns"])

    def start(self, row):
        return None

    async def step(self, turn):
        await asyncio.sleep(self.delay)
        if turn.index + 1 >= self.turns:
            return Step(reward=1.0, done=True)
        return Step(observation=" ".join(map(str, self.obs)), metrics={"tool_calls": 1.0})


#: batch stats reported per run (``rollout/<name>``)
COUNTERS = ("decode_steps", "batch_occupancy", "decode_rows_mean", "decode_batch_mean", "extend_calls",
            "extend_tokens", "prefill_tokens", "host_syncs", "graph_steps", "eager_steps", "graph_captures",
            "graph_capture_s", "extend_graph_calls", "extend_graph_captures",
            "env_waits", "env_wait_seconds", "resumed", "in_flight_peak", "observation_tokens",
            "host_between_s", "host_admit_s", "host_launch_s", "host_finish_s")


def run_kind(args, kind, engine, runner, prompts, ends) -> list[dict]:
    """Warm-up, then ``--repeats`` multi-turn calls each with its single-turn reference, on one engine."""

    def multi(seed):
        episodes = runner.start(["tool"] * len(prompts), [{} for _ in prompts])
        params = SamplingParams(max_new_tokens=args.budget, temperature=1.0, seed=seed, eos_token_ids=ends)
        return engine.generate([EpisodePrompt(p, e) for p, e in zip(prompts, episodes)], params), episodes

    def single(seed, tokens):
        params = SamplingParams(max_new_tokens=tokens, temperature=1.0, seed=seed)  # no EOS: exactly `tokens`
        return engine.generate(prompts, params)

    def matched(seed, lengths):  # each prompt exactly its episode's model tokens, in one turn
        params = SamplingParams(max_new_tokens=max(lengths), temperature=1.0, seed=seed)
        return engine.generate(prompts, params, max_new_tokens=lengths)

    multi(0)  # warm-up: graphs, compilation
    if args.profile:
        batch, _ = profile(args, f"{kind}_multi", lambda: multi(100))
        per_seq = max(1, round(float(batch.response_mask.sum()) / len(prompts)))
        single(0, per_seq)
        profile(args, f"{kind}_single", lambda: single(100, per_seq))
    rows = []
    for r in range(args.repeats):
        sec_m, (batch, episodes) = timed(lambda: multi(r + 1))
        model_tokens = float(batch.response_mask.sum())
        per_seq = max(1, round(model_tokens / len(prompts)))
        single(0, per_seq)
        sec_s, ref = timed(lambda: single(r + 1, per_seq))
        ref_tokens = float(ref.response_mask.sum())
        lengths = [max(1, int(v)) for v in batch.response_mask.sum(-1).tolist()]
        matched(0, lengths)
        sec_x, same = timed(lambda: matched(r + 1, lengths))
        same_tokens = float(same.response_mask.sum())
        metrics = episode_metrics(episodes)
        row = {"kv_cache": kind, "multi_s": sec_m, "multi_model_tokens": model_tokens,
               "multi_tok_s": model_tokens / sec_m, "single_s": sec_s, "single_model_tokens": ref_tokens,
               "single_tok_s": ref_tokens / sec_s, "ratio": (ref_tokens / sec_s) / (model_tokens / sec_m),
               "model_tokens_max": float(max(lengths)), "model_tokens_mean": model_tokens / len(lengths),
               "matched_s": sec_x, "matched_model_tokens": same_tokens, "matched_tok_s": same_tokens / sec_x,
               "ratio_matched": (same_tokens / sec_x) / (model_tokens / sec_m),
               "matched_graph_steps": same.stats.get("rollout/graph_steps", 0.0),
               "turns_mean": metrics["env/turns_mean"], "env_seconds_mean": metrics["env/seconds_mean"],
               "single_graph_steps": ref.stats.get("rollout/graph_steps", 0.0)}
        row.update({name: float(batch.stats.get(f"rollout/{name}", 0.0)) for name in COUNTERS})
        rows.append(row)
    return rows


def profile(args, name, call):
    """A ``torch.profiler`` table (device time first where there is a device) of ``call`` in ``--out``'s folder,
    headed by the call's wall seconds; returns what ``call`` returned."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        seconds, result = timed(call)
    key = "cuda_time_total" if args.device == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=40)
    folder = os.path.dirname(os.path.abspath(args.out)) if args.out else "."
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"multiturn_profile_{name}.txt")
    with open(path, "w") as fh:
        fh.write(f"{name}: {seconds:.3f} s wall under the profiler\n{table}")
    print(f"profile of one call ({name}, {seconds:.3f} s) written to {path}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen2-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sequences", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--budget", type=int, default=1024, help="max_new_tokens: model + observation tokens")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--end-fraction", type=float, default=1 / 192)
    ap.add_argument("--obs-tokens", type=int, default=32)
    ap.add_argument("--tool-ms", type=float, default=50.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--kv-cache", default="paged,static", help="comma-separated KV cache kinds to run")
    ap.add_argument("--eos-check-interval", default="8",
                    help="comma list: decode steps between reads of the turn-end flags (each read waits for the "
                         "device); one run per value, to weigh those waits against the steps decoded past a turn's end")
    ap.add_argument("--turn-ends", default="wait", choices=["wait", "lagged", "wait,lagged", "lagged,wait"],
                    help="how the loop reads turn ends: waiting for the device at each check, or from a copy "
                         "read once the device has passed it (RolloutEngine(lagged_turn_ends=True)); "
                         "both: one run each")
    ap.add_argument("--extend-graphs", default="on", choices=["on", "off", "on,off", "off,on"],
                    help="observation extends replayed from CUDA graphs (rlcore.rollout.engine.extend.ENABLED) or "
                         "run eagerly; both: one run each")
    ap.add_argument("--profile", action="store_true", help="write a torch.profiler table per kind next to --out")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build(args.shape, args.device, dtype)
    vocab = SHAPES[args.shape]["vocab_size"]
    ends = tuple(range(vocab - max(1, int(vocab * args.end_fraction)), vocab))
    prompts = make_prompts(args.sequences, 1, args.prompt_len, vocab - len(ends))
    obs = list(range(20, 20 + args.obs_tokens))
    tok = NumberTokenizer(ends[0])
    envs = Environments({"tool": (SlowTool, "bench")},
                        {"tool": {"delay": args.tool_ms / 1e3, "obs": obs, "turns": args.turns}},
                        defaults=EpisodeLimits(max_turns=args.turns, timeout_s=600))
    runner = EpisodeRunner(envs, tok, max_concurrency=args.sequences, stop=())
    rows = []
    for kind in args.kv_cache.split(","):
        for interval, turn_ends, graphs in itertools.product(map(int, str(args.eos_check_interval).split(",")),
                                                            args.turn_ends.split(","), args.extend_graphs.split(",")):
            extend.ENABLED = graphs == "on"
            engine = RolloutEngine(model, max_batch_size=args.sequences, eos_check_interval=interval,
                                   max_seq_len=args.prompt_len + args.budget + 8, kv_cache=kind,
                                   lagged_turn_ends=turn_ends == "lagged")
            rows += [{**row, "eos_check_interval": interval, "turn_ends": turn_ends, "extend_graphs": graphs}
                     for row in run_kind(args, kind, engine, runner, prompts, ends)]
            del engine
    runner.close()
    write_json(args.out, {"environment": environment(), "args": vars(args), "runs": rows})
    print(f"\n{args.shape} on {args.device}: {args.sequences} sequences, budget {args.budget}, up to {args.turns} turns, "
          f"tool {args.tool_ms:.0f} ms, {args.obs_tokens} observation tokens")
    print(f"{'kv':>6} {'check':>5} {'ends':>6} {'xg':>3} {'multi tok/s':>12} {'single tok/s':>13} {'single/multi':>13} "
          f"{'matched/multi':>14} "
          f"{'turns':>6} {'steps':>6} {'occup':>6} {'extends':>8} {'syncs':>6} {'graph':>6} {'eager':>6} {'env wait s':>10}")
    for row in rows:
        print(f"{row['kv_cache']:>6} {row['eos_check_interval']:>5} {row['turn_ends']:>6} {row['extend_graphs']:>3} "
              f"{row['multi_tok_s']:>12.0f} "
              f"{row['single_tok_s']:>13.0f} {row['ratio']:>13.2f} {row['ratio_matched']:>14.2f} "
              f"{row['turns_mean']:>6.2f} {row['decode_steps']:>6.0f} {row['batch_occupancy']:>6.2f} "
              f"{row['extend_calls']:>8.0f} {row['host_syncs']:>6.0f} {row['graph_steps']:>6.0f} "
              f"{row['eager_steps']:>6.0f} {row['env_wait_seconds']:>10.2f}")
    for kind in dict.fromkeys(r["kv_cache"] for r in rows):
        best = min(r["ratio"] for r in rows if r["kv_cache"] == kind)
        same = min(r["ratio_matched"] for r in rows if r["kv_cache"] == kind)
        print(f"{kind}: target single/multi <= 1.5: {'met' if best <= 1.5 else 'NOT met'} (best {best:.2f}; against "
              f"single-turn at the episodes' own lengths {same:.2f})")


if __name__ == "__main__":
    main()
