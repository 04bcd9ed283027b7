"""Scoring on the ranks of the reward role when ``placement.rank_groups.reward`` names a subset of them.

Only the reward ranks build the reward backend, so only they load the reward model. Every rank
still calls :meth:`RoutedReward.score` with its own samples at the same point of the step; the call
is collective over the default process group (gloo or NCCL) and goes:

1. each rank's batch goes to the reward rank assigned to it (:func:`assign_scorers`), one gather
   per reward rank, so a batch travels once, not to every rank;
2. each reward rank scores its batches one owner rank's batch at a time, so scores and metrics are
   those the owner would have computed itself;
3. every rank learns which owners' scoring failed (one small all-gather), then each reward rank
   scatters the results, and each rank keeps its own scores and metrics.

Function rewards travel the same way: with a reward rank group, *every* reward (functions and
model) is computed on the reward ranks, and the other ranks build no reward backend at all.

A reward that raises, or a score that is NaN or infinite, on a reward rank is reported as an error
instead of scores; after step 3's all-gather every rank raises the same :class:`RewardError` (the
first failing owner rank's message, naming the reward rank that scored it), so no rank is left
waiting in a collective.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence

import torch

from rlcore.errors import PlacementError, RewardError
from rlcore.protocols import DistInfo, RewardInput, RewardOutput
from rlcore.rewards.base import describe_sample

log = logging.getLogger(__name__)

#: One owner's result: ``("ok", scores, metrics)`` or ``("error", message, None)``.
Result = tuple[str, Any, Optional[dict]]


def assign_scorers(world_size: int, reward_ranks: Sequence[int]) -> list[int]:
    """The reward rank that scores each rank's samples, indexed by owner rank.

    A reward rank scores its own samples; the other ranks are dealt round-robin over the reward
    ranks in rank order (world 4, reward ranks [3]: ``[3, 3, 3, 3]``; world 6, reward ranks [4, 5]:
    ``[4, 5, 4, 5, 4, 5]``).
    """
    pool = sorted(reward_ranks)
    if not pool:
        raise PlacementError("the reward role has no ranks")
    out, k = [], 0
    for rank in range(world_size):
        if rank in pool:
            out.append(rank)
        else:
            out.append(pool[k % len(pool)])
            k += 1
    return out


def _check_scores(out: RewardOutput, batch: RewardInput) -> list[float]:
    scores = out.scores.detach().float().cpu().reshape(-1)
    n = len(batch.responses)
    if scores.numel() != n:
        raise RewardError(f"reward backend returned {scores.numel()} scores for {n} samples")
    finite = torch.isfinite(scores)
    if not finite.all():
        bad = int((~finite).nonzero()[0])
        raise RewardError(f"reward backend returned {float(scores[bad])} for sample {bad}; scores must be "
                          f"finite numbers\n{describe_sample(batch, bad)}")
    return scores.tolist()


class TorchComm:
    """The three collectives :class:`RoutedReward` uses, over the default process group."""

    @staticmethod
    def gather(obj: Any, dst: int) -> Optional[list]:
        from rlcore.distributed.init import gather_object

        return gather_object(obj, dst)

    @staticmethod
    def scatter(objs: Optional[list], src: int) -> Any:
        from rlcore.distributed.init import scatter_object

        return scatter_object(objs, src)

    @staticmethod
    def all_gather(obj: Any) -> list:
        from rlcore.distributed.init import all_gather_object

        return all_gather_object(obj)


class RoutedReward:
    """A :class:`~rlcore.protocols.RewardBackend` whose scoring happens on the reward ranks.

    :param backend: the reward backend on a reward rank; None on the other ranks.
    :param reward_ranks: the global ranks of the reward role.
    :param dist: this rank and the world size.
    :param comm: ``gather(obj, dst)``, ``scatter(objs, src)`` and ``all_gather(obj)`` (default:
        :class:`TorchComm`, the default group); every rank must call ``score`` the same number of times.
    """

    def __init__(self, backend: Any, reward_ranks: Sequence[int], dist: DistInfo, comm: Any = None):
        self.reward_ranks = sorted(reward_ranks)
        if (backend is not None) != (dist.rank in self.reward_ranks):
            raise PlacementError(f"rank {dist.rank}: a reward backend is built exactly on the reward ranks "
                                 f"{self.reward_ranks}")
        self.backend, self.rank, self.world_size = backend, dist.rank, dist.world_size
        self.scorers = assign_scorers(dist.world_size, self.reward_ranks)
        self._comm = comm if comm is not None else TorchComm()

    def score(self, batch: RewardInput) -> RewardOutput:
        """This rank's scores and metrics, computed on its reward rank (collective: every rank calls it)."""
        mine: dict[int, Result] = {}  # owner rank -> result, on a reward rank
        for scorer in self.reward_ranks:
            batches = self._comm.gather(batch if self.scorers[self.rank] == scorer else None, scorer)
            if self.rank == scorer:
                for owner, owned in enumerate(batches):
                    if self.scorers[owner] == scorer:
                        mine[owner] = self._score_for(owner, owned)
        failures: dict[int, str] = {}
        for part in self._comm.all_gather({o: r[1] for o, r in mine.items() if r[0] == "error"}):
            failures.update(part)
        if failures:
            raise RewardError(failures[min(failures)])
        result: Optional[Result] = None
        for scorer in self.reward_ranks:
            out = [mine.get(owner) for owner in range(self.world_size)] if self.rank == scorer else None
            got = self._comm.scatter(out, scorer)
            if self.scorers[self.rank] == scorer:
                result = got
        _, scores, metrics = result
        return RewardOutput(scores=torch.tensor(scores, dtype=torch.float32), metrics=dict(metrics or {}))

    def _score_for(self, owner: int, batch: RewardInput) -> Result:
        try:
            out = self.backend.score(batch)
            return "ok", _check_scores(out, batch), dict(out.metrics)
        except Exception as e:  # sent to every rank, which all raise it
            log.exception("reward failed on rank %d for the samples of rank %d", self.rank, owner)
            text = str(e) if isinstance(e, RewardError) else f"{type(e).__name__}: {e}"
            return "error", f"{text}\n(scored on reward rank {self.rank} for the samples of rank {owner})", None

    def close(self) -> None:
        """Close the local backend (its worker processes), if this rank has one."""
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()


def build_routed_reward(build: Callable[[], Any], placement: Any, dist: DistInfo) -> Any:
    """The reward backend of this rank: ``build()`` itself when the reward role is on every rank;
    else a :class:`RoutedReward`, with ``build()`` called on the reward ranks only.

    :param build: builds the local reward backend (the ``rlcore_reward_backend`` factory hook).
    :param placement: the placement policy (its ``ranks_for("reward")`` is read).
    """
    ranks = sorted(placement.ranks_for("reward"))
    if len(ranks) >= dist.world_size:
        return build()
    if dist.is_main:
        log.info("reward role on ranks %s; the rank scoring each rank's samples, by rank: %s", ranks,
                 assign_scorers(dist.world_size, ranks))
    return RoutedReward(build() if dist.rank in ranks else None, ranks, dist)
