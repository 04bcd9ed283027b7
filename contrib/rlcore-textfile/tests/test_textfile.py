"""The textfile plugin: parsing, tokenized rows, passing for other formats, errors."""

from __future__ import annotations

import pytest

import rlcore_textfile
from rlcore.config.schema import CustomClsConfig, DataConfig
from rlcore.errors import DataError
from rlcore.protocols import DistInfo


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("a b c\n\n  \nd e\tf\ng\\th\ti j\nk l a b c d e f g\n")
    return str(path)


def provide(config, tok, split="train"):
    return rlcore_textfile.rlcore_dataset_provider(config=config, tokenizer=tok, split=split, dist=DistInfo())


def test_lines_become_rows(prompts):
    rows = rlcore_textfile.read_prompt_file(prompts)
    assert [r["prompt"] for r in rows] == ["a b c", "d e", "g\th", "k l a b c d e f g"]
    assert [r.get("ground_truth") for r in rows] == [None, "f", "i j", None]
    assert [r["line"] for r in rows] == [1, 4, 5, 6]


def test_rows_are_tokenized_and_overlong_ones_dropped(prompts, tiny_tokenizer):
    ds = provide(DataConfig(train_files=[prompts], max_prompt_length=4, prompt_key="question"), tiny_tokenizer)
    assert len(ds) == 3 and ds.stats.dropped == 1
    row = ds[1]
    assert row["question"] == "d e" and row["ground_truth"] == "f" and "prompt" not in row
    assert row["input_ids"] == tiny_tokenizer("d e")["input_ids"]


def test_passes_for_other_inputs(prompts, tmp_path, tiny_tokenizer):
    other = tmp_path / "x.parquet"
    other.write_bytes(b"")
    assert provide(DataConfig(train_files=[prompts, str(other)]), tiny_tokenizer) is None
    assert provide(DataConfig(), tiny_tokenizer) is None
    assert provide(DataConfig(train_files=[prompts]), tiny_tokenizer, split="val") is None
    custom = DataConfig(train_files=[prompts], custom_cls=CustomClsConfig(path="x.py", name="X"))
    assert provide(custom, tiny_tokenizer) is None


def test_wins_over_the_default_provider(prompts, rlcore_pm, rlcore_register, tiny_tokenizer):
    rlcore_register(rlcore_textfile, "textfile")
    ds = rlcore_pm.build("rlcore_dataset_provider", config=DataConfig(val_files=[prompts], train_files=[prompts]),
                         tokenizer=tiny_tokenizer, split="val", dist=DistInfo())
    assert isinstance(ds, rlcore_textfile.TextFileDataset) and len(ds) == 4


def test_errors_name_the_files(tmp_path, prompts, tiny_tokenizer):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match=r"empty: 1 text file\(s\) hold no prompt line \(.*empty\.txt\)"):
        provide(DataConfig(train_files=[str(empty)]), tiny_tokenizer)
    with pytest.raises(DataError, match=r"every prompt is longer than data.max_prompt_length=1 .*4 of 4 lines"):
        provide(DataConfig(train_files=[prompts], max_prompt_length=1), tiny_tokenizer)
    with pytest.raises(DataError, match="missing.txt"):
        provide(DataConfig(train_files=[str(tmp_path / "missing.txt")]), tiny_tokenizer)
