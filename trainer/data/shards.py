"""Windowed, shuffled reading of one rank's shards, and the data set's layout on storage.

A split's shards are ``{url}/{split}/*.parquet`` (or ``*.tsv`` for Criteo); ``_meta.json``,
when present, must match the config's schema. A shard is read one window at a time, a few
consecutive row groups (Parquet, in a permuted order) or lines (TSV) of about ``window_rows``
rows, so one window is in memory at a time. With a shuffle key (seed, epoch, shard) the rows
of a window are handed out in a permuted order; a shard position counts rows in that order,
so reading can start again at any position.

Bad rows are counted, logged (rate-limited) with the shard URL and row, and skipped, unless
more than ``data.max_bad_row_fraction`` of a file's rows read so far are bad: then DataError
names the file and one bad row (a broken export, not noise; the trainer exits BAD_DATA).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from infra import data_layout, storage
from infra.settings import DataConfig
from trainer.data import criteo
from trainer.data.decode import DataError, bad_label, decode
from trainer.data.rows import Histories, Rows

log = logging.getLogger(__name__)

# Rows read, decoded and shuffled together: bounds a rank's memory whatever a shard's size.
# It also decides the order rows are handed out in, so a saved loader position only applies
# to a loader with the same window (the position records it).
WINDOW_ROWS = 65_536
_LOGGED_BAD_ROWS = 10


def list_shards(data: DataConfig, split: str = "train") -> list[str]:
    """The URLs of a split's shards, sorted (layout: infra/data_layout.py); DataError when
    there are none."""
    found = data_layout.list_shards(data, split)
    if not found:
        raise DataError(f"no {data.format} shards match {data_layout.shard_pattern(data, split)}")
    return found


def check_meta(data: DataConfig) -> dict[str, Any] | None:
    """Compare ``{url}/_meta.json`` (when present) with the config; DataError names a mismatch."""
    url = storage.join(data.url, data_layout.META)
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


def check_dataset(data: DataConfig) -> None:
    """DataError (or ValueError) before any row is read when the config cannot describe the
    data set: a Criteo schema of the wrong size, or a ``_meta.json`` written for another."""
    if data.format == "criteo":
        criteo.check_config(data)
    check_meta(data)


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

    rows: Rows
    checks: dict[str, np.ndarray]  # name -> mask of rows failing that check
    sel: np.ndarray  # indices into rows, in hand-out order
    pos: np.ndarray  # shard position of each sel entry
    where: np.ndarray  # per row: its row (Parquet, 0-based) or line (TSV, 1-based) in the file
    unit: str  # "row" or "line"
    dropped: int  # lines dropped (and logged) before decoding: unparsable TSV
    raw: int  # shard positions this window covers


def keyed_rng(tag: int, *key: int) -> np.random.Generator:
    """A generator seeded by a purpose ``tag`` and a key such as (seed, epoch, shard): the
    same key gives the same permutation in every process and on every resume."""
    words = [tag, *key] + [0] * (4 - len(key))  # fixed length: no two keys share a seed
    return np.random.default_rng([k & 0xFFFF_FFFF_FFFF_FFFF for k in words])


class ShardReader:
    """Reads shards window by window: validates, skips bad rows, cuts long histories.

    ``key`` = (seed, epoch, shard index) shuffles the shard; None keeps the file order."""

    def __init__(self, data: DataConfig, window_rows: int = WINDOW_ROWS) -> None:
        self.data, self.window_rows = data, window_rows
        self.badlog = _BadRowLog()
        self.warned_truncation = False
        self.parser = criteo.LineParser(data) if data.format == "criteo" else None

    def read(
        self, url: str, key: tuple[int, ...] | None, start: int, counts: dict[str, int]
    ) -> Iterator[Rows]:
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
            if cut and not self.warned_truncation:  # the configured cap at work: INFO
                self.warned_truncation = True
                log.info(
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
            order = keyed_rng(1, *key).permutation(len(sizes)) if key else range(len(sizes))
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
                rows, checks = decode(table, self.data, url)
                where = np.concatenate([np.arange(first[g], first[g] + sizes[g]) for g in groups])
                perm = keyed_rng(2, *key, w).permutation(n) if key else np.arange(n)
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
            perm = keyed_rng(2, *key, w).permutation(len(lines)) if key else np.arange(len(lines))
            skip = max(0, start - base)
            sel = perm[skip:]
            parsed = self.parser.parse([lines[k] for k in sel], (sel + base + 1).tolist(), url)
            m = parsed.label.size
            zeros = np.zeros(m, dtype=np.int64)
            rows = Rows(
                parsed.label, parsed.dense, parsed.cat, zeros, Histories.empty(m), zeros.copy()
            )
            checks = {"label not 0/1": bad_label(rows.label)}
            where = sel[parsed.index] + base + 1
            pos = base + skip + parsed.index
            yield _Window(rows, checks, np.arange(m), pos, where, "line", parsed.bad, sel.size)
