"""Rows as read from a shard: numpy columns that the reader, the loader and the holdout share.

A history is kept as offsets + values (row i's items are ``values[offsets[i]:offsets[i+1]]``),
the layout of both the Parquet ``history`` column and the model's jagged input, so cutting,
joining and batching rows never loops over them one by one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields

import numpy as np
import torch

from trainer.data.batch import Batch


@dataclass
class Histories:
    """Every row's item history, jagged: row i's items are ``values[offsets[i]:offsets[i+1]]``.
    The offset arithmetic of cutting, slicing and joining rows lives here, once."""

    offsets: np.ndarray
    values: np.ndarray

    @staticmethod
    def empty(n: int) -> Histories:
        """``n`` rows without a history (a source that has none)."""
        return Histories(np.zeros(n + 1, np.int64), np.zeros(0, np.int64))

    def take(self, idx: np.ndarray, max_len: int | None = None) -> tuple[Histories, int]:
        """Histories of rows ``idx``, cut to their last ``max_len`` items; also returns how
        many were cut."""
        lengths = np.diff(self.offsets)[idx]
        ends = self.offsets[idx + 1]
        cut = 0
        if max_len is not None:
            cut = int((lengths > max_len).sum())
            lengths = np.minimum(lengths, max_len)
        offsets = np.zeros(idx.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        gather = np.repeat(ends - lengths - offsets[:-1], lengths) + np.arange(offsets[-1])
        return Histories(offsets, self.values[gather]), cut

    def slice(self, a: int, b: int) -> Histories:
        o = self.offsets[a : b + 1]
        return Histories(o - o[0], self.values[o[0] : o[-1]])

    @staticmethod
    def concat(parts: list[Histories]) -> Histories:
        shifts = np.cumsum([0] + [int(p.offsets[-1]) for p in parts[:-1]])
        offsets = np.concatenate(
            [np.zeros(1, np.int64)]
            + [p.offsets[1:] + s for p, s in zip(parts, shifts, strict=True)]
        )
        return Histories(offsets, np.concatenate([p.values for p in parts]))


@dataclass
class Rows:
    """Validated rows as numpy columns; ``pos`` is each row's position in its shard's order."""

    label: np.ndarray
    dense: np.ndarray
    cat: np.ndarray
    item: np.ndarray
    history: Histories
    pos: np.ndarray

    def __len__(self) -> int:
        return int(self.label.shape[0])

    def take(self, idx: np.ndarray, max_len: int | None = None) -> tuple[Rows, int]:
        """Rows ``idx``, histories cut to their last ``max_len`` items; also returns how many
        histories were cut."""
        history, cut = self.history.take(idx, max_len)
        return self._rows(lambda col: col[idx], history), cut

    def slice(self, a: int, b: int) -> Rows:
        return self._rows(lambda col: col[a:b], self.history.slice(a, b))

    def _rows(self, pick: Callable[[np.ndarray], np.ndarray], history: Histories) -> Rows:
        """Rows with ``pick`` applied to every column but the history, and ``history``."""
        cols = {f.name: pick(getattr(self, f.name)) for f in fields(self) if f.name != "history"}
        return Rows(history=history, **cols)

    @staticmethod
    def concat(parts: list[Rows]) -> Rows:
        if len(parts) == 1:
            return parts[0]
        cols = {
            f.name: np.concatenate([getattr(p, f.name) for p in parts])
            for f in fields(Rows)
            if f.name != "history"
        }
        return Rows(history=Histories.concat([p.history for p in parts]), **cols)

    def to_batch(self) -> Batch:
        t = lambda a, dtype: torch.from_numpy(np.ascontiguousarray(a, dtype=dtype))
        return Batch(
            dense=t(self.dense, np.float32),
            cat=t(self.cat, np.int64),
            item=t(self.item, np.int64),
            history_values=t(self.history.values, np.int64),
            history_offsets=t(self.history.offsets, np.int64),
            labels=t(self.label, np.float32),
        )


def rebatch(parts: Iterable[Rows], size: int) -> Iterator[Rows]:
    """Pieces of any length -> rows of exactly ``size``, the last one shorter when the pieces
    run out. Lazy: a piece is read only when the rows before it are handed out, so a reader's
    counts are up to date when a batch is taken."""
    buf: Rows | None = None
    for rows in parts:
        buf = rows if buf is None else Rows.concat([buf, rows])
        i = 0
        while len(buf) - i >= size:
            yield buf.slice(i, i + size)
            i += size
        buf = buf.slice(i, len(buf))
    if buf is not None and len(buf):
        yield buf
