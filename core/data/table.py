"""Reading parquet/jsonl into one tokenized, filtered Arrow table, in parallel, written once to the cache.

Work is split into units (a parquet row group, or a whole jsonl file). Each unit is read with pyarrow,
its prompts rendered and tokenized, the length policy applied, and the result (the original columns,
the prompt as text, plus ``input_ids``) appended to an Arrow IPC file. Units run in a process pool
when ``data.preprocess_workers > 1``; results are written in input order, so the table does not depend
on the number of workers.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import pyarrow as pa

from rlcore.config.schema import DataConfig
from rlcore.data.collate import LengthStats, apply_length_policy, encode_prompts
from rlcore.data.files import FileInfo
from rlcore.data.schema import check_utf8, conform, unify
from rlcore.errors import DataError

log = logging.getLogger(__name__)

#: Rows tokenized at once inside a unit.
READ_BATCH_ROWS = 4096


@dataclass(frozen=True)
class Unit:
    """One piece of work: a parquet row group, or a jsonl file (``row_group`` None)."""

    file_index: int
    path: str
    format: str
    row_group: Optional[int] = None
    #: Row of the file where the unit starts (row numbers in errors count from the file's first row).
    first_row: int = 0


def plan_units(infos: Sequence[FileInfo]) -> list[Unit]:
    import pyarrow.parquet as pq

    units: list[Unit] = []
    for i, info in enumerate(infos):
        if info.format == "parquet":
            meta = pq.read_metadata(info.path)
            start = 0
            for rg in range(meta.num_row_groups):
                units.append(Unit(i, info.path, "parquet", rg, start))
                start += meta.row_group(rg).num_rows
        else:
            units.append(Unit(i, info.path, "jsonl"))
    return units


@contextmanager
def unreadable_parquet(path: str, row_group: Optional[int]) -> Iterator[None]:
    """Turn a failure to decode ``path`` (corrupt pages, bad compression) into a :class:`DataError`
    that names the file and row group; the footer was read when the file was first checked."""
    try:
        yield
    except (OSError, pa.ArrowException) as err:
        raise DataError(f"{path}: row group {row_group} cannot be read ({type(err).__name__}: {err}); the file "
                        "looks corrupt: write it again or leave it out of the data files") from err


def read_unit(unit: Unit) -> Iterator[tuple[int, pa.Table]]:
    """The raw rows of a unit, a batch at a time, each with the file row it starts at."""
    if unit.format == "parquet":
        import pyarrow.parquet as pq

        with unreadable_parquet(unit.path, unit.row_group):
            pf = pq.ParquetFile(unit.path)
            start = unit.first_row
            for batch in pf.iter_batches(batch_size=READ_BATCH_ROWS, row_groups=[unit.row_group]):
                yield start, pa.Table.from_batches([batch])
                start += batch.num_rows
        return
    import pyarrow.json as pj

    try:
        table = pj.read_json(unit.path)
    except pa.ArrowInvalid as err:
        raise DataError(f"{unit.path}: cannot parse as JSON lines: {err}") from err
    for start in range(0, table.num_rows, READ_BATCH_ROWS):
        yield start, table.slice(start, READ_BATCH_ROWS)


def process_table(table: pa.Table, tokenizer: Any, config: DataConfig, where: str,
                  first_row: int = 0) -> tuple[pa.Table, LengthStats]:
    """Tokenize the prompt column of ``table`` and apply the length policy.

    :param first_row: the file row of the table's first row (named in errors).
    :returns: the kept rows with the prompt as text and an ``input_ids`` column, and the counts.
    """
    key = config.prompt_key
    if key not in table.column_names:
        raise DataError(f"{where}: column '{key}' (data.prompt_key) is missing; "
                        f"columns: {', '.join(table.column_names)}")
    check_utf8(table, where, first_row)
    texts, ids = encode_prompts(table.column(key).to_pylist(), tokenizer, f"{where} column '{key}'", first_row)
    keep, ids, stats = apply_length_policy(ids, config, f"{where} column '{key}'", first_row=first_row)
    if len(keep) != table.num_rows:
        table = table.take(pa.array(keep, type=pa.int64()))
        texts = [texts[i] for i in keep]
    table = table.drop_columns([c for c in (key, "input_ids") if c in table.column_names])
    table = table.append_column(key, pa.array(texts, type=pa.large_string()))
    table = table.append_column("input_ids", pa.array(ids, type=pa.list_(pa.int32())))
    return table, stats


def run_unit(unit: Unit, tokenizer: Any, config: DataConfig) -> tuple[Unit, list[pa.Table], LengthStats]:
    stats = LengthStats()
    parts = []
    for first_row, raw in read_unit(unit):
        table, s = process_table(raw, tokenizer, config, unit.path, first_row)
        stats.add(s)
        if table.num_rows:
            parts.append(table)
    return unit, parts, stats


# Process-pool plumbing: the tokenizer and config reach workers once, through the initializer.
_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer: Any, config: DataConfig) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _WORKER.update(tokenizer=tokenizer, config=config)


def _run_in_worker(unit: Unit) -> tuple[Unit, list[pa.Table], LengthStats]:
    return run_unit(unit, _WORKER["tokenizer"], _WORKER["config"])


def _pool_context() -> Any:
    methods = mp.get_all_start_methods()
    return mp.get_context("fork" if "fork" in methods else "spawn")


def iter_processed(units: Sequence[Unit], tokenizer: Any, config: DataConfig,
                   workers: int) -> Iterator[tuple[Unit, list[pa.Table], LengthStats]]:
    """Process units in order, in ``workers`` processes when more than one."""
    workers = max(1, min(int(workers), len(units)))
    if workers == 1:
        for u in units:
            yield run_unit(u, tokenizer, config)
        return
    with _pool_context().Pool(workers, initializer=_init_worker, initargs=(tokenizer, config)) as pool:
        yield from pool.imap(_run_in_worker, units, chunksize=1)


class TableSink:
    """Collects processed tables in memory, or streams them to an Arrow IPC file, under one schema.

    Tables of later files join the schema without loss (:func:`rlcore.data.schema.unify`): a column
    a file lacks is null there, types widen; a conflict is an error naming both files. When a later
    file widens the schema, what was written so far is converted to it (once per change).
    """

    def __init__(self, path: Optional[str]):
        self.path = path
        self.parts: list[pa.Table] = []
        self.schema: Optional[pa.Schema] = None
        self._where = ""  # the first file, named in schema conflicts
        self._writer: Any = None
        self._file: Any = None

    def _open(self, schema: pa.Schema) -> None:
        self._file = pa.OSFile(self.path, "wb")
        self._writer = pa.ipc.new_file(self._file, schema)

    def write(self, table: pa.Table, where: str) -> None:
        if self.schema is None:
            self.schema, self._where = table.schema.remove_metadata(), where
            if self.path:
                self._open(self.schema)
        elif table.schema.remove_metadata() != self.schema:
            wider = unify(self.schema, self._where, table.schema.remove_metadata(), where)
            if wider != self.schema:
                self._widen(wider)
        table = conform(table, self.schema)
        if self._writer is not None:
            self._writer.write_table(table)
        else:
            self.parts.append(table)

    def _widen(self, schema: pa.Schema) -> None:
        """Convert what was collected or written so far to ``schema``."""
        self.schema = schema
        if not self.path:
            self.parts = [conform(t, schema) for t in self.parts]
            return
        self._writer.close()
        self._file.close()
        old = self.path + ".narrow"
        os.replace(self.path, old)
        self._open(schema)
        with pa.memory_map(old, "r") as source:
            reader = pa.ipc.open_file(source)
            for i in range(reader.num_record_batches):
                self._writer.write_table(conform(reader.get_batch(i), schema))
        os.remove(old)

    def finish(self) -> Optional[pa.Table]:
        """Close the file; return the in-memory table (None when writing a file)."""
        if self.path:
            if self._writer is None:  # nothing was kept: an empty file; the caller raises
                self._open(pa.schema([]))
            self._writer.close()
            self._file.close()
            return None
        return pa.concat_tables(self.parts) if self.parts else pa.table({})

    def abort(self) -> None:
        for closer in (self._writer, self._file):
            try:
                if closer is not None:
                    closer.close()
            except Exception:  # noqa: BLE001 - already failing; the temp file is removed by the caller
                pass


def open_arrow(path: str) -> pa.Table:
    """Memory-map an Arrow IPC file written by :class:`TableSink` (no copy, no parsing)."""
    source = pa.memory_map(path, "r")
    return pa.ipc.open_file(source).read_all()
