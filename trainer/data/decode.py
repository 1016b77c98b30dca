"""Arrow tables -> validated rows: the column checks and the per-row checks of training data.

A column of the wrong type or shape is a broken export: DataError names the file and column.
A bad row (label not 0/1, dense not finite, an id out of range) is not: ``decode`` returns a
mask per failed check, and the shard reader skips, counts and reports those rows. Arrow's
own ``to_numpy`` and ``fill_null`` are avoided because they import pandas, which slows every
rank's start-up.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from infra.settings import DataConfig
from trainer.data.rows import Histories, Rows


class DataError(ValueError):
    """Unusable training data; the message names the file (and field) at fault."""


def bad_label(label: np.ndarray) -> np.ndarray:
    """The rows whose label is not a click (1) or no click (0): NaN included."""
    return ~((label == 0) | (label == 1))


def _bits(buf: pa.Buffer, offset: int, n: int) -> np.ndarray:
    return np.unpackbits(np.frombuffer(buf, np.uint8), bitorder="little")[offset : offset + n]


def _np(arr: pa.Array, fill: float | int = 0) -> np.ndarray:
    """A numeric or boolean Arrow array as numpy, nulls replaced by ``fill``."""
    n, t = len(arr), arr.type
    validity, data = arr.buffers()[:2]
    if n == 0:
        return np.zeros(0, bool if pa.types.is_boolean(t) else np.float64)
    if pa.types.is_boolean(t):
        out = _bits(data, arr.offset, n).astype(bool)
    else:
        kind = (
            "f"
            if pa.types.is_floating(t)
            else "i"
            if pa.types.is_signed_integer(t)
            else "u"
            if pa.types.is_unsigned_integer(t)
            else None
        )
        if kind is None:
            raise TypeError(f"expected a numeric array, got {t}")
        dtype = np.dtype(f"{kind}{t.bit_width // 8}")
        out = np.frombuffer(data, dtype, count=n, offset=arr.offset * dtype.itemsize)
    if arr.null_count:
        # A copy that can hold the fill (NaN in an integer column, -1 in an unsigned one).
        wider = np.float64 if isinstance(fill, float) else np.int64
        out = out.astype(wider if out.dtype.kind in "iub" else out.dtype)
        out[_bits(validity, arr.offset, n) == 0] = fill
    return out


def _numeric(arr: pa.Array, name: str, url: str, integer: bool) -> None:
    ok = pa.types.is_integer(arr.type) or (not integer and pa.types.is_floating(arr.type))
    if not ok:
        kind = "integers" if integer else "numbers"
        raise DataError(f"{url}: column {name!r} must hold {kind}, got {arr.type}")


def _list_column(table: pa.Table, name: str, url: str) -> pa.Array:
    if name not in table.column_names:
        raise DataError(f"{url}: missing column {name!r} (has {table.column_names})")
    return table.column(name).combine_chunks()


def _fixed_width(
    table: pa.Table, name: str, width: int, dtype: Any, fill: Any, url: str, field: str
) -> tuple[np.ndarray, np.ndarray]:
    """A list column as [n, width] numpy plus a mask of the rows that are non-null, of the
    right length and without null elements (the others are filled with ``fill``)."""
    arr = _list_column(table, name, url)
    fixed = pa.types.is_fixed_size_list(arr.type)
    if not (fixed or pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)):
        raise DataError(f"{url}: column {name!r} must be a list, got {arr.type}")
    if fixed and arr.type.list_size != width:
        raise DataError(f"{url}: column {name!r} has width {arr.type.list_size}, {field}={width}")
    n = len(arr)
    flat = arr.flatten()  # the values of the non-null rows, in order
    _numeric(flat, name, url, integer=np.issubdtype(dtype, np.integer))
    values = _np(flat, fill).astype(dtype, copy=False)
    if fixed and arr.null_count == 0 and flat.null_count == 0:
        return values.reshape(n, width), np.ones(n, dtype=bool)
    lengths = _np(pc.list_value_length(arr)).astype(np.int64)
    ok = _np(arr.is_valid()) & (lengths == width)
    if flat.null_count:
        ok[np.repeat(np.arange(n), lengths)[_np(flat.is_null())]] = False
    starts = np.cumsum(lengths) - lengths
    out = np.full((n, width), fill, dtype=dtype)
    out[ok] = values[starts[ok][:, None] + np.arange(width)]
    return out, ok


def decode(table: pa.Table, data: DataConfig, url: str) -> tuple[Rows, dict[str, np.ndarray]]:
    """Arrow rows -> numpy columns plus one 'bad' mask per failed check (for messages)."""
    n = table.num_rows
    label_arr = _list_column(table, "label", url)
    _numeric(label_arr, "label", url, integer=False)
    label = _np(label_arr.cast(pa.float64()), float("nan"))
    dense, dense_ok = _fixed_width(
        table, "dense", data.num_dense, np.float32, float("nan"), url, "data.num_dense"
    )
    num_cat = len(data.cat_vocab_sizes)
    cat, cat_ok = _fixed_width(
        table, "cat", num_cat, np.int64, -1, url, "len(data.cat_vocab_sizes)"
    )
    item_arr = _list_column(table, "item", url)
    _numeric(item_arr, "item", url, integer=True)
    item = _np(item_arr, -1).astype(np.int64)
    hist = _list_column(table, "history", url)
    if not (pa.types.is_list(hist.type) or pa.types.is_large_list(hist.type)):
        raise DataError(f"{url}: column 'history' must be a list of ids, got {hist.type}")
    lengths = _np(pc.list_value_length(hist)).astype(np.int64)
    flat = hist.flatten()  # a null history counts as empty
    _numeric(flat, "history", url, integer=True)
    values = _np(flat, -1).astype(np.int64)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])

    vocab = np.asarray(data.cat_vocab_sizes, dtype=np.int64)
    bad_hist = np.zeros(n, dtype=bool)
    bad_values = (values < 0) | (values >= data.item_vocab_size)
    bad_hist[np.repeat(np.arange(n), lengths)[bad_values]] = True
    checks = {
        "label not 0/1": bad_label(label),
        "dense not finite": ~(dense_ok & np.isfinite(dense).all(axis=1)),
        "cat id out of range": ~(cat_ok & ((cat >= 0) & (cat < vocab)).all(axis=1)),
        "item out of range": (item < 0) | (item >= data.item_vocab_size),
        "history id out of range": bad_hist,
    }
    history = Histories(offsets, values)
    rows = Rows(label.astype(np.float32), dense, cat, item, history, np.zeros(n, dtype=np.int64))
    return rows, checks
