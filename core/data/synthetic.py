"""Synthetic prompt corpora written as parquet shards (tests, benchmarks, examples).

Each row has ``prompt`` (words drawn from a vocabulary), ``id`` (unique across shards),
``ground_truth`` and ``data_source``. Nothing is downloaded.
"""

from __future__ import annotations

import os
import random
from typing import Optional, Sequence, Union

LETTERS = tuple("abcdefghijkl")


def synthetic_rows(n: int, *, first_id: int = 0, words: tuple[int, int] = (1, 12),
                   vocab: Sequence[str] = LETTERS, rng: Optional[random.Random] = None) -> list[dict]:
    """``n`` rows whose prompts have between ``words[0]`` and ``words[1]`` words."""
    rng = rng or random.Random(first_id)
    rows = []
    for i in range(n):
        prompt = " ".join(rng.choices(vocab, k=rng.randint(*words)))
        rows.append({"prompt": prompt, "id": first_id + i, "ground_truth": prompt.rsplit(" ", 1)[-1],
                     "data_source": "synthetic"})
    return rows


def write_parquet_shards(directory: str, rows_per_file: Union[int, Sequence[int]], *, num_files: int = 1,
                         row_group_size: int = 1024, words: tuple[int, int] = (1, 12),
                         vocab: Sequence[str] = LETTERS, seed: int = 0, prefix: str = "part",
                         compression: str = "snappy", first_id: int = 0) -> list[str]:
    """Write shards ``{prefix}-00000.parquet`` … to ``directory``; return their paths.

    :param rows_per_file: one count for every file, or a count per file (then ``num_files`` is ignored).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    counts = [rows_per_file] * num_files if isinstance(rows_per_file, int) else list(rows_per_file)
    os.makedirs(directory, exist_ok=True)
    rng = random.Random(seed)
    paths, next_id = [], first_id
    for f, n in enumerate(counts):
        path = os.path.join(directory, f"{prefix}-{f:05d}.parquet")
        with pq.ParquetWriter(path, _schema(pa), compression=compression) as writer:
            for start in range(0, n, row_group_size):
                k = min(row_group_size, n - start)
                rows = synthetic_rows(k, first_id=next_id, words=words, vocab=vocab, rng=rng)
                writer.write_table(pa.Table.from_pylist(rows, schema=_schema(pa)), row_group_size=row_group_size)
                next_id += k
            if n == 0:
                writer.write_table(pa.Table.from_pylist([], schema=_schema(pa)))
        paths.append(path)
    return paths


def _schema(pa):
    return pa.schema([("prompt", pa.string()), ("id", pa.int64()), ("ground_truth", pa.string()),
                      ("data_source", pa.string())])
