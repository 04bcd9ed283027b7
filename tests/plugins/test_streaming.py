"""The ``streaming`` plugin: every row once per epoch over ranks x workers, bounded reads, shuffling, resume."""

from __future__ import annotations

import itertools

import pytest
from torch.utils.data import DataLoader

from rlcore.config.schema import DataConfig
from rlcore.data import streaming
from rlcore.data.loader import PromptLoader
from rlcore.data.streaming import StreamingParquetDataset, build_streaming_dataset, split_rows
from rlcore.data.synthetic import write_parquet_shards
from rlcore.errors import DataError
from rlcore.protocols import DistInfo

# 7 shards of uneven sizes and row groups: nothing divides evenly.
COUNTS = [13, 0, 29, 5, 41, 17, 8]
TOTAL = sum(COUNTS)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_parquet_shards(str(tmp_path_factory.mktemp("stream")), COUNTS, row_group_size=6)


def dataset(shards, tok, rank=0, world=1, **kw):
    cfg = DataConfig(train_files=shards, max_prompt_length=kw.pop("max_prompt_length", 64),
                     shuffle_buffer=kw.pop("shuffle_buffer", 10), **kw)
    return build_streaming_dataset(cfg, tok, "train", DistInfo(rank=rank, world_size=world))


@pytest.mark.parametrize("num_slots", [1, 2, 3, 5, 8, 64, 200])
def test_split_rows_covers_every_row_once_with_balanced_slices(num_slots):
    sizes = [(f, rg, n) for f, rg, n in [(0, 0, 7), (0, 1, 1), (1, 0, 50), (2, 0, 3), (2, 1, 12), (3, 0, 40)]]
    rows = {(f, rg, i) for f, rg, n in sizes for i in range(n)}
    seen, lengths = [], []
    for slot in range(num_slots):
        pieces = split_rows(sizes, slot, num_slots)
        lengths.append(sum(p.rows for p in pieces))
        seen += [(p.file, p.row_group, i) for p in pieces for i in range(p.start, p.stop)]
    assert len(seen) == len(set(seen)) and set(seen) == rows
    assert max(lengths) - min(lengths) <= 1


@pytest.mark.parametrize("world,workers", [(1, 0), (3, 2), (4, 1)])
def test_every_row_exactly_once_per_epoch_over_ranks_and_workers(shards, tiny_tokenizer, world, workers):
    seen = []
    for rank in range(world):
        ds = dataset(shards, tiny_tokenizer, rank, world)
        ds.set_epoch(1)
        dl = DataLoader(ds, batch_size=None, num_workers=workers)
        seen += [row["id"] for row in dl]
    assert sorted(seen) == list(range(TOTAL))


def test_rows_hold_tokens_and_columns(shards, tiny_tokenizer):
    row = next(iter(dataset(shards, tiny_tokenizer)))
    assert set(row) == {"prompt", "input_ids", "id", "ground_truth", "data_source"}
    assert row["input_ids"] == tiny_tokenizer(row["prompt"])["input_ids"]


def test_shuffle_is_seeded_per_epoch_and_val_keeps_order(shards, tiny_tokenizer):
    ds = dataset(shards, tiny_tokenizer)
    epoch0 = [r["id"] for r in ds]
    ds.set_epoch(1)
    epoch1 = [r["id"] for r in ds]
    assert epoch0 != epoch1 and sorted(epoch0) == sorted(epoch1) == list(range(TOTAL))
    again = dataset(shards, tiny_tokenizer)
    assert [r["id"] for r in again] == epoch0
    again.set_seed(9)
    assert [r["id"] for r in again] != epoch0
    cfg = DataConfig(val_files=shards, shuffle_buffer=10)
    val = build_streaming_dataset(cfg, tiny_tokenizer, "val", DistInfo())
    assert [r["id"] for r in val] == list(range(TOTAL))


