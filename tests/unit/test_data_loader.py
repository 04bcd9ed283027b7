"""PromptLoader: seeded epochs, one share per rank, workers, exact resume, iterable datasets."""

from __future__ import annotations

import pytest
from torch.utils.data import IterableDataset

from rlcore.config.schema import DataConfig
from rlcore.data.loader import PromptLoader, epoch_indices
from rlcore.data.provider import RowsDataset
from rlcore.errors import DataError
from rlcore.protocols import DistInfo

ROWS = RowsDataset([{"prompt": f"p{i}", "id": i, "input_ids": [i]} for i in range(50)])


def ids(batch):
    return [r["id"] for r in batch]


def take(loader, n):
    return [ids(loader.next_batch()) for _ in range(n)]


def test_epochs_cover_each_row_once_and_reshuffle():
    loader = PromptLoader(ROWS, DataConfig(), batch_size=8, seed=3, dist=DistInfo())
    epoch0 = take(loader, 6)  # 50 rows -> 6 whole batches, 2 rows dropped
    assert loader.epoch == 0
    flat0 = [i for b in epoch0 for i in b]
    assert len(set(flat0)) == 48
    epoch1 = take(loader, 6)
    assert loader.epoch == 1 and len({i for b in epoch1 for i in b}) == 48
    assert epoch1 != epoch0
    same_seed = PromptLoader(ROWS, DataConfig(), batch_size=8, seed=3, dist=DistInfo())
    assert take(same_seed, 6) == epoch0
    other_seed = PromptLoader(ROWS, DataConfig(), batch_size=8, seed=4, dist=DistInfo())
    assert take(other_seed, 6) != epoch0


def test_no_shuffle_keeps_order():
    loader = PromptLoader(ROWS, DataConfig(shuffle=False), batch_size=5, seed=0, dist=DistInfo())
    assert take(loader, 2) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


def test_ranks_get_disjoint_equal_shares():
    shares = [epoch_indices(50, 4, seed=1, epoch=2, dist=DistInfo(rank=r, world_size=3), shuffle=True)
              for r in range(3)]
    assert [len(s) for s in shares] == [16, 16, 16]
    assert len(set().union(*map(set, shares))) == 48
    loaders = [PromptLoader(ROWS, DataConfig(), 4, 1, DistInfo(rank=r, world_size=3)) for r in range(3)]
    seen = [i for ld in loaders for b in take(ld, 4) for i in b]
    assert len(seen) == len(set(seen)) == 48


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_continues_with_the_same_batches(workers):
    cfg = DataConfig(num_workers=workers, prefetch_factor=2)
    loader = PromptLoader(ROWS, cfg, batch_size=7, seed=5, dist=DistInfo())
    take(loader, 9)  # into epoch 1
    state = loader.state_dict()
    expected = take(loader, 8)
    resumed = PromptLoader(ROWS, cfg, batch_size=7, seed=0, dist=DistInfo())
    resumed.load_state_dict(state)
    assert resumed.epoch == 1 and take(resumed, 8) == expected


@pytest.mark.parametrize("before,after", [(4, 2), (2, 4), (3, 1)])
def test_resume_with_another_world_size_neither_repeats_nor_skips_rows(before, after):
    """4 ranks save after 2 batches each; 2 ranks resume: the epoch's remaining rows are dealt out to
    the new ranks, none of the rows taken before comes again, and no row of the epoch is skipped
    beyond the last incomplete batch."""
    rows = RowsDataset([{"prompt": f"p{i}", "id": i, "input_ids": [i]} for i in range(96)])
    first = [PromptLoader(rows, DataConfig(), 4, 7, DistInfo(rank=r, world_size=before)) for r in range(before)]
    taken = [i for ld in first for b in take(ld, 2) for i in b]
    states = [ld.state_dict() for ld in first]
    second = [PromptLoader(rows, DataConfig(), 4, 0, DistInfo(rank=r, world_size=after)) for r in range(after)]
    for ld in second:
        ld.load_state_dict(states[0])
    per_rank = (96 - len(taken)) // after // 4
    rest = [i for ld in second for b in take(ld, per_rank) for i in b]
    assert all(ld.epoch == 0 for ld in second)
    assert not set(rest) & set(taken)
    assert len(rest) == len(set(rest)) and len(rest) + len(taken) > 96 - 4 * after
    assert second[0].state_dict()["consumed"] == len(taken) + len(rest)


def test_too_small_for_a_batch():
    with pytest.raises(DataError, match=r"50 rows: 12 per rank for 4 rank\(s\), fewer than one batch of 16"):
        PromptLoader(ROWS, DataConfig(), 16, 0, DistInfo(rank=0, world_size=4))


class Unsharded(IterableDataset):
    """Like the seed's example: yields every row in every worker and on every rank."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield {"prompt": f"p{i}", "id": i}


def one_epoch(loader):
    """Ids of every batch of the loader's current epoch."""
    out, epoch = [], loader.epoch
    while True:
        batch = loader.next_batch()
        if loader.epoch != epoch:
            return out
        out += ids(batch)


