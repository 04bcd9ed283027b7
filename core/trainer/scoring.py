"""Scoring a rollout: after it, or while it runs (samples scored in a thread as they finish).

:func:`score_rollout` decodes every response and calls the reward backend once. A
:class:`StreamingScorer` is the rollout's ``on_finished`` callback instead
(:data:`rlcore.rollout.base.FinishedCallback`): each group of finished samples is decoded and
scored in a worker thread while the rest still decode, so the end of the rollout waits only for
the last ones. :meth:`StreamingScorer.finish` gives the same scores, in the same order, as
:func:`score_rollout` on the finished rollout: a sample's streamed score is used only when the
tokens it was scored on are the rollout's final ones (a chunk retried after an out-of-memory
error may report samples twice), and whatever was not streamed is scored at the end.

Metrics of a streamed rollout are merged over its scoring calls: counts (``reward/errors``,
``reward/timeouts``) and times (``time/...``) are summed, other values are averaged weighted by
each call's number of samples (exact for means over the samples, such as ``reward/<name>``).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional, Sequence

import torch

from rlcore.contract import check_reward_output
from rlcore.protocols import RewardInput
from rlcore.rollout.base import RolloutBatch

#: Metric keys that count events: summed over scoring calls, not averaged.
SUMMED_METRICS = ("reward/errors", "reward/timeouts")


def rows(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """The unmasked tokens of each row of ``ids [B, T]`` as lists, copied to the host once."""
    ids, mask = ids.cpu(), mask.cpu().bool()
    return [row[keep].tolist() for row, keep in zip(ids, mask)]


class RolloutRequest:
    """What the reward needs of a rollout besides the responses: the prompts' text, ids and extra columns."""

    def __init__(self, prompt_text: Sequence[str], prompt_ids: Sequence[Sequence[int]], extras: dict[str, list]):
        self.prompt_text, self.prompt_ids, self.extras = list(prompt_text), [list(p) for p in prompt_ids], extras

    def reward_input(self, indices: Sequence[int], responses: list[str],
                     response_ids: list[list[int]]) -> RewardInput:
        every = len(indices) == len(self.prompt_text) and list(indices) == list(range(len(indices)))
        pick = (lambda values: list(values)) if every else (lambda values: [values[i] for i in indices])
        return RewardInput(prompts=pick(self.prompt_text), responses=responses, prompt_ids=pick(self.prompt_ids),
                           response_ids=response_ids, extras={k: pick(v) for k, v in self.extras.items()})


def _check_finite(scores: torch.Tensor, prompts: Sequence[str], responses: Sequence[str]) -> None:
    if not torch.isfinite(scores).all():
        bad = int((~torch.isfinite(scores)).nonzero()[0])
        from rlcore.errors import RewardError

        raise RewardError(f"reward backend returned {float(scores[bad])} for sample {bad}: "
                          f"prompt={prompts[bad]!r} response={responses[bad]!r}")


def _score(reward: Any, tokenizer: Any, request: RolloutRequest, indices: Sequence[int],
           response_ids: list[list[int]], plugin: str = "reward backend") -> tuple[list[str], torch.Tensor, dict[str, float]]:
    """One reward call on the samples ``indices``; its answer checked (:func:`rlcore.contract.check_reward_output`:
    one score per sample, numeric metrics), naming ``plugin``."""
    responses = tokenizer.batch_decode(response_ids, skip_special_tokens=True)
    out = reward.score(request.reward_input(indices, responses, response_ids))
    scores = check_reward_output(out, len(response_ids), plugin)
    return responses, scores, {k: float(v) for k, v in dict(out.metrics or {}).items()}


def score_rollout(reward: Any, tokenizer: Any, request: RolloutRequest, rollout: RolloutBatch,
                  plugin: str = "reward backend") -> tuple[torch.Tensor, dict[str, float]]:
    """Scores ``[B]`` and metrics of a finished rollout, in one reward call (``plugin``: the reward's, named
    when its answer is wrong)."""
    response_ids = rows(rollout.response_ids, rollout.response_mask)
    responses, scores, metrics = _score(reward, tokenizer, request, range(len(response_ids)), response_ids, plugin)
    _check_finite(scores, request.prompt_text, responses)
    return scores, metrics


