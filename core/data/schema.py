"""Columns of several input files combined without loss: one schema for all, or an error naming both files.

Files (parquet shards, jsonl files) may differ in their columns: a column missing from a file is
read as null there. Types must agree, up to changes that keep every value: a column of nulls takes
the other file's type, integers widen (``int32`` -> ``int64``, ``uint16`` -> ``int32`` ...), ``float32``
widens to ``float64``, ``string`` to ``large_string``, and list elements follow the same rules.
Any other difference (``"007"`` in one file and ``7`` in another, integers and floats) is a
:class:`~rlcore.errors.DataError` naming the column and both files: rlcore never casts a value
into another type behind the user's back.
"""

from __future__ import annotations

from typing import Any, Optional

import pyarrow as pa

from rlcore.errors import DataError

_INT_BITS = {pa.int8(): 8, pa.int16(): 16, pa.int32(): 32, pa.int64(): 64}
_UINT_BITS = {pa.uint8(): 8, pa.uint16(): 16, pa.uint32(): 32, pa.uint64(): 64}
_SIGNED = {8: pa.int8(), 16: pa.int16(), 32: pa.int32(), 64: pa.int64()}


def _int_union(a: pa.DataType, b: pa.DataType) -> Optional[pa.DataType]:
    """The narrowest integer type holding every value of ``a`` and ``b`` (None: there is none)."""
    if a in _INT_BITS and b in _INT_BITS:
        return _SIGNED[max(_INT_BITS[a], _INT_BITS[b])]
    if a in _UINT_BITS and b in _UINT_BITS:
        return a if _UINT_BITS[a] >= _UINT_BITS[b] else b
    signed, unsigned = (a, b) if a in _INT_BITS else (b, a)
    if signed in _INT_BITS and unsigned in _UINT_BITS:
        bits = max(_INT_BITS[signed], 2 * _UINT_BITS[unsigned])
        return _SIGNED.get(bits)
    return None


def merge_types(a: pa.DataType, b: pa.DataType) -> Optional[pa.DataType]:
    """The type both ``a`` and ``b`` cast to without loss, or None."""
    if a == b:
        return a
    if pa.types.is_null(a):
        return b
    if pa.types.is_null(b):
        return a
    if pa.types.is_integer(a) and pa.types.is_integer(b):
        return _int_union(a, b)
    if pa.types.is_floating(a) and pa.types.is_floating(b):
        return a if a.bit_width >= b.bit_width else b
    strings = (pa.string(), pa.large_string())
    if a in strings and b in strings:
        return pa.large_string()
    binaries = (pa.binary(), pa.large_binary())
    if a in binaries and b in binaries:
        return pa.large_binary()
    lists = (pa.types.is_list, pa.types.is_large_list)
    if any(f(a) for f in lists) and any(f(b) for f in lists):
        inner = merge_types(a.value_type, b.value_type)
        if inner is None:
            return None
        large = pa.types.is_large_list(a) or pa.types.is_large_list(b)
        return pa.large_list(inner) if large else pa.list_(inner)
    return None


def unify(schema: pa.Schema, where: str, other: pa.Schema, other_where: str, what: str = "column") -> pa.Schema:
    """The schema of ``schema`` (columns of ``where``) and ``other`` (of ``other_where``) together.

    Columns keep their first order; those only in ``other`` come after. Metadata is dropped.

    :raises DataError: a column whose types cannot be combined without loss, naming both files.
    """
    fields: list[pa.Field] = []
    theirs = {f.name: f for f in other}
    for f in schema:
        g = theirs.get(f.name)
        if g is None:
            fields.append(f.with_nullable(True))
            continue
        t = merge_types(f.type, g.type)
        if t is None:
            raise DataError(f"{what} '{f.name}' is {f.type} in {where} but {g.type} in {other_where}: rlcore does "
                            "not convert values between types (a string \"007\" would become 7); write the column "
                            "with one type in every file")
        fields.append(pa.field(f.name, t, nullable=True))
    known = set(schema.names)
    fields += [g.with_nullable(True) for g in other if g.name not in known]
    return pa.schema(fields)


def conform(table: Any, schema: pa.Schema) -> pa.Table:
    """``table`` (a Table or RecordBatch) with the columns of ``schema``: missing ones as nulls, the
    others cast (without loss: ``schema`` comes from :func:`unify`)."""
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    if table.schema.remove_metadata() == schema:
        return table
    columns = []
    for f in schema:
        if f.name in table.column_names:
            col = table.column(f.name)
            columns.append(col if col.type == f.type else col.cast(f.type))
        else:
            columns.append(pa.nulls(table.num_rows, type=f.type))
    return pa.Table.from_arrays(columns, schema=schema)


def check_utf8(table: Any, where: str, first_row: int = 0) -> None:
    """Raise naming the file, row and column of the first text value that is not valid UTF-8
    (pyarrow reads such bytes into a string column; Python could not decode them later)."""
    for name in table.column_names:
        col = table.column(name)
        if col.type not in (pa.string(), pa.large_string()):
            continue
        chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
        offset = 0
        for chunk in chunks:
            try:
                chunk.validate(full=True)
            except pa.ArrowInvalid:
                raw = chunk.view(pa.binary() if chunk.type == pa.string() else pa.large_binary()).to_pylist()
                for i, b in enumerate(raw):
                    if b is None:
                        continue
                    try:
                        b.decode("utf-8")
                    except UnicodeDecodeError as e:
                        raise DataError(f"{where}: row {first_row + offset + i}, column '{name}': the text is not "
                                        f"valid UTF-8 ({e.reason} at byte {e.start}: {b[max(0, e.start - 10):e.start + 10]!r}); "
                                        "re-encode the file as UTF-8") from None
                raise
            offset += len(chunk)
