"""Scoring on the reward ranks (``RoutedReward``), with ranks simulated by threads sharing collectives."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from rlcore.errors import PlacementError, RewardError
from rlcore.protocols import DistInfo, RewardInput, RewardOutput
from rlcore.rewards.routed import RoutedReward, assign_scorers, build_routed_reward


class ThreadGroup:
    """The collectives of ``n`` threads standing for ranks (a barrier timeout turns a hang into an
    error); counts what each rank receives, to check that a batch travels to its reward rank only."""

    def __init__(self, n: int):
        self.slots = [None] * n
        self.barrier = threading.Barrier(n, timeout=20)
        self.received = [0] * n  # objects other than None that reached each rank

    def _exchange(self, rank, obj, read):
        self.barrier.wait()
        self.slots[rank] = obj
        self.barrier.wait()
        out = read()
        self.barrier.wait()
        return out

    def comm_for(self, rank: int):
        group = self

        class Comm:
            @staticmethod
            def all_gather(obj):
                return group._exchange(rank, obj, lambda: list(group.slots))

            @staticmethod
            def gather(obj, dst):
                out = group._exchange(rank, obj, lambda: list(group.slots) if rank == dst else None)
                if out is not None:
                    group.received[rank] += sum(o is not None for i, o in enumerate(out) if i != rank)
                return out

            @staticmethod
            def scatter(objs, src):
                return group._exchange(rank, objs, lambda: group.slots[src][rank])

        return Comm()


class LengthReward:
    """Score = response length + 0.5 * prompt length; records what it scored."""

    def __init__(self, bad=None):
        self.seen, self.bad = [], bad

    def score(self, batch):
        self.seen.append(list(batch.responses))
        if self.bad == "raise" and "boom" in batch.responses:
            raise ValueError("cannot score 'boom'")
        scores = [len(r) + 0.5 * len(p) for p, r in zip(batch.prompts, batch.responses)]
        if self.bad == "nan" and "boom" in batch.responses:
            scores[batch.responses.index("boom")] = math.nan
        return RewardOutput(scores=torch.tensor(scores), metrics={"reward/n": float(len(scores))})


def batch_of(rank: int, n: int = 2, extra=None) -> RewardInput:
    responses = [f"r{rank}" + "x" * i for i in range(n)] + ([extra] if extra else [])
    prompts = ["p" * (rank + 1)] * len(responses)
    return RewardInput(prompts=prompts, responses=responses, prompt_ids=[[1]] * len(responses),
                       response_ids=[[2]] * len(responses))


def run_ranks(world, reward_ranks, backends, batches, group=None):
    """Every rank's ``score`` in its own thread; ``(outputs, errors)`` by rank."""
    group = group or ThreadGroup(world)
    outs, errs = [None] * world, [None] * world

    def one(rank):
        try:
            routed = RoutedReward(backends.get(rank), reward_ranks, DistInfo(rank=rank, world_size=world),
                                  comm=group.comm_for(rank))
            outs[rank] = routed.score(batches[rank])
        except Exception as e:  # noqa: BLE001 - collected for the assertions
            errs[rank] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return outs, errs


def test_assignment():
    assert assign_scorers(4, [3]) == [3, 3, 3, 3]
    assert assign_scorers(6, [5, 4]) == [4, 5, 4, 5, 4, 5]
    assert assign_scorers(5, [0, 2]) == [0, 0, 2, 2, 0]
    with pytest.raises(PlacementError):
        assign_scorers(2, [])


def test_scores_match_local_scoring_and_go_back_to_their_owner():
    world, backend = 3, LengthReward()
    batches = [batch_of(r, n=r + 1) for r in range(world)]
    outs, errs = run_ranks(world, [1], {1: backend}, batches)
    assert errs == [None] * world
    for rank in range(world):
        want = LengthReward().score(batches[rank])
        assert torch.equal(outs[rank].scores, want.scores.float())
        assert outs[rank].metrics == want.metrics
    assert sorted(map(tuple, backend.seen)) == sorted(tuple(b.responses) for b in batches)  # one call per owner


def test_each_batch_travels_to_its_reward_rank_only():
    world, group = 6, ThreadGroup(6)
    backends = {4: LengthReward(), 5: LengthReward()}
    batches = [batch_of(r, n=2) for r in range(world)]
    outs, errs = run_ranks(world, [4, 5], backends, batches, group)
    assert errs == [None] * world
    assert all(torch.equal(outs[r].scores, LengthReward().score(batches[r]).scores.float()) for r in range(world))
    assert group.received == [0, 0, 0, 0, 2, 2]  # ranks 0 and 2 to rank 4, ranks 1 and 3 to rank 5
    assert sorted(map(tuple, backends[4].seen)) == sorted(tuple(batches[r].responses) for r in (0, 2, 4))


@pytest.mark.parametrize("bad, message", [("raise", "ValueError: cannot score 'boom'"),
                                          ("nan", "returned nan for sample 2")])
def test_a_failure_on_the_reward_rank_fails_every_rank(bad, message):
    world = 3
    batches = [batch_of(0), batch_of(1), batch_of(2, extra="boom")]
    outs, errs = run_ranks(world, [0, 1], {0: LengthReward(bad), 1: LengthReward(bad)}, batches)
    assert outs == [None] * world
    texts = {str(e) for e in errs}
    assert all(isinstance(e, RewardError) for e in errs) and len(texts) == 1  # the same message everywhere
    text = texts.pop()
    assert message in text and "scored on reward rank 0 for the samples of rank 2" in text


def test_backend_only_on_reward_ranks():
    with pytest.raises(PlacementError):
        RoutedReward(None, [0], DistInfo(rank=0, world_size=2), comm=ThreadGroup(2).comm_for(0))
    with pytest.raises(PlacementError):
        RoutedReward(LengthReward(), [0], DistInfo(rank=1, world_size=2), comm=ThreadGroup(2).comm_for(1))


class Pool:
    def __init__(self, ranks, rank, world):
        self.ranks, self.rank, self.world = ranks, rank, world

    def ranks_for(self, role):
        return self.ranks if role == "reward" else list(range(self.world))


def test_build_only_on_reward_ranks():
    built = []
    build = lambda: built.append(1) or LengthReward()  # noqa: E731
    colocated = build_routed_reward(build, Pool([0, 1], 1, 2), DistInfo(rank=1, world_size=2))
    assert isinstance(colocated, LengthReward) and built == [1]
    other = build_routed_reward(build, Pool([0], 1, 2), DistInfo(rank=1, world_size=2))
    assert isinstance(other, RoutedReward) and other.backend is None and built == [1]
    holder = build_routed_reward(build, Pool([0], 0, 2), DistInfo(rank=0, world_size=2))
    assert isinstance(holder.backend, LengthReward) and built == [1, 1]
