"""Scoring while the rollout decodes (``reward.stream``) against scoring after it.

One rollout of ``--prompts`` x ``--n`` samples runs on the rollout engine with a random-init model;
response lengths are long-tailed through a stop rule: a set of token ids that all end a response,
sized so that the mean length is about ``--mean-len`` (a random-init model emits each id with
probability about 1/vocab). Every sample costs ``--reward-ms`` of reward work on the host:
``--reward-kind sleep`` waits (work that releases the interpreter lock: a verifier process, a
sandbox, a tokenizer in native code), ``spin`` computes in Python (holds the lock, so it also
slows the decode loop's host side).

Two ways, same seeds:

* ``after``    — generate, then decode and score everything (``rlcore.trainer.scoring.score_rollout``);
* ``streamed`` — the trainer's :class:`~rlcore.trainer.scoring.StreamingScorer` as the rollout's
  ``on_finished`` callback: finished samples are decoded and scored in a worker thread while the
  rest decode; the end waits only for what is left.

It prints, per way, the rollout seconds, the wait for rewards after it, their sum, the share of
samples scored during the rollout, and whether the scores equal the ``after`` ones (they must);
the median of ``--repeats`` runs after a warm-up. Raw results go to ``--out`` as JSON.

Run (CPU): python bench/bench_stream_reward.py --tiny --out stream_reward.json
Run (GPU): python3 bench/bench_stream_reward.py --device cuda --shape qwen2-1.5b --prompts 32 --n 8 \\
    --mean-len 1500 --max-new-tokens 8192 --reward-ms 20 --out stream_reward_h200.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import environment, import_rlcore, write_json  # noqa: E402
from bench_update import SHAPES  # noqa: E402 - the same model shapes

class _Tokenizer:
    """Token ids to letters: a real decode loop over every token, no vocabulary file needed."""

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join(chr(97 + t % 26) for t in row) for row in ids]


def _reward(kind: str, ms: float):
    def score(prompts, responses, **_):
        out = []
        for r in responses:
            end = time.perf_counter() + ms / 1000.0
            if kind == "sleep":
                time.sleep(ms / 1000.0)
            else:
                while time.perf_counter() < end:
                    pass
            out.append(float(len(r) % 7) + 0.01 * r.count("a"))
        return out
    return score


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a tiny model and small rollout (CPU smoke setting)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-0.5b")
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16, help="prompts of prompt-len/4 .. prompt-len tokens")
    p.add_argument("--mean-len", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--reward-ms", type=float, default=20.0)
    p.add_argument("--reward-kind", choices=["sleep", "spin"], default="sleep")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import_rlcore()
    from rlcore.rewards.backend import RewardPipeline
    from rlcore.rewards.functions import FunctionReward
    from rlcore.rollout.base import SamplingParams
    from rlcore.rollout.engine import RolloutEngine
    from rlcore.rollout.tiny import causal_lm_from_config, tiny_causal_lm
    from rlcore.trainer.scoring import RolloutRequest, StreamingScorer, score_rollout

    if args.tiny:
        model = tiny_causal_lm("qwen2", max_position_embeddings=512)
    else:
        from transformers import Qwen2Config

        cfg = Qwen2Config(**SHAPES[args.shape], max_position_embeddings=32768, tie_word_embeddings=True)
        model = causal_lm_from_config(cfg, dtype=torch.bfloat16 if args.device == "cuda" else torch.float32,
                                      device=args.device)
    vocab = model.config.vocab_size
    stops = tuple(range(3, 3 + max(1, round(vocab / args.mean_len))))
    g = torch.Generator().manual_seed(0)
    prompts = []
    for _ in range(args.prompts):
        length = int(torch.randint(max(1, args.prompt_len // 4), args.prompt_len + 1, (1,), generator=g))
        prompt = torch.randint(3 + len(stops), vocab, (length,), generator=g).tolist()
        prompts += [prompt] * args.n
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=1, eos_token_ids=stops,
                            pad_token_id=0)
    engine = RolloutEngine(model, max_batch_size=len(prompts), max_seq_len=args.prompt_len + args.max_new_tokens,
                           device=args.device)
    reward = RewardPipeline([(FunctionReward("bench", _reward(args.reward_kind, args.reward_ms)), 1.0)])
    tok = _Tokenizer()

    def request():
        return RolloutRequest([str(i) for i in range(len(prompts))], prompts, {})

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    def run(way: str) -> dict:
        scorer = StreamingScorer(reward, tok, request()) if way == "streamed" else None
        try:
            sync()
            t0 = time.perf_counter()
            batch = engine.generate(prompts, params, on_finished=scorer)
            sync()
            t1 = time.perf_counter()
            scores, _ = scorer.finish(batch) if scorer else score_rollout(reward, tok, request(), batch)
            t2 = time.perf_counter()
        finally:
            if scorer:
                scorer.close()
        lengths = batch.response_mask.sum(-1).float()
        return {"rollout_s": t1 - t0, "reward_wait_s": t2 - t1, "total_s": t2 - t0,
                "streamed_frac": scorer.streamed_frac if scorer else 0.0, "scores": scores.tolist(),
                "length_mean": float(lengths.mean()), "length_max": float(lengths.max())}

    results: dict = {}
    for way in ("after", "streamed"):
        runs = [run(way) for _ in range(args.repeats + 1)][1:]
        results[way] = {k: statistics.median(r[k] for r in runs) for k in
                        ("rollout_s", "reward_wait_s", "total_s", "streamed_frac", "length_mean", "length_max")}
        results[way]["runs"] = runs
    same = all(r["scores"] == results["after"]["runs"][0]["scores"] for w in results.values() for r in w["runs"])
    payload = {"environment": environment(), "args": vars(args), "stop_ids": len(stops), "scores_equal": same,
               "results": results}
    if args.out:
        write_json(args.out, payload)
    a = results["after"]
    print(f"{len(prompts)} samples, response length mean {a['length_mean']:.0f} max {a['length_max']:.0f}, "
          f"{args.reward_ms:g} ms of '{args.reward_kind}' reward work each; scores equal: {same}")
    print(f"{'way':<9} {'rollout_s':>10} {'reward_wait_s':>14} {'total_s':>9} {'streamed':>9}")
    for way, r in results.items():
        print(f"{way:<9} {r['rollout_s']:10.3f} {r['reward_wait_s']:14.3f} {r['total_s']:9.3f} "
              f"{r['streamed_frac']:9.0%}")


if __name__ == "__main__":
    main()
