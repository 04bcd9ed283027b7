"""Finding input files and checking them cheaply, before any model loads.

Parquet files are checked from their footer only (schema and row counts); jsonl files line by line
(every line must be a JSON object in UTF-8). Formats the default provider does not read (``.txt`` …) are only checked to exist:
a plugin may read them.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Union

from rlcore.errors import DataError

PARQUET_SUFFIXES = (".parquet", ".pq")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
_GLOB_CHARS = set("*?[")


def file_format(path: str) -> Optional[str]:
    """``"parquet"``, ``"jsonl"`` or None (a format the default provider does not read)."""
    lower = path.lower()
    if lower.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if lower.endswith(JSONL_SUFFIXES):
        return "jsonl"
    return None


def is_remote(path: str) -> bool:
    return "://" in path


def as_list(spec: Union[str, Sequence[str], None]) -> list[str]:
    """A file spec (one path, a comma-free list, or None) as a list of strings."""
    if spec is None:
        return []
    if isinstance(spec, str):
        return [spec] if spec.strip() else []
    return [str(s) for s in spec if str(s).strip()]


def resolve_files(spec: Union[str, Sequence[str], None], key: str) -> list[str]:
    """Expand globs and check that every local file exists; keep the order given (globs sorted).

    :param key: the config key the files come from (``data.train_files``), named in errors.
    :raises DataError: a missing file, or a glob matching nothing.
    """
    out: list[str] = []
    missing: list[str] = []
    for item in as_list(spec):
        path = os.path.expanduser(item)
        if is_remote(path):
            out.append(path)
        elif _GLOB_CHARS & set(path):
            matches = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
            if not matches:
                missing.append(f"{item} (glob matched no file)")
            out.extend(matches)
        elif os.path.isfile(path):
            out.append(path)
        elif os.path.isdir(path):
            found = sorted(p for p in glob.glob(os.path.join(path, "*")) if file_format(p))
            if not found:
                missing.append(f"{item} (directory holds no .parquet/.jsonl file)")
            out.extend(found)
        else:
            missing.append(item)
    if missing:
        raise DataError(f"{key}: {len(missing)} of {len(as_list(spec))} input(s) not found: " + ", ".join(missing))
    return out


@dataclass(frozen=True)
class FileInfo:
    """What the footer (parquet) or the records (jsonl) say about one file."""

    path: str
    format: Optional[str]
    columns: tuple[str, ...] = ()
    #: Row count (-1 when unknown: a remote file, or a format the default provider does not read).
    num_rows: int = -1


def inspect_parquet(path: str, key: str) -> FileInfo:
    import pyarrow.parquet as pq

    try:
        meta = pq.read_metadata(path)
    except Exception as err:  # pyarrow raises ArrowInvalid / OSError for truncated or foreign files
        size = os.path.getsize(path) if os.path.exists(path) else -1
        raise DataError(f"{key}: cannot read the parquet footer of {path} ({size} bytes): "
                        f"{type(err).__name__}: {err}") from err
    names = tuple(meta.schema.to_arrow_schema().names)
    return FileInfo(path, "parquet", names, int(meta.num_rows))


def inspect_jsonl(path: str, key: str) -> FileInfo:
    """Read every line of a jsonl file: each must be UTF-8 text holding one JSON object (blank lines
    are skipped). Returns the columns of all records (in order of first appearance) and the count."""
    columns: dict[str, None] = {}
    rows = 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(f"{key}: {path} line {lineno} is not valid UTF-8 text ({err.reason} at byte "
                                f"{err.start}); re-encode the file as UTF-8") from None
            try:
                record = json.loads(text)
            except ValueError as err:
                raise DataError(f"{key}: {path} line {lineno} is not valid JSON: {err}") from err
            if not isinstance(record, dict):
                raise DataError(f"{key}: {path} line {lineno} holds a {type(record).__name__}, "
                                "expected one JSON object per line")
            columns.update(dict.fromkeys(record))
            rows += 1
    return FileInfo(path, "jsonl", tuple(columns), rows)


def inspect_file(path: str, key: str) -> FileInfo:
    fmt = file_format(path)
    if fmt == "parquet" and not is_remote(path):
        return inspect_parquet(path, key)
    if fmt == "jsonl" and not is_remote(path):
        return inspect_jsonl(path, key)
    return FileInfo(path, fmt)


def check_prompt_column(infos: Iterable[FileInfo], prompt_key: str, key: str) -> None:
    """Raise naming every file whose columns lack ``prompt_key`` (with the columns it has and its rows)."""
    bad = [i for i in infos if i.format and i.columns and prompt_key not in i.columns]
    bad += [i for i in infos if i.format == "jsonl" and not i.columns and i.num_rows != 0]
    if not bad:
        return
    lines = [f"{key}: column '{prompt_key}' (data.prompt_key) is missing in {len(bad)} file(s):"]
    for i in bad[:10]:
        rows = f"{i.num_rows} rows, " if i.num_rows >= 0 else ""
        lines.append(f"  {i.path}: {rows}{len(i.columns)} columns: {', '.join(i.columns[:20])}")
    if len(bad) > 10:
        lines.append(f"  … and {len(bad) - 10} more")
    raise DataError("\n".join(lines))


def check_not_empty(infos: Sequence[FileInfo], key: str) -> None:
    """Raise when every file is known to be empty (parquet footers with 0 rows, blank jsonl)."""
    if infos and all(i.num_rows == 0 for i in infos):
        names = ", ".join(i.path for i in infos[:5]) + (" …" if len(infos) > 5 else "")
        raise DataError(f"{key}: the dataset is empty: {len(infos)} file(s) hold 0 rows ({names})")


def check_files(spec: Union[str, Sequence[str], None], prompt_key: str, key: str,
                *, columns: bool = True) -> list[FileInfo]:
    """Resolve ``spec`` and check every file; return what was learned about each."""
    infos = [inspect_file(p, key) for p in resolve_files(spec, key)]
    if columns:
        check_prompt_column(infos, prompt_key, key)
        check_not_empty(infos, key)
    return infos
