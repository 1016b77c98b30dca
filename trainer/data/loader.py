"""Streaming, sharded, exactly resumable training data: Parquet or Criteo TSV shards -> Batch.

Shard i of ``{url}/train/`` goes to rank i % world_size. Each rank cycles through its shards
forever; with ``data.shuffle`` the shard order is permuted per (seed, epoch, rank) and the rows
of a shard per (seed, epoch, shard, window), where a window is a few consecutive row groups
(Parquet, in a permuted order) or lines (TSV) of about ``window_rows`` rows, so one window
is in memory at a time. The position is three integers, (epoch, shard_pos, row_offset):
row_offset counts the shard's rows, in permuted order, up to and including the last row
handed out, so a new loader given ``state_dict()`` continues at exactly the next unseen row.

Rows are validated (label 0/1, finite dense, ids in range); bad rows are counted in
``stats``, logged (rate-limited) with the shard URL and row, and skipped, unless more than
``data.max_bad_row_fraction`` of a file's rows read so far are bad: then DataError names the
file and one bad row (a broken export, not noise; the trainer exits BAD_DATA). Nothing here
touches torch.distributed: rank and world size are plain arguments.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from infra import storage
from infra.settings import DataConfig
from trainer.data import criteo
from trainer.data.batch import Batch

log = logging.getLogger(__name__)

STATE_VERSION = 1
_LOGGED_BAD_ROWS = 10


class DataError(ValueError):
    """Unusable training data; the message names the file (and field) at fault."""


@dataclass
class _Rows:
    """Validated rows as numpy columns; ``pos`` is each row's position in its shard's order."""

    label: np.ndarray
    dense: np.ndarray
    cat: np.ndarray
    item: np.ndarray
    offsets: np.ndarray
    values: np.ndarray
    pos: np.ndarray

    def __len__(self) -> int:
        return int(self.label.shape[0])

    def take(self, idx: np.ndarray, max_len: int | None = None) -> tuple[_Rows, int]:
        """Rows ``idx``, histories cut to their last ``max_len`` items; also returns how many
        histories were cut."""
        lengths = np.diff(self.offsets)[idx]
        ends = self.offsets[idx + 1]
        cut = 0
        if max_len is not None:
            cut = int((lengths > max_len).sum())
            lengths = np.minimum(lengths, max_len)
        offsets = np.zeros(idx.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        gather = np.repeat(ends - lengths - offsets[:-1], lengths) + np.arange(offsets[-1])
        rows = _Rows(
            self.label[idx],
            self.dense[idx],
            self.cat[idx],
            self.item[idx],
            offsets,
            self.values[gather],
            self.pos[idx],
        )
        return rows, cut

    def slice(self, a: int, b: int) -> _Rows:
        o = self.offsets[a : b + 1]
        return _Rows(
            self.label[a:b],
            self.dense[a:b],
            self.cat[a:b],
            self.item[a:b],
            o - o[0],
            self.values[o[0] : o[-1]],
            self.pos[a:b],
        )

    @staticmethod
    def concat(parts: list[_Rows]) -> _Rows:
        if len(parts) == 1:
            return parts[0]
        shifts = np.cumsum([0] + [int(p.offsets[-1]) for p in parts[:-1]])
        offsets = np.concatenate(
            [np.zeros(1, np.int64)]
            + [p.offsets[1:] + s for p, s in zip(parts, shifts, strict=True)]
        )
        cols = {
            f.name: np.concatenate([getattr(p, f.name) for p in parts])
            for f in fields(_Rows)
            if f.name != "offsets"
        }
        return _Rows(offsets=offsets, **cols)

    def to_batch(self) -> Batch:
        t = lambda a, dtype: torch.from_numpy(np.ascontiguousarray(a, dtype=dtype))
        return Batch(
            dense=t(self.dense, np.float32),
            cat=t(self.cat, np.int64),
            item=t(self.item, np.int64),
            history_values=t(self.values, np.int64),
            history_offsets=t(self.offsets, np.int64),
            labels=t(self.label, np.float32),
        )


def _bits(buf: pa.Buffer, offset: int, n: int) -> np.ndarray:
    return np.unpackbits(np.frombuffer(buf, np.uint8), bitorder="little")[offset : offset + n]


def _np(arr: pa.Array, fill: float | int = 0) -> np.ndarray:
    """A numeric or boolean Arrow array as numpy, nulls replaced by ``fill``. (pyarrow's
    to_numpy and fill_null import pandas, seconds of start-up time.)"""
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


def _decode(table: pa.Table, data: DataConfig, url: str) -> tuple[_Rows, dict[str, np.ndarray]]:
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
        "label not 0/1": ~((label == 0) | (label == 1)),
        "dense not finite": ~(dense_ok & np.isfinite(dense).all(axis=1)),
        "cat id out of range": ~(cat_ok & ((cat >= 0) & (cat < vocab)).all(axis=1)),
        "item out of range": (item < 0) | (item >= data.item_vocab_size),
        "history id out of range": bad_hist,
    }
    rows = _Rows(
        label.astype(np.float32), dense, cat, item, offsets, values, np.zeros(n, dtype=np.int64)
    )
    return rows, checks


class _BadRowLog:
    """Logs the first few bad rows one by one, then one count per shard."""

    def __init__(self) -> None:
        self.logged = 0
        self.more: dict[str, int] = {}

    def budget(self) -> int:
        return max(0, _LOGGED_BAD_ROWS - self.logged)

    def report(self, url: str, described: list[str], total: int) -> None:
        for line in described:
            log.warning("data: skipping bad row %s", line)
        self.logged += len(described)
        if total > len(described):
            self.more[url] = self.more.get(url, 0) + total - len(described)

    def end_shard(self, url: str) -> None:
        if n := self.more.pop(url, 0):
            log.warning("data: %d more bad rows skipped in %s (not logged one by one)", n, url)


@dataclass
class _Window:
    """A piece of a shard as read: candidate rows and the order to hand them out in."""

    rows: _Rows
    checks: dict[str, np.ndarray]  # name -> mask of rows failing that check
    sel: np.ndarray  # indices into rows, in hand-out order
    pos: np.ndarray  # shard position of each sel entry
    where: np.ndarray  # per row: its row (Parquet, 0-based) or line (TSV, 1-based) in the file
    unit: str  # "row" or "line"
    dropped: int  # lines dropped (and logged) before decoding: unparsable TSV
    raw: int  # shard positions this window covers


def _rng(tag: int, *key: int) -> np.random.Generator:
    words = [tag, *key] + [0] * (4 - len(key))  # fixed length: no two keys share a seed
    return np.random.default_rng([k & 0xFFFF_FFFF_FFFF_FFFF for k in words])


class _ShardReader:
    """Reads shards window by window: validates, skips bad rows, cuts long histories.

    ``key`` = (seed, epoch, shard index) shuffles the shard; None keeps the file order."""

    def __init__(self, data: DataConfig, window_rows: int) -> None:
        self.data, self.window_rows = data, window_rows
        self.badlog = _BadRowLog()
        self.warned_truncation = False
        self.parser = criteo.LineParser(data) if data.format == "criteo" else None

    def read(
        self, url: str, key: tuple[int, ...] | None, start: int, counts: dict[str, int]
    ) -> Iterator[_Rows]:
        """Good rows from shard position ``start`` on; adds to counts['bad_rows'] and
        counts['truncated_histories']. Raises DataError when a whole shard is bad, or more
        than ``data.max_bad_row_fraction`` of its rows read so far."""
        raw = good = bad_total = 0
        example = ""
        source = self._criteo if self.parser else self._parquet
        for win in source(url, key, start):
            bad = np.zeros(len(win.rows), dtype=bool)
            for mask in win.checks.values():
                bad |= mask
            bad_sel = win.sel[bad[win.sel]]
            described = [
                f"{url} {win.unit} {win.where[k]}: "
                + ", ".join(name for name, mask in win.checks.items() if mask[k])
                for k in bad_sel[: max(self.badlog.budget(), 0 if example else 1)]
            ]
            example = example or (described[0] if described else "")
            self.badlog.report(url, described[: self.badlog.budget()], bad_sel.size)
            bad_total += win.dropped + bad_sel.size
            self._check_fraction(url, bad_total, raw + win.raw, example)
            keep = ~bad[win.sel]
            rows, cut = win.rows.take(win.sel[keep], self.data.max_history_len)
            rows.pos = win.pos[keep]
            counts["bad_rows"] += win.dropped + bad_sel.size
            counts["truncated_histories"] += cut
            raw += win.raw
            good += len(rows)
            if cut and not self.warned_truncation:
                self.warned_truncation = True
                log.warning(
                    "data: histories longer than data.max_history_len=%d (first in %s): keeping "
                    "the most recent items; counted in stats['truncated_histories']",
                    self.data.max_history_len,
                    url,
                )
            yield rows
        self.badlog.end_shard(url)
        if start == 0 and raw and not good:
            raise DataError(f"{url}: all {raw} rows are malformed (see the warnings above)")
        if start == 0 and not raw:
            log.warning("data: shard %s holds no rows", url)

    def _check_fraction(self, url: str, bad: int, rows: int, example: str) -> None:
        limit = self.data.max_bad_row_fraction
        if rows and bad / rows > limit and bad < rows:  # all bad: said at the shard's end
            example = example.removeprefix(f"{url} ") or "an unparsable line (see the warnings)"
            raise DataError(
                f"{url}: {bad} of {rows} rows read are bad ({bad / rows:.1%}, more than "
                f"data.max_bad_row_fraction={limit:g}); for example {example}"
            )

    def _parquet(self, url: str, key: tuple[int, ...] | None, start: int) -> Iterator[_Window]:
        with storage.open_file(url, "rb") as fh:
            try:
                pf = pq.ParquetFile(fh)
            except (pa.ArrowException, OSError) as exc:
                raise DataError(f"{url}: not a readable Parquet file: {exc}") from exc
            sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)]
            first = np.cumsum([0] + sizes[:-1])
            order = _rng(1, *key).permutation(len(sizes)) if key else range(len(sizes))
            windows: list[list[int]] = [[]]
            for g in order:
                if sum(sizes[x] for x in windows[-1]) >= self.window_rows:
                    windows.append([])
                windows[-1].append(int(g))
            base = 0
            for w, groups in enumerate(windows):
                n = sum(sizes[g] for g in groups)
                if base + n <= start:
                    base += n
                    continue
                try:
                    table = pf.read_row_groups(groups)
                except pa.ArrowException as exc:
                    raise DataError(f"{url}: cannot read row groups {groups}: {exc}") from exc
                rows, checks = _decode(table, self.data, url)
                where = np.concatenate([np.arange(first[g], first[g] + sizes[g]) for g in groups])
                perm = _rng(2, *key, w).permutation(n) if key else np.arange(n)
                skip = max(0, start - base)
                sel = perm[skip:]
                pos = base + skip + np.arange(sel.size)
                yield _Window(rows, checks, sel, pos, where, "row", 0, sel.size)
                base += n

    def _criteo(self, url: str, key: tuple[int, ...] | None, start: int) -> Iterator[_Window]:
        assert self.parser is not None
        size = self.window_rows
        w0 = start // size
        for w, lines in enumerate(criteo.iter_line_chunks(url, size, w0 * size), start=w0):
            base = w * size
            perm = _rng(2, *key, w).permutation(len(lines)) if key else np.arange(len(lines))
            skip = max(0, start - base)
            sel = perm[skip:]
            parsed = self.parser.parse([lines[k] for k in sel], (sel + base + 1).tolist(), url)
            m = parsed.label.size
            zeros = np.zeros(m, dtype=np.int64)
            rows = _Rows(
                parsed.label,
                parsed.dense,
                parsed.cat,
                zeros,
                np.zeros(m + 1, np.int64),
                np.zeros(0, np.int64),
                zeros.copy(),
            )
            checks = {"label not 0/1": ~((rows.label == 0) | (rows.label == 1))}
            where = sel[parsed.index] + base + 1
            pos = base + skip + parsed.index
            yield _Window(rows, checks, np.arange(m), pos, where, "line", parsed.bad, sel.size)


def list_shards(data: DataConfig, split: str = "train") -> list[str]:
    """The URLs of a split's shards, sorted: ``{url}/{split}/*.parquet`` (or ``*.tsv``)."""
    ext = "tsv" if data.format == "criteo" else "parquet"
    pattern = storage.join(data.url, split, f"*.{ext}")
    found = storage.glob(pattern)
    if not found:
        raise DataError(f"no {data.format} shards match {pattern}")
    return found


