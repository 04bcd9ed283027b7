"""The default reward backend: function rewards, a reward model, or both, summed with weights.

What scores a sample, in order of precedence:

1. ``custom_reward_function.path`` set: that function. With ``reward.weights`` also set, the function
   joins the named rewards under its ``custom_reward_function.name`` and the weights must mention it.
2. ``reward.weights`` set: the weighted sum of the named (registered) rewards.
3. neither, and no reward model: per sample, the registered reward named by the ``data_source``
   column (``openai/gsm8k`` also finds ``gsm8k``), else ``exact_match`` against ``ground_truth``.

A reward model (``reward_model.enable``) adds its score with weight ``reward.weights["rm"]`` (default 1).
Every component's mean is logged as ``reward/<name>``; ``reward/errors`` counts samples given
``reward.fallback_score`` and ``reward/timeouts`` those that exceeded ``reward.timeout_s``.
"""

from __future__ import annotations

import difflib
import logging
import math
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from rlcore.errors import ConfigError, PlacementError, RewardError
from rlcore.protocols import RewardInput, RewardOutput
from rlcore.rewards.base import ComponentResult, check_batch, check_finite, describe_sample
from rlcore.rewards.functions import FunctionReward, load_function

log = logging.getLogger(__name__)

OFFLOAD_NEEDS_PLUGIN = ("reward_model.offload=true needs the 'rm-offload' plugin: add it to the plugins list "
                        "(--plugins rm-offload or plugins=[rm-offload])")

#: Name of the reward-model component in ``reward.weights`` and in the metrics.
RM_NAME = "rm"
_HOW_TO = ("configure a reward: custom_reward_function.path (a Python function), reward.weights "
           "(named rewards such as exact_match, gsm8k, math_equiv), or reward_model.enable with reward_model.path")


class DataSourceDispatch:
    """Per sample, the registered reward named by its ``data_source``, else ``exact_match`` on ``ground_truth``."""

    name = "auto"
    log_mean = False

    def __init__(self, rewards: Mapping[str, Callable[..., Any]], make: Callable[[str, Callable], FunctionReward]):
        from rlcore.rewards.rules import exact_match

        self.rewards = dict(rewards)
        self.rewards.setdefault("exact_match", exact_match)
        self._make = make
        self._built: dict[str, FunctionReward] = {}

    def resolve(self, source: Any) -> Optional[str]:
        """The registered reward for a ``data_source`` value (exact, lower-case, or its last path part)."""
        if source is None:
            return None
        s = str(source)
        for cand in (s, s.lower(), s.rsplit("/", 1)[-1], s.rsplit("/", 1)[-1].lower()):
            if cand in self.rewards:
                return cand
        return None

    def __call__(self, batch: Any) -> ComponentResult:
        n = len(batch.responses)
        sources = batch.extras.get("data_source")
        truths = batch.extras.get("ground_truth")
        groups: dict[str, list[int]] = {}
        for i in range(n):
            name = self.resolve(sources[i] if sources is not None else None)
            if name is None:
                if truths is None or truths[i] is None:
                    why = (f"its data_source {sources[i]!r} is not a registered reward"
                           if sources is not None else "there is no data_source column")
                    raise RewardError(f"no reward for sample {i}: {why} and it has no ground_truth to compare "
                                      f"with.\n{describe_sample(batch, i)}\nTo score it, {_HOW_TO}. Registered "
                                      f"rewards: {', '.join(sorted(self.rewards))}")
                name = "exact_match"
            groups.setdefault(name, []).append(i)
        scores = [0.0] * n
        out = ComponentResult(scores=scores)
        for name, idx in groups.items():
            if name not in self._built:
                self._built[name] = self._make(name, self.rewards[name])
            res = self._built[name](batch, idx)
            for i, s in zip(idx, res.scores):
                scores[i] = s
            out.errors += res.errors
            out.timeouts += res.timeouts
            out.metrics.update(res.metrics)
            out.metrics[f"reward/{name}"] = sum(res.scores) / len(idx)
        return out


