"""The default dataset provider: formats, chat prompts, length policy, parallel preprocessing, the Arrow cache."""

from __future__ import annotations

import copy
import json
import multiprocessing as mp
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlcore.config.schema import DataConfig
from rlcore.data import cache as dcache
from rlcore.data.provider import PromptTable, RowsDataset, build_dataset
from rlcore.data.synthetic import synthetic_rows, write_parquet_shards
from rlcore.errors import DataError
from rlcore.protocols import DistInfo

DIST = DistInfo()
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}a{% endif %}")


@pytest.fixture
def shards(tmp_path):
    # 3 files, rows of 1-12 words, 5 row groups in the largest: several units per file.
    return write_parquet_shards(str(tmp_path / "d"), [40, 33, 57], row_group_size=12)


def ids_of(ds):
    return [ds[i]["id"] for i in range(len(ds))]


def test_parquet_rows_carry_prompt_ids_and_every_column(shards, tiny_tokenizer):
    ds = build_dataset(DataConfig(train_files=shards, max_prompt_length=100), tiny_tokenizer, "train", DIST)
    assert isinstance(ds, PromptTable) and len(ds) == 130
    row = ds[5]
    assert set(row) == {"prompt", "input_ids", "id", "ground_truth", "data_source"}
    assert row["input_ids"] == tiny_tokenizer(row["prompt"])["input_ids"]
    assert ids_of(ds) == list(range(130))  # file order, then row order
    assert [r["id"] for r in ds.__getitems__([7, 3, 99])] == [7, 3, 99]


def test_glob_and_jsonl(tmp_path, tiny_tokenizer):
    rows = synthetic_rows(20)
    for part in (0, 1):
        with open(tmp_path / f"p{part}.jsonl", "w") as f:
            for r in rows[part * 10:(part + 1) * 10]:
                f.write(json.dumps(r) + "\n")
    ds = build_dataset(DataConfig(train_files=[str(tmp_path / "p*.jsonl")], max_prompt_length=100),
                       tiny_tokenizer, "train", DIST)
    assert ids_of(ds) == list(range(20))
    assert ds[3]["prompt"] == rows[3]["prompt"]


