"""Streaming, sharded, exactly resumable training data: Parquet or Criteo TSV shards -> Batch.

Shard i of ``{url}/train/`` goes to rank i % world_size. Each rank cycles through its shards
forever; with ``data.shuffle`` the shard order is permuted per (seed, epoch, rank) and the rows
of a shard per (seed, epoch, shard, window) (trainer/data/shards.py). The position is three
integers, (epoch, shard_pos, row_offset): row_offset counts the shard's rows, in permuted
order, up to and including the last row handed out, so a new loader given ``state_dict()``
continues at exactly the next unseen row. A batch never spans two shards, so its position is
one shard's.

Nothing here touches torch.distributed: rank and world size are plain arguments.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any

from infra import storage
from infra.settings import DataConfig
from trainer.data.batch import Batch
from trainer.data.decode import DataError
from trainer.data.prefetch import Prefetcher
from trainer.data.rows import Rows, rebatch
from trainer.data.shards import WINDOW_ROWS, ShardReader, check_dataset, keyed_rng, list_shards

STATE_VERSION = 1
START_POSITION = {"epoch": 0, "shard_pos": 0, "row_offset": 0}

# A batch, the position after it, and the bad rows and cut histories met while reading it.
_Item = tuple[Batch, dict[str, int], dict[str, int]]


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
        window_rows: int = WINDOW_ROWS,
        balancer: Callable[[Batch, int], Batch] | None = None,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}"
            )
        check_dataset(data)
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
        self._state = dict(START_POSITION)
        self._items: Generator[_Item, None, None] | Prefetcher[_Item] | None = None

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
        for key in START_POSITION:
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
        order = keyed_rng(3, self.seed, epoch, self.rank).permutation(len(self.shards))
        return [int(i) for i in order]

    def _produce(self, state: dict[str, int]) -> Generator[_Item, None, None]:
        epoch, shard_pos, offset = state["epoch"], state["shard_pos"], state["row_offset"]
        reader = ShardReader(self.data, self.window_rows)
        pending = {"bad_rows": 0, "truncated_histories": 0}
        while True:
            whole_epoch, emitted = shard_pos == 0 and offset == 0, False
            order = self._shard_order(epoch)
            for sp in range(shard_pos, len(order)):
                url = self.shards[order[sp]]
                key = (self.seed, epoch, self.rank + order[sp] * self.world_size)
                rows = reader.read(url, key if self.data.shuffle else None, offset, pending)
                for batch in rebatch(rows, self.data.batch_size):
                    yield self._item(batch, epoch, sp, pending)
                    emitted = True
                offset = 0
            if whole_epoch and not emitted:
                raise DataError(f"rank {self.rank}: no usable rows in its shards {self.shards}")
            epoch, shard_pos = epoch + 1, 0

    @staticmethod
    def _item(rows: Rows, epoch: int, sp: int, pending: dict[str, int]) -> _Item:
        deltas = dict(pending)
        pending.update(bad_rows=0, truncated_histories=0)
        state = {"epoch": epoch, "shard_pos": sp, "row_offset": int(rows.pos[-1]) + 1}
        return rows.to_batch(), state, deltas

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