class RewardPipeline:
    """Weighted sum of reward components; the object the trainer calls (a ``RewardBackend``).

    :param parts: ``(component, weight)`` pairs; a component is called with the batch and returns a
        :class:`~rlcore.rewards.base.ComponentResult`.
    """

    def __init__(self, parts: Sequence[tuple[Any, float]], *, pool: Any = None, count_errors: bool = False,
                 max_fallback_share: float = 1.0):
        if not parts:
            raise RewardError(f"no reward is configured: {_HOW_TO}")
        self.parts = list(parts)
        self.pool = pool
        self.count_errors = count_errors or pool is not None
        self.max_fallback_share = float(max_fallback_share)
        #: True while a step is scored in several calls (streamed scoring): the fallback-share check
        #: then runs once on the whole step, through :meth:`check_fallback_share`
        self.defer_share_check = False

    @property
    def rm(self) -> Any:
        """The reward-model component, or None."""
        return next((c for c, _ in self.parts if getattr(c, "name", None) == RM_NAME), None)

    def score(self, batch: RewardInput) -> RewardOutput:
        n = check_batch(batch)
        total = torch.zeros(n, dtype=torch.float64)
        metrics: dict[str, float] = {}
        errors = timeouts = 0
        for component, weight in self.parts:
            res = component(batch)
            if len(res.scores) != n:
                raise RewardError(f"reward '{component.name}' returned {len(res.scores)} scores for {n} samples")
            check_finite(res.scores, batch, component.name)
            total += weight * torch.tensor(res.scores, dtype=torch.float64)
            if getattr(component, "log_mean", True) and n:
                metrics[f"reward/{component.name}"] = sum(res.scores) / n
            metrics.update(res.metrics)
            errors += res.errors
            timeouts += res.timeouts
            if res.errors and n and not self.defer_share_check:
                self.check_fallback_share(component.name, res.errors, res.timeouts, n)
        if self.count_errors:
            metrics["reward/errors"] = float(errors)
        if self.pool is not None:
            metrics["reward/timeouts"] = float(timeouts)
        return RewardOutput(scores=total.float(), metrics=metrics)

    def check_fallback_share(self, name: str, failed: int, timeouts: int, n: int) -> None:
        """Warn when most samples got ``reward.fallback_score``; stop past ``reward.max_fallback_share``."""
        share = failed / n
        what = (f"reward '{name}' failed on {failed} of {n} samples of this step ({timeouts} timed out) and gave "
                "them reward.fallback_score")
        if share > self.max_fallback_share:
            raise RewardError(f"{what}: more than reward.max_fallback_share={self.max_fallback_share:g} of the step, "
                              "so training would follow a constant; fix the function (run it with "
                              "reward.fallback_score=null to see the first error) or raise reward.max_fallback_share")
        if share > 0.5:
            log.warning("%s: most of the step is trained on that constant; the run stops when more than "
                        "reward.max_fallback_share=%g fail", what, self.max_fallback_share)

    def close(self) -> None:
        """Stop the worker processes, if any."""
        if self.pool is not None:
            self.pool.close()


def _check_reward_config(reward: Any) -> dict[str, float]:
    problems = []
    if reward.num_workers < 0:
        problems.append(f"reward.num_workers must be >= 0, got {reward.num_workers}")
    if not (isinstance(reward.timeout_s, (int, float)) and reward.timeout_s > 0):
        problems.append(f"reward.timeout_s must be a number > 0, got {reward.timeout_s!r}")
    if reward.fallback_score is not None and not math.isfinite(float(reward.fallback_score)):
        problems.append(f"reward.fallback_score must be a finite number or null, got {reward.fallback_score}")
    weights: dict[str, float] = {}
    for name, w in dict(reward.weights or {}).items():
        try:
            weights[str(name)] = float(w)
            if not math.isfinite(weights[str(name)]):
                raise ValueError
        except (TypeError, ValueError):
            problems.append(f"reward.weights.{name} must be a finite number, got {w!r}")
    if problems:
        raise ConfigError(problems)
    return weights