def test_reads_stay_within_one_window(shards, tiny_tokenizer, monkeypatch):
    read = []
    original = streaming._SliceReader._next_rows

    def counting(self):
        rows = original(self)
        read.append(len(rows or []))
        return rows

    monkeypatch.setattr(streaming, "READ_ROWS", 4)
    monkeypatch.setattr(streaming._SliceReader, "_next_rows", counting)
    ds = dataset(shards, tiny_tokenizer, shuffle_buffer=10)
    it = iter(ds)
    for consumed in range(1, TOTAL + 1):
        next(it)
        # rows read from disk so far: the windows started, never more than one window (+ one chunk) ahead
        assert sum(read) <= -(-consumed // 10) * 10 + 4
    assert sum(read) == TOTAL


def test_positions_resume_exactly(shards, tiny_tokenizer):
    ds = dataset(shards, tiny_tokenizer, world=1)
    ds.set_epoch(2)
    full = list(ds.iter_positions(0, (0, 1)))
    for cut in (0, 1, 9, 10, 11, 57, len(full) - 1):
        pos = full[cut][0]
        rest = [r["id"] for _, r in ds.iter_positions(pos, (0, 1))]
        assert rest == [r["id"] for _, r in full[cut + 1:]]
    # The dataset's own state (iteration in this process) resumes the same way.
    it = iter(ds)
    first = [next(it)["id"] for _ in range(23)]
    state = ds.state_dict()
    other = dataset(shards, tiny_tokenizer)
    other.load_state_dict(state)
    assert first + [r["id"] for r in other] == [r["id"] for _, r in full]


def test_loader_resume_with_workers_has_no_loss_or_duplicate(shards, tiny_tokenizer):
    cfg = DataConfig(train_files=shards, shuffle_buffer=10, num_workers=2, prefetch_factor=2)
    ds = build_streaming_dataset(cfg, tiny_tokenizer, "train", DistInfo())
    loader = PromptLoader(ds, cfg, batch_size=1, seed=4, dist=DistInfo())
    before = [loader.next_batch()[0]["id"] for _ in range(30)]
    state = loader.state_dict()
    resumed = PromptLoader(build_streaming_dataset(cfg, tiny_tokenizer, "train", DistInfo()), cfg, 1, 4, DistInfo())
    resumed.load_state_dict(state)
    after = []
    while resumed.epoch == 0:
        row = resumed.next_batch()[0]
        if resumed.epoch == 0:
            after.append(row["id"])
    assert sorted(before + after) == list(range(TOTAL))


def test_length_filter_counts_and_all_overlong(shards, tiny_tokenizer, caplog):
    ds = dataset(shards, tiny_tokenizer, max_prompt_length=5)
    rows = list(ds)
    assert all(len(r["input_ids"]) <= 5 for r in rows)
    assert ds.stats.rows == TOTAL and ds.stats.dropped == TOTAL - len(rows) > 0
    assert "dropped" in caplog.text
    with pytest.raises(DataError, match=r"every prompt is longer than data.max_prompt_length=0 .* 113 of 113 rows"):
        list(dataset(shards, tiny_tokenizer, max_prompt_length=0))


def test_streaming_errors(tmp_path, tiny_tokenizer, shards):
    empty = write_parquet_shards(str(tmp_path / "e"), [0, 0])
    with pytest.raises(DataError, match="empty"):
        dataset(empty, tiny_tokenizer)
    jl = tmp_path / "a.jsonl"
    jl.write_text('{"prompt": "a"}\n')
    with pytest.raises(DataError, match=r"reads parquet files only; got .*a\.jsonl"):
        dataset([str(jl)], tiny_tokenizer)
    with pytest.raises(DataError, match="column 'q' .* is missing"):
        dataset(shards, tiny_tokenizer, prompt_key="q")
    from tests.unit.test_data_checks import corrupt_pages

    bad = write_parquet_shards(str(tmp_path / "c"), [40])
    corrupt_pages(bad[0])
    with pytest.raises(DataError, match=r"part-00000\.parquet: row group 0 cannot be read"):
        list(dataset(bad, tiny_tokenizer))


def test_plugin_answers_only_for_files(shards, tiny_tokenizer):
    from rlcore.plugin_manager import build_plugin_manager

    pm = build_plugin_manager(["streaming"])
    ds = pm.build("rlcore_dataset_provider", config=DataConfig(train_files=shards), tokenizer=tiny_tokenizer,
                  split="train", dist=DistInfo())
    assert isinstance(ds, StreamingParquetDataset)
    pytest.importorskip("rlcore.demo")
    demo = pm.build("rlcore_dataset_provider", config=DataConfig(), tokenizer=tiny_tokenizer, split="train",
                    dist=DistInfo())
    assert not isinstance(demo, StreamingParquetDataset) and len(demo) > 0


def test_loader_batches_through_epochs(shards, tiny_tokenizer):
    cfg = DataConfig(train_files=shards, shuffle_buffer=10)
    ds = build_streaming_dataset(cfg, tiny_tokenizer, "train", DistInfo(rank=1, world_size=2))
    loader = PromptLoader(ds, cfg, batch_size=8, seed=0, dist=DistInfo(rank=1, world_size=2))
    batches = [loader.next_batch() for _ in range(16)]
    assert all(len(b) == 8 for b in batches) and loader.epoch >= 2
    per_epoch = TOTAL // 2 // 8  # 56 or 57 rows on this rank -> 7 whole batches
    first = [r["id"] for b in batches[:per_epoch] for r in b]
    assert len(set(first)) == len(first) == per_epoch * 8
    assert list(itertools.chain(batches[per_epoch:2 * per_epoch])) != batches[:per_epoch]
