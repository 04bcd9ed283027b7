"""Scoring a policy on held-out prompts: ``eval.n`` samples a prompt, their rewards, pass@k for k = 1..n,
response lengths, per ``data_source``.

The trainer's evaluations (:meth:`rlcore.trainer.loop.Trainer.evaluate`) and ``rlcore eval``
(:mod:`rlcore.evaluate`) both run :func:`sample_and_score` and :func:`summarize`, so the same policy
on the same rows with the same ``eval`` settings gives the same numbers in both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from rlcore.distributed.init import all_gather_object
from rlcore.rollout.base import SamplingParams

#: The ``data_source`` of a row that has none.
NO_SOURCE = "(none)"


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from ``n`` samples of which ``c`` passed:
    ``1 - C(n - c, k) / C(n, k)``, the chance that k samples drawn without replacement hold a pass."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@dataclass
class PromptResult:
    """The samples of one held-out prompt."""

    data_source: str
    scores: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)


def eval_sampling(eval_cfg: Any, gen_cfg: Any, base: SamplingParams) -> SamplingParams:
    """``base`` (the trainer's sampling of step 0: seed, end tokens, padding) with the ``eval`` section's
    temperature, top-p, top-k and length (``eval.max_new_tokens`` or ``ppo.generation.max_new_tokens``)."""
    import dataclasses

    length = eval_cfg.max_new_tokens if eval_cfg.max_new_tokens is not None else gen_cfg.max_new_tokens
    return dataclasses.replace(base, temperature=float(eval_cfg.temperature), top_p=float(eval_cfg.top_p),
                               top_k=int(eval_cfg.top_k), max_new_tokens=int(length))


def sample_and_score(scorer: Any, rows: Sequence[dict], n: int, params: SamplingParams,
                     batch_size: int) -> list[PromptResult]:
    """Generate ``n`` samples for each of ``rows`` (``batch_size`` prompts a call) and score them;
    the results of every rank, gathered.

    ``scorer`` is the trainer (or :class:`rlcore.evaluate.Evaluator`): its ``expand``,
    ``start_episodes``, ``end_episodes``, ``score`` and ``truncated`` treat rows as training does,
    and ``c.generation`` generates. Ranks may hold different numbers of rows (a provider that
    shards them); every rank still makes the same number of generation calls, since each one
    gathers the sharded weights: a rank with fewer batches generates (and drops) copies of a row."""
    bs = max(1, int(batch_size))
    batches: list[Optional[list]] = [list(rows[i:i + bs]) for i in range(0, len(rows), bs)]
    shared = all_gather_object((len(batches), rows[0] if rows else None))  # [mine] in one process
    total = max(count for count, _ in shared)
    if not total:
        return []
    spare = next(row for _, row in shared if row is not None)
    batches += [None] * (total - len(batches))
    mine: list[PromptResult] = []
    for batch in batches:
        rows_now = batch if batch is not None else [spare]
        prompts, extras = scorer.expand(rows_now, n=n)
        prompts, episodes = scorer.start_episodes(rows_now, prompts, n=n)
        rollout = scorer.c.generation.generate(prompts, params)
        scorer.end_episodes(episodes, extras)
        scores, _ = scorer.score(rollout, extras)
        if batch is None:
            continue
        lengths = rollout.response_mask.sum(-1).tolist()
        cut = scorer.truncated(rollout, params.max_new_tokens).tolist()
        scores = scores.tolist()
        for i, row in enumerate(batch):
            part = slice(i * n, (i + 1) * n)
            mine.append(PromptResult(str(row.get("data_source") or NO_SOURCE), [float(s) for s in scores[part]],
                                     [int(x) for x in lengths[part]], [bool(x) for x in cut[part]]))
    return [r for part in all_gather_object(mine) for r in part]


def _stats(results: Sequence[PromptResult], n: int, threshold: float) -> dict[str, Any]:
    scores = [s for r in results for s in r.scores]
    lengths = sorted(x for r in results for x in r.lengths)
    mean = sum(scores) / len(scores)
    passes = [sum(s >= threshold for s in r.scores) for r in results]
    out: dict[str, Any] = {
        "prompts": len(results), "samples": len(scores),
        "reward_mean": mean, "reward_std": math.sqrt(sum((s - mean) ** 2 for s in scores) / len(scores)),
        "pass": {str(k): sum(pass_at_k(n, c, k) for c in passes) / len(passes) for k in range(1, n + 1)},
        "length_mean": sum(lengths) / len(lengths), "length_min": lengths[0], "length_max": lengths[-1],
        "length_p50": _quantile(lengths, 0.5), "length_p90": _quantile(lengths, 0.9),
        "clip_frac": sum(c for r in results for c in r.truncated) / len(scores),
    }
    return out


def _quantile(ordered: Sequence[int], q: float) -> float:
    """The ``q`` quantile of sorted values (linear interpolation between the nearest ranks)."""
    pos = q * (len(ordered) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(ordered) - 1)
    return float(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))


def summarize(results: Sequence[PromptResult], n: int, threshold: float) -> dict[str, Any]:
    """``{"all": stats, "by_source": {data_source: stats}}``; each ``stats`` holds ``prompts``,
    ``samples``, ``reward_mean``, ``reward_std``, ``pass`` (``{"1": pass@1, ..., "n": pass@n}``),
    ``length_mean/min/max/p50/p90`` (response tokens) and ``clip_frac`` (share cut at the length cap)."""
    if not results:
        return {"all": None, "by_source": {}}
    sources = sorted({r.data_source for r in results})
    return {"all": _stats(results, n, threshold),
            "by_source": {s: _stats([r for r in results if r.data_source == s], n, threshold) for s in sources}}


def val_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """The flat metrics an evaluation logs (under ``val/``): ``reward_mean``, ``response_length``,
    ``pass@k`` for each k, and with several data sources ``<data_source>/reward_mean`` and
    ``<data_source>/pass@1``."""
    every = summary["all"]
    if every is None:
        return {}
    out = {"reward_mean": every["reward_mean"], "response_length": every["length_mean"]}
    out.update({f"pass@{k}": v for k, v in every["pass"].items()})
    if len(summary["by_source"]) > 1:
        for source, stats in summary["by_source"].items():
            out[f"{source}/reward_mean"] = stats["reward_mean"]
            out[f"{source}/pass@1"] = stats["pass"]["1"]
    return out