def _unknown_names(names: Sequence[str], known: Sequence[str]) -> str:
    lines = []
    for n in names:
        near = difflib.get_close_matches(n, known, n=1, cutoff=0.6)
        lines.append(f"'{n}'" + (f" (did you mean '{near[0]}'?)" if near else ""))
    return (f"reward.weights names unknown reward(s) {', '.join(lines)}; registered rewards: "
            f"{', '.join(sorted(known))}")


def function_parts(reward_function: Any, reward: Any, rewards: Mapping[str, Callable[..., Any]],
                   has_rm: bool) -> tuple[list[tuple[Any, float]], Any]:
    """The function components and their weights (see the module docstring), and the worker pool if any."""
    weights = _check_reward_config(reward)
    if RM_NAME in weights and not has_rm:
        raise RewardError(f"reward.weights.{RM_NAME} is set but reward_model.enable is false")
    weights.pop(RM_NAME, None)
    pool = None
    if reward.num_workers > 0:
        from rlcore.rewards.pool import WorkerPool

        pool = WorkerPool(reward.num_workers, reward.timeout_s)

    def make(name: str, fn: Callable[..., Any], kwargs: Optional[dict] = None, ref: Any = None) -> FunctionReward:
        return FunctionReward(name, fn, kwargs=kwargs, fallback=reward.fallback_score, pool=pool, ref=ref,
                              timeout_s=None if pool is not None else reward.timeout_s)

    registry: dict[str, Any] = dict(rewards)
    if reward_function.path:
        fname = reward_function.name
        custom = make(fname, load_function(reward_function.path, fname), dict(reward_function.kwargs or {}),
                      ("load", reward_function.path, fname))
        if not weights:
            return [(custom, 1.0)], pool
        if fname not in weights:
            raise RewardError(f"reward.weights is set but does not mention the custom function '{fname}' of "
                              f"custom_reward_function.path; add reward.weights.{fname} or clear reward.weights")
        registry[fname] = custom
    elif not weights:
        return ([] if has_rm else [(DataSourceDispatch(rewards, make), 1.0)]), pool
    unknown = [n for n in weights if n not in registry]
    if unknown:
        raise RewardError(_unknown_names(unknown, list(registry)))
    parts = [(registry[n] if isinstance(registry[n], FunctionReward) else make(n, registry[n]), w)
             for n, w in weights.items()]
    return parts, pool


def assemble_backend(reward_function: Any, reward: Any, rewards: Mapping[str, Callable[..., Any]],
                     rm_factory: Optional[Callable[[], Any]] = None) -> RewardPipeline:
    """Build the pipeline: function components first (cheap checks), then the reward model from ``rm_factory``.

    :param rm_factory: builds the reward-model component (named ``rm``); None when no reward model is used.
    """
    parts, pool = function_parts(reward_function, reward, rewards, has_rm=rm_factory is not None)
    if rm_factory is not None:
        try:
            parts.append((rm_factory(), float(dict(reward.weights or {}).get(RM_NAME, 1.0))))
        except BaseException:
            if pool is not None:
                pool.close()
            raise
    return RewardPipeline(parts, pool=pool, count_errors=reward.fallback_score is not None,
                          max_fallback_share=float(getattr(reward, "max_fallback_share", 1.0)))


def build_reward_backend(reward_model: Any, reward_function: Any, reward: Any, placement: Any, tokenizer: Any,
                         rewards: Mapping[str, Callable[..., Any]]) -> RewardPipeline:
    """The default ``rlcore_reward_backend``: functions, plus a reward model resident on
    ``placement.device_for("reward")`` when ``reward_model.enable``.

    :raises PlacementError: ``reward_model.offload`` without the ``rm-offload`` plugin.
    :raises RewardError: a missing or unusable reward function or reward model, or no reward at all.
    """
    rm_factory = None
    if reward_model.enable:
        if placement.offload("reward"):
            raise PlacementError(OFFLOAD_NEEDS_PLUGIN)
        device = placement.device_for("reward")

        def rm_factory() -> Any:
            from rlcore.rewards.reward_model import ResidentScorer, RewardModel

            return ResidentScorer(RewardModel.load(reward_model, tokenizer), device)

    return assemble_backend(reward_function, reward, rewards, rm_factory)