@pytest.mark.parametrize("workers", [0, 2])
def test_unsharded_iterable_is_split_over_ranks_and_workers(workers):
    cfg = DataConfig(num_workers=workers, prefetch_factor=2)
    shares = [one_epoch(PromptLoader(Unsharded(41), cfg, 1, 0, DistInfo(rank=r, world_size=2))) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == list(range(41))
    assert abs(len(shares[0]) - len(shares[1])) <= max(1, workers)


class SelfSharded(Unsharded):
    """Shards itself over ranks and workers, as the hook specification describes."""

    shards_itself = True

    def __init__(self, n, rank, world):
        super().__init__(n)
        self.rank, self.world = rank, world

    def __iter__(self):
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        slot, slots = self.rank * nw + wid, self.world * nw
        return (r for r in super().__iter__() if r["id"] % slots == slot)


def test_self_sharded_iterable_is_read_as_is():
    cfg = DataConfig(num_workers=2, prefetch_factor=2)
    shares = [one_epoch(PromptLoader(SelfSharded(30, r, 2), cfg, 1, 0, DistInfo(rank=r, world_size=2)))
              for r in range(2)]
    assert sorted(shares[0] + shares[1]) == list(range(30))


def test_iterable_resume_has_no_loss_or_duplicate():
    cfg = DataConfig(num_workers=2, prefetch_factor=2)
    loader = PromptLoader(Unsharded(40), cfg, 4, 0, DistInfo())
    before = take(loader, 3)
    state = loader.state_dict()
    assert state["kind"] == "iterable" and state["positions"]
    resumed = PromptLoader(Unsharded(40), cfg, 4, 0, DistInfo())
    resumed.load_state_dict(state)
    after = one_epoch(resumed)
    flat = [i for b in before for i in b] + after
    assert sorted(flat) == list(range(40))


def test_state_of_another_kind_is_rejected():
    loader = PromptLoader(ROWS, DataConfig(), 4, 0, DistInfo())
    with pytest.raises(DataError, match="saved for a iterable dataset"):
        loader.load_state_dict({"kind": "iterable", "epoch": 0})


def test_changed_dataset_restarts_the_epoch(caplog):
    loader = PromptLoader(ROWS, DataConfig(shuffle=False), 5, 0, DistInfo())
    take(loader, 3)
    state = loader.state_dict()
    bigger = PromptLoader(RowsDataset(ROWS.rows + ROWS.rows[:5]), DataConfig(shuffle=False), 5, 0, DistInfo())
    bigger.load_state_dict(state)
    assert ids(bigger.next_batch()) == [0, 1, 2, 3, 4] and "changed since the checkpoint" in caplog.text


@pytest.mark.parametrize("cuda", [False, True])
def test_workers_prefetch_and_pinning_reach_the_dataloader(monkeypatch, cuda):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    cfg = DataConfig(num_workers=2, prefetch_factor=3, pin_memory=True)
    kw = PromptLoader(ROWS, cfg, batch_size=8, seed=0, dist=DistInfo())._loader_kwargs()
    assert kw["num_workers"] == 2 and kw["prefetch_factor"] == 3
    assert kw["pin_memory"] is cuda  # pinned host memory only helps copies to a GPU
    off = PromptLoader(ROWS, DataConfig(num_workers=0, pin_memory=False), batch_size=8, seed=0, dist=DistInfo())
    off_kw = off._loader_kwargs()
    assert isinstance(off_kw.pop("generator"), torch.Generator)  # the workers' seeds: not the global RNG's
    assert off_kw == {"num_workers": 0, "collate_fn": kw["collate_fn"], "pin_memory": False}


@pytest.mark.parametrize("workers", [0, 2])
def test_iterable_first_batch_is_read_early_and_handed_out_first(workers):
    cfg = DataConfig(num_workers=workers, prefetch_factor=2, shuffle=False)
    with pytest.raises(DataError, match="no full batch of 8 prompts"):
        PromptLoader(Unsharded(5), cfg, 8, 0, DistInfo()).check_first_batch()
    loader = PromptLoader(Unsharded(30), cfg, 4, 0, DistInfo())
    fresh = loader.state_dict()
    loader.check_first_batch()
    assert loader.state_dict() == fresh  # the pending batch is not counted as taken
    plain = PromptLoader(Unsharded(30), cfg, 4, 0, DistInfo())
    expected = take(plain, 9)  # into the second epoch
    resumed = PromptLoader(Unsharded(30), cfg, 4, 0, DistInfo())
    resumed.check_first_batch()
    resumed.load_state_dict(loader.state_dict())  # a resume drops the pending batch and starts where saved
    assert take(loader, 9) == expected and take(resumed, 9) == expected
    sized = PromptLoader(ROWS, DataConfig(), 4, 0, DistInfo())
    sized.check_first_batch()  # map-style sets were checked by length: nothing is read
    assert sized._pending is None and sized._it is None


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(ROWS[i] for i in range(len(ROWS)))


@pytest.mark.parametrize("dataset", [ROWS, _Stream()], ids=["map", "iterable"])
def test_batches_leave_the_global_random_stream_alone(dataset):
    """The loader's iterator must not draw from the global torch RNG (on its first batch, at each new
    epoch): a resumed run would draw its dropout masks shifted by one number."""
    import torch

    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    loader = PromptLoader(dataset, DataConfig(), batch_size=8, seed=3, dist=DistInfo())
    take(loader, 8)  # across the end of the first epoch
    assert torch.equal(torch.rand(3), expected)