def check_meta(data: DataConfig) -> dict[str, Any] | None:
    """Compare ``{url}/_meta.json`` (when present) with the config; DataError names a mismatch."""
    url = storage.join(data.url, "_meta.json")
    if not storage.exists(url):
        return None
    try:
        meta = json.loads(storage.read_text(url))
    except json.JSONDecodeError as exc:
        raise DataError(f"{url}: not valid JSON: {exc}") from exc
    expected = {
        "format": data.format,
        "num_dense": data.num_dense,
        "cat_vocab_sizes": list(data.cat_vocab_sizes),
        "item_vocab_size": data.item_vocab_size,
    }
    for name, want in expected.items():
        if name in meta and meta[name] != want:
            raise DataError(
                f"{url}: {name}={meta[name]!r} but the config has data.{name}={want!r}; "
                "the data was written for another schema"
            )
    return meta


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class TrainLoader:
    """Infinite iterator of training Batches for one rank; see the module docstring.

    ``stats`` counts rows and batches handed out, bad rows skipped and histories cut.
    ``prefetch`` > 0 reads and decodes that many batches ahead on a background thread; the
    state always describes the batches handed out, never the prefetched ones.
    """

    def __init__(
        self,
        data: DataConfig,
        rank: int,
        world_size: int,
        seed: int,
        prefetch: int = 2,
        window_rows: int = 65_536,
        balancer: Callable[[Batch, int], Batch] | None = None,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}"
            )
        if data.format == "criteo":
            criteo.check_config(data)
        check_meta(data)
        self.data, self.rank, self.world_size, self.seed = data, rank, world_size, seed
        self.prefetch, self.window_rows = prefetch, window_rows
        self.balancer = balancer  # re-deals each batch's rows across ranks (data/balance.py)
        self.all_shards = list_shards(data, "train")
        self.shards = self.all_shards[rank::world_size]
        if not self.shards:
            raise DataError(
                f"rank {rank} of {world_size} gets no shard: only {len(self.all_shards)} shards "
                f"under {storage.join(data.url, 'train')}; write at least world_size shards"
            )
        self.stats = {"rows": 0, "batches": 0, "bad_rows": 0, "truncated_histories": 0}
        self._state = {"epoch": 0, "shard_pos": 0, "row_offset": 0}
        self._gen: Iterator[Any] | None = None
        self._queue: queue.Queue[Any] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # --- position -----------------------------------------------------------------------
    def _identity(self) -> dict[str, int]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "num_shards": len(self.all_shards),
            "seed": self.seed,
            "shuffle": int(self.data.shuffle),
            "window_rows": self.window_rows,
        }

    def state_dict(self) -> dict[str, int]:
        """The position after the last batch handed out (small, JSON-able ints)."""
        return {"version": STATE_VERSION, **self._state, **self._identity()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the next row unseen by the loader that made ``state``."""
        if state.get("version", STATE_VERSION) != STATE_VERSION:
            raise DataError(
                f"data loader state version {state.get('version')!r} is not "
                f"{STATE_VERSION}; cannot resume from it"
            )
        for key, mine in self._identity().items():
            if key in state and state[key] != mine:
                raise DataError(
                    f"data loader state was saved with {key}={state[key]!r}, this loader has "
                    f"{key}={mine!r}: the saved position does not apply to this stream"
                )
        pos = {}
        for key in ("epoch", "shard_pos", "row_offset"):
            value = state.get(key)
            if not isinstance(value, int) or value < 0:
                raise DataError(f"data loader state: {key} must be an int >= 0, got {value!r}")
            pos[key] = value
        if pos["shard_pos"] >= len(self.shards):
            raise DataError(
                f"data loader state: shard_pos={pos['shard_pos']} but this rank has "
                f"{len(self.shards)} shards"
            )
        self.close()
        self._state = pos

    # --- reading ------------------------------------------------------------------------
    def _shard_order(self, epoch: int) -> list[int]:
        if not self.data.shuffle:
            return list(range(len(self.shards)))
        return [int(i) for i in _rng(3, self.seed, epoch, self.rank).permutation(len(self.shards))]

    def _produce(self, state: dict[str, int]) -> Iterator[tuple[Batch, dict[str, int], dict]]:
        epoch, shard_pos, offset = state["epoch"], state["shard_pos"], state["row_offset"]
        reader = _ShardReader(self.data, self.window_rows)
        pending = {"bad_rows": 0, "truncated_histories": 0}
        bs = self.data.batch_size
        while True:
            whole_epoch, emitted = shard_pos == 0 and offset == 0, False
            order = self._shard_order(epoch)
            for sp in range(shard_pos, len(order)):
                url = self.shards[order[sp]]
                key = (self.seed, epoch, self.rank + order[sp] * self.world_size)
                buf: _Rows | None = None
                for rows in reader.read(url, key if self.data.shuffle else None, offset, pending):
                    buf = rows if buf is None else _Rows.concat([buf, rows])
                    i = 0
                    while len(buf) - i >= bs:
                        batch = buf.slice(i, i + bs)
                        i += bs
                        yield self._item(batch, epoch, sp, pending)
                        emitted = True
                    buf = buf.slice(i, len(buf))
                if buf is not None and len(buf):
                    yield self._item(buf, epoch, sp, pending)
                    emitted = True
                offset = 0
            if whole_epoch and not emitted:
                raise DataError(f"rank {self.rank}: no usable rows in its shards {self.shards}")
            epoch, shard_pos = epoch + 1, 0

    @staticmethod
    def _item(rows: _Rows, epoch: int, sp: int, pending: dict[str, int]) -> tuple[Any, ...]:
        deltas = dict(pending)
        pending.update(bad_rows=0, truncated_histories=0)
        state = {"epoch": epoch, "shard_pos": sp, "row_offset": int(rows.pos[-1]) + 1}
        return rows.to_batch(), state, deltas

    def _start(self) -> None:
        gen = self._produce(dict(self._state))
        if self.prefetch <= 0:
            self._gen = gen
            return
        q: queue.Queue[Any] = queue.Queue(maxsize=self.prefetch)
        stop = self._stop = threading.Event()

        def put(item: Any) -> bool:
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def run() -> None:
            try:
                for item in gen:
                    if not put(item):
                        return
            except BaseException as exc:  # handed to the consumer, raised there
                put(_Failure(exc))
            finally:
                gen.close()

        self._queue = q
        self._thread = threading.Thread(target=run, name=f"data-prefetch-{self.rank}", daemon=True)
        self._thread.start()

    def _next_item(self) -> Any:
        if self._gen is not None:
            return next(self._gen)
        assert self._queue is not None and self._thread is not None
        while True:
            try:
                return self._queue.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("data prefetch thread stopped unexpectedly") from None

    def __iter__(self) -> TrainLoader:
        return self

    def __next__(self) -> Batch:
        if self._gen is None and self._thread is None:
            self._start()
        try:
            item = self._next_item()
        except BaseException:
            self.close()
            raise
        if isinstance(item, _Failure):
            self.close()
            raise item.exc
        batch, state, deltas = item
        self._state = state
        self.stats["rows"] += len(batch)
        self.stats["batches"] += 1
        for key, value in deltas.items():
            self.stats[key] += value
        if self.balancer is not None:  # on this thread: one exchange per batch taken
            batch = self.balancer(batch, self.stats["batches"])
        return batch

    def close(self) -> None:
        """Stop the prefetch thread (the next batch restarts reading from the state)."""
        self._stop.set()
        if self._thread is not None:
            while self._thread.is_alive():
                assert self._queue is not None
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    self._thread.join(timeout=0.05)
        if self._gen is not None:
            self._gen.close()
        self._gen = self._thread = self._queue = None

    def __enter__(self) -> TrainLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _sequential(data: DataConfig, split: str, max_rows: int | None) -> Iterator[_Rows]:
    """Good rows of a split in file order (no shuffling), at most ``max_rows``."""
    if data.format == "criteo":
        criteo.check_config(data)
    check_meta(data)
    reader = _ShardReader(data, 65_536)
    counts = {"bad_rows": 0, "truncated_histories": 0}
    got = 0
    for url in list_shards(data, split):
        for rows in reader.read(url, None, 0, counts):
            if max_rows is not None and got + len(rows) >= max_rows:
                yield rows.slice(0, max_rows - got)
                return
            got += len(rows)
            yield rows


def stream_batches(
    data: DataConfig,
    split: str = "holdout",
    batch_size: int | None = None,
    max_rows: int | None = None,
) -> Iterator[Batch]:
    """Batches of a whole split in file order, single process (no process group needed);
    batches span shard boundaries, only the last may be short."""
    bs = batch_size or data.eval_batch_size
    buf: _Rows | None = None
    for rows in _sequential(data, split, max_rows):
        buf = rows if buf is None else _Rows.concat([buf, rows])
        i = 0
        while len(buf) - i >= bs:
            yield buf.slice(i, i + bs).to_batch()
            i += bs
        buf = buf.slice(i, len(buf))
    if buf is not None and len(buf):
        yield buf.to_batch()


def holdout_batches(
    data: DataConfig, rank: int, world_size: int, rows: int, batch_size: int
) -> list[Batch]:
    """This rank's part of the first ``rows`` good holdout rows: rows rank::world_size, after
    trimming to a multiple of world_size, so every rank gets the same number of batches."""
    parts = [p for p in _sequential(data, "holdout", rows) if len(p)]
    if not parts:
        raise DataError(f"no usable holdout rows under {storage.join(data.url, 'holdout')}")
    every = _Rows.concat(parts)
    n = len(every) // world_size * world_size
    if n == 0:
        raise DataError(f"{len(every)} holdout rows cannot be split over {world_size} ranks")
    if n < rows:
        log.info(
            "data: holdout has %d usable rows of the %d asked for; using %d", len(every), rows, n
        )
    mine, _ = every.take(np.arange(rank, n, world_size))
    return [
        mine.slice(i, min(i + batch_size, len(mine))).to_batch()
        for i in range(0, len(mine), batch_size)
    ]
