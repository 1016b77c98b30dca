"""Streaming, sharded, exactly resumable training data: Parquet or Criteo TSV shards -> Batch.

The stream belongs to the job, not to a rank. Its order is defined globally: each epoch
permutes every shard of ``{url}/train/`` per (seed, epoch), and, with ``data.shuffle``, the
windows and rows of each shard per (seed, epoch, shard, window) (trainer/data/shards.py).
That sequence of rows, epoch after epoch, is cut into global batches of ``data.batch_size``
rows; a global batch may span shards and epochs. Rank r of M takes rows
``[r * B / M, (r + 1) * B / M)`` of each global batch (B / M: ``rank_batch_size``), so its
share of global batch b depends only on b, M and r, and a job resumed on any number of
ranks consumes exactly the rows not yet consumed. A ``data.batch_size`` that M does not
divide is refused (ConfigError naming both).

The position is three integers, (epoch, shard_pos, row_offset), the same on every rank:
row_offset counts the rows of the shard at shard_pos, in permuted order, up to and including
the last row of the last global batch handed out, so a new loader given ``state_dict()``, on
any world size, continues at exactly the next unseen row.

Every rank reads (and validates) the whole stream and keeps its slice: the price of a
position that any world size can continue, paid in decoding on the loader's prefetch thread.

Nothing here touches torch.distributed: rank and world size are plain arguments.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterator
from typing import Any

import numpy as np

from infra.config_sources import ConfigError
from infra.settings import DataConfig
from trainer.data.batch import Batch
from trainer.data.decode import DataError
from trainer.data.prefetch import Prefetcher
from trainer.data.rows import Rows
from trainer.data.shards import WINDOW_ROWS, ShardReader, check_dataset, keyed_rng, list_shards

# 2: a global position (1: one rank's; a version-1 state of a one-rank job is the same
# position, since one rank's stream was the global one's order).
STATE_VERSION = 2
START_POSITION = {"epoch": 0, "shard_pos": 0, "row_offset": 0}

# A batch, the position after it, and the bad rows and cut histories met while reading it.
_Item = tuple[Batch, dict[str, int], dict[str, int]]


def rank_batch_size(batch_size: int, world_size: int) -> int:
    """Rows per rank of a global batch of ``batch_size`` rows; ConfigError when the ranks
    cannot share it evenly (a different split would change the stream)."""
    if world_size < 1 or batch_size % world_size:
        raise ConfigError(
            f"data.batch_size={batch_size} (the global batch) cannot be split over "
            f"world_size={world_size} ranks: make it a multiple of the world size"
        )
    return batch_size // world_size


def global_batches(
    pieces: Iterator[tuple[Rows, int, int]], size: int
) -> Iterator[tuple[Rows, dict[str, int]]]:
    """Pieces of rows tagged (epoch, shard_pos) -> global batches of exactly ``size`` rows,
    each with the position after its last row. Lazy, like ``rows.rebatch``."""
    buf: Rows | None = None
    tags = np.zeros((0, 2), dtype=np.int64)
    for rows, epoch, sp in pieces:
        if not len(rows):
            continue
        buf = rows if buf is None else Rows.concat([buf, rows])
        tags = np.concatenate([tags, np.tile([epoch, sp], (len(rows), 1))])
        i = 0
        while len(buf) - i >= size:
            j = i + size
            epoch_end, sp_end = (int(t) for t in tags[j - 1])
            state = {"epoch": epoch_end, "shard_pos": sp_end, "row_offset": int(buf.pos[j - 1]) + 1}
            yield buf.slice(i, j), state
            i = j
        buf, tags = buf.slice(i, len(buf)), tags[i:]


class TrainLoader:
    """Infinite iterator of one rank's share of the global batches; see the module docstring.

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
        window_rows: int = WINDOW_ROWS,
        balancer: Callable[[Batch, int], Batch] | None = None,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}"
            )
        self.rank_batch = rank_batch_size(data.batch_size, world_size)
        check_dataset(data)
        self.data, self.rank, self.world_size, self.seed = data, rank, world_size, seed
        self.prefetch, self.window_rows = prefetch, window_rows
        self.balancer = balancer  # re-deals each batch's rows across ranks (data/balance.py)
        self.shards = list_shards(data, "train")
        self.stats = {"rows": 0, "batches": 0, "bad_rows": 0, "truncated_histories": 0}
        self._state = dict(START_POSITION)
        self._items: Generator[_Item, None, None] | Prefetcher[_Item] | None = None

    # --- position -----------------------------------------------------------------------
    def _identity(self) -> dict[str, int]:
        """What the position's meaning depends on (never the rank or the world size)."""
        return {
            "num_shards": len(self.shards),
            "seed": self.seed,
            "shuffle": int(self.data.shuffle),
            "window_rows": self.window_rows,
        }

    def state_dict(self) -> dict[str, int]:
        """The position after the last batch handed out (small, JSON-able ints)."""
        return {"version": STATE_VERSION, **self._state, **self._identity()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the next row unseen by the job whose loaders made ``state``, whatever
        its world size was."""
        version = state.get("version", STATE_VERSION)
        if version != STATE_VERSION and not (version == 1 and state.get("world_size") == 1):
            raise DataError(
                f"data loader state version {version!r} (world_size="
                f"{state.get('world_size')!r}) is not a global position ({STATE_VERSION}); "
                "cannot resume from it"
            )
        for key, mine in self._identity().items():
            if key in state and state[key] != mine:
                raise DataError(
                    f"data loader state was saved with {key}={state[key]!r}, this loader has "
                    f"{key}={mine!r}: the saved position does not apply to this stream"
                )
        pos = {}
        for key in START_POSITION:
            value = state.get(key)
            if not isinstance(value, int) or value < 0:
                raise DataError(f"data loader state: {key} must be an int >= 0, got {value!r}")
            pos[key] = value
        if pos["shard_pos"] >= len(self.shards):
            raise DataError(
                f"data loader state: shard_pos={pos['shard_pos']} but the data set has "
                f"{len(self.shards)} shards"
            )
        self.close()
        self._state = pos

    # --- reading ------------------------------------------------------------------------
    def _shard_order(self, epoch: int) -> list[int]:
        if not self.data.shuffle:
            return list(range(len(self.shards)))
        order = keyed_rng(3, self.seed, epoch).permutation(len(self.shards))
        return [int(i) for i in order]

    def _pieces(
        self, state: dict[str, int], pending: dict[str, int]
    ) -> Iterator[tuple[Rows, int, int]]:
        """The global stream from ``state`` on, as read: (rows, epoch, shard_pos) pieces."""
        epoch, shard_pos, offset = state["epoch"], state["shard_pos"], state["row_offset"]
        reader = ShardReader(self.data, self.window_rows)
        while True:
            whole_epoch, emitted = shard_pos == 0 and offset == 0, False
            order = self._shard_order(epoch)
            for sp in range(shard_pos, len(order)):
                key = (self.seed, epoch, order[sp])
                shard = self.shards[order[sp]]
                for rows in reader.read(shard, key if self.data.shuffle else None, offset, pending):
                    emitted = emitted or len(rows) > 0
                    yield rows, epoch, sp
                offset = 0
            if whole_epoch and not emitted:
                raise DataError(f"no usable rows in any shard of {self.shards}")
            epoch, shard_pos = epoch + 1, 0

    def _produce(self, state: dict[str, int]) -> Generator[_Item, None, None]:
        pending = {"bad_rows": 0, "truncated_histories": 0}
        lo = self.rank * self.rank_batch
        for rows, after in global_batches(self._pieces(state, pending), self.data.batch_size):
            deltas = dict(pending)
            pending.update(bad_rows=0, truncated_histories=0)
            yield rows.slice(lo, lo + self.rank_batch).to_batch(), after, deltas

    def __iter__(self) -> TrainLoader:
        return self

    def __next__(self) -> Batch:
        if self._items is None:
            produce = self._produce(dict(self._state))
            self._items = (
                Prefetcher(produce, self.prefetch, f"data-prefetch-{self.rank}")
                if self.prefetch > 0
                else produce
            )
        try:
            batch, state, deltas = next(self._items)
        except BaseException:
            self.close()
            raise
        self._state = state
        self.stats["rows"] += len(batch)
        self.stats["batches"] += 1
        for key, value in deltas.items():
            self.stats[key] += value
        if self.balancer is not None:  # on this thread: one exchange per batch taken
            batch = self.balancer(batch, self.stats["batches"])
        return batch

    def close(self) -> None:
        """Stop reading ahead (the next batch restarts reading from the state)."""
        items, self._items = self._items, None
        if items is not None:
            items.close()

    def __enter__(self) -> TrainLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