def test_chat_messages_are_rendered_with_the_template(tmp_path, tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = CHAT_TEMPLATE
    msgs = [[{"role": "b", "content": "c d"}], [{"role": "e", "content": "f"}, {"role": "g", "content": "h i"}]]
    path = str(tmp_path / "chat.parquet")
    pq.write_table(pa.Table.from_pylist([{"prompt": m, "answer": str(i)} for i, m in enumerate(msgs)]), path)
    ds = build_dataset(DataConfig(train_files=[path], max_prompt_length=100), tok, "train", DIST)
    assert ds[0]["prompt"] == "b c d a" and ds[1]["prompt"] == "e f g h i a"
    assert ds[1]["input_ids"] == tok("e f g h i a", add_special_tokens=False)["input_ids"]
    assert ds[1]["answer"] == "1"


def test_overlong_prompts_are_filtered_and_counted(shards, tiny_tokenizer):
    full = build_dataset(DataConfig(train_files=shards, max_prompt_length=100), tiny_tokenizer, "train", DIST)
    lengths = {r["id"]: len(r["input_ids"]) for r in full.__getitems__(range(len(full)))}
    ds = build_dataset(DataConfig(train_files=shards, max_prompt_length=6), tiny_tokenizer, "train", DIST)
    expected = sorted(i for i, n in lengths.items() if n <= 6)
    assert ids_of(ds) == expected
    assert ds.stats["dropped"] == 130 - len(expected) > 0 and ds.stats["rows"] == 130


@pytest.mark.parametrize("side", ["left", "right"])
def test_truncation_keeps_the_chosen_side(shards, tiny_tokenizer, side):
    cfg = DataConfig(train_files=shards, max_prompt_length=4, filter_overlong_prompts=False, truncation=side)
    ds = build_dataset(cfg, tiny_tokenizer, "train", DIST)
    assert len(ds) == 130 and ds.stats["truncated"] > 0
    for row in ds.__getitems__(range(len(ds))):
        full = tiny_tokenizer(row["prompt"])["input_ids"]
        assert row["input_ids"] == (full[-4:] if side == "left" else full[:4])


def test_truncation_error_names_the_file_and_counts(shards, tiny_tokenizer):
    cfg = DataConfig(train_files=shards, max_prompt_length=4, filter_overlong_prompts=False, truncation="error")
    with pytest.raises(DataError, match=r"part-00000\.parquet column 'prompt'.* of 12 prompt\(s\) exceed"):
        build_dataset(cfg, tiny_tokenizer, "train", DIST)


def test_parallel_preprocessing_gives_the_same_table(shards, tiny_tokenizer):
    one = build_dataset(DataConfig(train_files=shards, max_prompt_length=8), tiny_tokenizer, "train", DIST)
    two = build_dataset(DataConfig(train_files=shards, max_prompt_length=8, preprocess_workers=2),
                        tiny_tokenizer, "train", DIST)
    assert two.table.equals(one.table) and two.stats == one.stats


@pytest.fixture
def encoded(monkeypatch):
    """Counts the prompts tokenized while building tables."""
    from rlcore.data import table

    calls = []
    original = table.encode_prompts

    def counting(prompts, tok, where, *rest):
        calls.append(len(prompts))
        return original(prompts, tok, where, *rest)

    monkeypatch.setattr(table, "encode_prompts", counting)
    return calls


def test_cache_warm_start_skips_tokenizing_and_change_invalidates(shards, tiny_tokenizer, tmp_path, encoded):
    cfg = DataConfig(train_files=shards, max_prompt_length=8, cache_dir=str(tmp_path / "cache"))
    tok = tiny_tokenizer
    cold = build_dataset(cfg, tok, "train", DIST)
    assert not cold.from_cache and sum(encoded) == 130
    warm = build_dataset(cfg, tok, "train", DIST)
    assert warm.from_cache and sum(encoded) == 130 and warm.table.equals(cold.table)
    assert warm.stats == cold.stats
    # Other options -> another entry.
    other = build_dataset(DataConfig(train_files=shards, max_prompt_length=9, cache_dir=cfg.cache_dir),
                          tok, "train", DIST)
    assert not other.from_cache and len(other) >= len(cold)
    # A rewritten input -> a miss, and the new rows.
    write_parquet_shards(os.path.dirname(shards[0]), [40, 33, 57], row_group_size=12, seed=7)
    again = build_dataset(cfg, tok, "train", DIST)
    assert not again.from_cache and not again.table.equals(cold.table)
    entries = [f for f in os.listdir(cfg.cache_dir) if f.endswith(".arrow")]
    assert len(entries) == 3 and not [f for f in os.listdir(cfg.cache_dir) if f.endswith(".tmp")]


def test_unreadable_entry_is_rebuilt(shards, tiny_tokenizer, tmp_path, caplog):
    cfg = DataConfig(train_files=shards, cache_dir=str(tmp_path / "c"))
    first = build_dataset(cfg, tiny_tokenizer, "train", DIST)
    with open(first.path + ".junk", "wb") as f:  # a new inode: `first` keeps its mapping
        f.write(b"not arrow")
    os.replace(first.path + ".junk", first.path)
    again = build_dataset(cfg, tiny_tokenizer, "train", DIST)
    assert not again.from_cache and again.table.equals(first.table) and "rebuilding" in caplog.text
    assert build_dataset(cfg, tiny_tokenizer, "train", DIST).from_cache


def test_cached_table_pickles_by_path(shards, tiny_tokenizer, tmp_path):
    import pickle

    ds = build_dataset(DataConfig(train_files=shards, cache_dir=str(tmp_path / "c")), tiny_tokenizer, "train", DIST)
    blob = pickle.dumps(ds)
    assert len(blob) < 4096
    assert pickle.loads(blob)[17] == ds[17]


def test_direct_backend_call_matches_the_tokenizer(tiny_tokenizer):
    from rlcore.data.collate import tokenize

    texts = ["a b c", "l k", "zz a"]
    for special in (True, False):
        assert tokenize(texts, tiny_tokenizer, special) == tiny_tokenizer(texts, add_special_tokens=special)["input_ids"]
    tok = copy.deepcopy(tiny_tokenizer)
    tok.backend_tokenizer.enable_truncation(2)  # a backend set up to truncate is not called directly
    assert tokenize(texts, tok, True) == tiny_tokenizer(texts)["input_ids"]


def test_tokenizer_change_changes_the_key(shards, tiny_tokenizer):
    cfg = DataConfig(train_files=shards)
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = CHAT_TEMPLATE
    assert dcache.cache_key(shards, tiny_tokenizer, cfg) == dcache.cache_key(shards, copy.deepcopy(tiny_tokenizer), cfg)
    assert dcache.cache_key(shards, tiny_tokenizer, cfg) != dcache.cache_key(shards, tok, cfg)


def _build_in_process(args):
    shards, cache_dir, model_dir = args
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ds = build_dataset(DataConfig(train_files=shards, cache_dir=cache_dir, max_prompt_length=8), tok, "train", DIST)
    return len(ds), ds[0]["id"]


def test_concurrent_builders_leave_one_valid_entry(shards, tiny_model_dir, tmp_path):
    cache_dir = str(tmp_path / "shared-cache")
    with mp.get_context("fork").Pool(2) as pool:
        results = pool.map(_build_in_process, [(shards, cache_dir, tiny_model_dir)] * 2)
    assert results[0] == results[1]
    files = sorted(os.listdir(cache_dir))
    assert [f for f in files if f.endswith(".arrow")] and not [f for f in files if ".tmp" in f]
    assert _build_in_process((shards, cache_dir, tiny_model_dir)) == results[0]


def test_demo_fallback_and_empty_val(shards, tiny_tokenizer):
    pytest.importorskip("rlcore.demo")
    train = build_dataset(DataConfig(), tiny_tokenizer, "train", DIST)
    val = build_dataset(DataConfig(), tiny_tokenizer, "val", DIST)
    assert len(train) > len(val) > 0 and "input_ids" in train[0]
    none = build_dataset(DataConfig(train_files=shards), tiny_tokenizer, "val", DIST)
    assert isinstance(none, RowsDataset) and len(none) == 0
