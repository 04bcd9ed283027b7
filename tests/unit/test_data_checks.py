"""Bad input gives one clear DataError naming the file and column, with counts, before any model loads."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlcore.config.schema import DataConfig
from rlcore.data.provider import build_dataset, check_data_files
from rlcore.data.synthetic import write_parquet_shards
from rlcore.errors import DataError
from rlcore.protocols import DistInfo


@pytest.fixture
def good(tmp_path):
    return write_parquet_shards(str(tmp_path / "good"), 10)[0]


def test_missing_file_and_empty_glob(tmp_path, good):
    with pytest.raises(DataError, match=r"data\.train_files: 2 of 3 input\(s\) not found: .*nope\.parquet, .*x\*\.parquet"):
        check_data_files(DataConfig(train_files=[good, str(tmp_path / "nope.parquet"), str(tmp_path / "x*.parquet")]))
    with pytest.raises(DataError, match=r"data\.val_files: .*missing\.jsonl"):
        check_data_files(DataConfig(train_files=[good], val_files=[str(tmp_path / "missing.jsonl")]))


def test_corrupt_parquet_names_the_file(tmp_path, good):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(open(good, "rb").read()[:-100])  # truncated footer
    with pytest.raises(DataError, match=r"cannot read the parquet footer of .*bad\.parquet \(\d+ bytes\)"):
        check_data_files(DataConfig(train_files=[good, str(bad)]))
    text = tmp_path / "text.parquet"
    text.write_text("not parquet at all")
    with pytest.raises(DataError, match="text.parquet"):
        check_data_files(DataConfig(train_files=[str(text)]))


def corrupt_pages(path: str) -> None:
    """Overwrite the middle of the first column chunk: the footer still reads, the pages do not decode."""
    chunk = pq.read_metadata(path).row_group(0).column(0)
    with open(path, "r+b") as f:
        f.seek(chunk.data_page_offset + chunk.total_compressed_size // 2)
        f.write(b"\xff" * min(64, chunk.total_compressed_size // 4))


def test_corrupt_pages_name_the_file_and_row_group(tmp_path, tiny_tokenizer):
    path = str(tmp_path / "pages.parquet")
    words = [" ".join(f"w{(i * 7919 + j * 104729) % 100003}" for j in range(40)) for i in range(200)]
    pq.write_table(pa.table({"prompt": words}), path, compression="snappy", use_dictionary=False)
    corrupt_pages(path)
    check_data_files(DataConfig(train_files=[path]))  # the footer is intact
    with pytest.raises(DataError, match=r"pages\.parquet: row group 0 cannot be read .*looks corrupt"):
        build_dataset(DataConfig(train_files=[path]), tiny_tokenizer, "train", DistInfo())


def test_missing_prompt_column_lists_columns_and_rows(tmp_path, good):
    with pytest.raises(DataError) as err:
        check_data_files(DataConfig(train_files=[good], prompt_key="question"))
    msg = str(err.value)
    assert "column 'question' (data.prompt_key) is missing in 1 file(s)" in msg
    assert "part-00000.parquet: 10 rows, 4 columns: prompt, id, ground_truth, data_source" in msg
    jl = tmp_path / "a.jsonl"
    jl.write_text(json.dumps({"text": "a b"}) + "\n")
    with pytest.raises(DataError, match=r"a\.jsonl: 1 rows, 1 columns: text"):
        check_data_files(DataConfig(train_files=[str(jl)]))


def test_bad_jsonl_line(tmp_path):
    jl = tmp_path / "b.jsonl"
    jl.write_text("\n{oops\n")
    with pytest.raises(DataError, match=r"b\.jsonl line 2 is not valid JSON"):
        check_data_files(DataConfig(train_files=[str(jl)]))


def test_empty_dataset(tmp_path, tiny_tokenizer):
    paths = write_parquet_shards(str(tmp_path / "e"), [0, 0])
    with pytest.raises(DataError, match=r"the dataset is empty: 2 file\(s\) hold 0 rows"):
        check_data_files(DataConfig(train_files=paths))
    jl = tmp_path / "empty.jsonl"
    jl.write_text("\n")
    with pytest.raises(DataError, match=r"empty: 1 file\(s\) hold 0 rows \(.*empty\.jsonl\)"):
        build_dataset(DataConfig(train_files=[str(jl)]), tiny_tokenizer, "train", DistInfo())


def test_every_prompt_over_the_limit(tmp_path, tiny_tokenizer):
    paths = write_parquet_shards(str(tmp_path / "long"), [5, 7], words=(6, 9))
    with pytest.raises(DataError) as err:
        build_dataset(DataConfig(train_files=paths, max_prompt_length=3), tiny_tokenizer, "train", DistInfo())
    msg = str(err.value)
    assert "every prompt is longer than data.max_prompt_length=3" in msg
    assert "column 'prompt': 12 of 12 rows dropped" in msg
    assert "part-00001.parquet: 7 of 7 rows over the limit" in msg


def test_unreadable_format_is_left_to_plugins(tmp_path, tiny_tokenizer):
    txt = tmp_path / "prompts.txt"
    txt.write_text("a b\n")
    check_data_files(DataConfig(train_files=[str(txt)]))  # exists: a plugin may read it
    with pytest.raises(DataError, match=r"reads local \.parquet and \.jsonl files; cannot read .*prompts\.txt"):
        build_dataset(DataConfig(train_files=[str(txt)]), tiny_tokenizer, "train", DistInfo())


def test_cli_validate_fails_before_loading_a_model(tmp_path):
    pytest.importorskip("rlcore.trainer.checkpoint")
    from rlcore.testing import run_cli

    code, _, err = run_cli(["validate", f"data.train_files=[{tmp_path}/none.parquet]",
                            "actor.model_path=/nonexistent/model", f"trainer.output_dir={tmp_path}/run"])
    assert code == 2 and "none.parquet" in err and "data.train_files" in err


def test_prompts_without_tokens_are_a_clear_error(tmp_path, tiny_tokenizer):
    path = str(tmp_path / "blank.parquet")
    pq.write_table(pa.table({"prompt": ["a b", "", "c"]}), path)
    with pytest.raises(DataError, match=r"blank\.parquet.*1 of 3 prompt\(s\) give no tokens \(first at row 1\)"):
        build_dataset(DataConfig(train_files=[path]), tiny_tokenizer, "train", DistInfo())