def merge_metrics(parts: Sequence[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """Metrics of several scoring calls, ``(samples, metrics)`` each, as one call's (see the module docstring)."""
    total = sum(n for n, _ in parts)
    out: dict[str, float] = {}
    for n, metrics in parts:
        for key, value in metrics.items():
            summed = key in SUMMED_METRICS or key.startswith("time/")
            out[key] = out.get(key, 0.0) + (float(value) if summed else float(value) * (n / max(1, total)))
    return out


class StreamingScorer:
    """Scores samples in a worker thread as the rollout reports them finished (see the module docstring).

    Use as the rollout's ``on_finished``; then :meth:`finish` with the finished rollout, and
    :meth:`close` in any case.
    """

    def __init__(self, reward: Any, tokenizer: Any, request: RolloutRequest, plugin: str = "reward backend"):
        self.reward, self.tokenizer, self.request, self.plugin = reward, tokenizer, request, plugin
        # a reward that stops a step when most samples got the fallback score judges the whole step, not each group
        self._share_check = hasattr(reward, "defer_share_check") and hasattr(reward, "check_fallback_share")
        if self._share_check:
            reward.defer_share_check = True
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlcore-reward")
        self._jobs: list[tuple[list[int], list[list[int]], Future]] = []
        self._lock = threading.Lock()
        #: share of the samples whose streamed score was used, set by :meth:`finish`
        self.streamed_frac = 0.0

    def __call__(self, indices: list[int], responses: list[list[int]]) -> Future:
        """The rollout's callback: queue these finished samples for scoring and return at once, with
        the future of their ``(texts, scores [len(indices)], metrics)``."""
        indices, responses = list(indices), [list(r) for r in responses]
        future = self._pool.submit(_score, self.reward, self.tokenizer, self.request, indices, responses, self.plugin)
        with self._lock:
            self._jobs.append((indices, responses, future))
        return future

    def finish(self, rollout: RolloutBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Scores ``[B]`` and metrics of the finished rollout: the streamed ones where they still hold,
        the rest scored now. Raises what a scoring call raised."""
        final = rows(rollout.response_ids, rollout.response_mask)
        n = len(final)
        scores: list[Optional[float]] = [None] * n
        texts: list[Optional[str]] = [None] * n
        parts: list[tuple[int, dict[str, float]]] = []
        with self._lock:
            jobs = list(self._jobs)
        for indices, responses, future in jobs:
            got_texts, got, metrics = future.result()
            if any(i >= n or scores[i] is not None or final[i] != r for i, r in zip(indices, responses)):
                continue  # superseded (a retried chunk) or already covered: scored from the final tokens instead
            for k, i in enumerate(indices):
                scores[i], texts[i] = float(got[k]), got_texts[k]
            parts.append((len(indices), metrics))
        rest = [i for i in range(n) if scores[i] is None]
        self.streamed_frac = (n - len(rest)) / max(1, n)
        if rest:
            got_texts, got, metrics = _score(self.reward, self.tokenizer, self.request, rest, [final[i] for i in rest],
                                             self.plugin)
            for k, i in enumerate(rest):
                scores[i], texts[i] = float(got[k]), got_texts[k]
            parts.append((len(rest), metrics))
        out = torch.tensor(scores, dtype=torch.float32)
        _check_finite(out, self.request.prompt_text, texts)
        metrics = merge_metrics(parts)
        if self._share_check and metrics.get("reward/errors"):
            self.reward.check_fallback_share("reward", int(metrics["reward/errors"]),
                                             int(metrics.get("reward/timeouts", 0)), n)
        return out, metrics

    def close(self) -> None:
        """Stop the worker thread (waits for a scoring call in progress)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._share_check:
            self.reward.defer_share_check = False
