"""Balanced jagged batches across ranks: a load-balancing shuffle at batch time.

Every rank waits for the slowest at each step's collectives. With long-tailed history
lengths, attention costs L**2 per sequence, so one rank's batch can hold far more work than
another's. Here the ranks pool the rows of their current batches and re-deal them so every
rank keeps its row count and the summed cost per rank is as even as a greedy deal gets
(longest-processing-time first: heaviest row to the least-loaded rank that still has room).
The cost of a row is its training FLOPs at its real history length (trainer/flops.py).

Per step, on the balancer's own gloo group (``DistEnv.data_group``): an ``all_gather`` of
every rank's history lengths (fixed size); then, unless the ranks' work is already even
(``MIN_EXCESS``), an ``all_to_all_single`` of the rows each rank sends to each other rank.
Every rank computes the same choice and the same deal from the same lengths, so nothing
else is exchanged. The exchange runs on the thread that takes the
batch from the loader, never on its prefetch thread: each rank makes exactly one exchange
per batch taken, so a rank that stops early never leaves another blocked mid-exchange.

Deterministic and resumable: the deal is a pure function of the ranks' batches, and the
loader's position (the job's, trainer/data/loader.py) counts the global batches' rows, so
a resumed job re-reads the same batches and deals them the same way. The batch index goes
along with the lengths: ranks that disagree on it (one re-fetched its first batch) fail
loudly instead of mixing steps.
"""

from __future__ import annotations

import heapq
from dataclasses import fields

import numpy as np
import torch
import torch.distributed as dist

from infra.settings import JobConfig
from trainer.data.batch import Batch
from trainer.data.loader import rank_batch_size
from trainer.distributed import DistEnv
from trainer.flops import ModelFlops

_HEADER = 2  # batch index, rows
# Rows move only when the busiest rank has at least this share of its work above the mean:
# below it, the exchange costs more than it saves (benchmarks/bench_throughput.py compares
# the step with and without balancing).
MIN_EXCESS = 0.02


def deal(costs: list[np.ndarray]) -> np.ndarray:
    """Greedy LPT with capacities: ``costs[r]`` holds rank r's row costs; returns, for every
    row in rank order (rank 0's rows, then rank 1's...), the rank it goes to. Each rank
    receives as many rows as it gave. Ties: lower source rank and row first, lower rank."""
    counts = [c.size for c in costs]
    flat = np.concatenate(costs).astype(np.int64)
    sources = np.repeat(np.arange(len(costs)), counts)
    order = np.lexsort((np.arange(flat.size), sources, -flat)).tolist()
    cost_list = flat.tolist()
    room = list(counts)
    heap = [(0, r) for r in range(len(costs)) if room[r]]
    dest = np.empty(flat.size, dtype=np.int64)
    for i in order:
        load, r = heapq.heappop(heap)
        dest[i] = r
        room[r] -= 1
        if room[r]:
            heapq.heappush(heap, (load + cost_list[i], r))
    return dest


def _pack(batch: Batch, rows: np.ndarray) -> torch.Tensor:
    """Rows of a batch as one int64 tensor: cat, item, dense bits, label bits, history."""
    offsets = batch.history_offsets.numpy()
    starts, lengths = offsets[rows], offsets[rows + 1] - offsets[rows]
    firsts = np.cumsum(lengths) - lengths  # where each row's history starts in the payload
    history = np.repeat(starts - firsts, lengths) + np.arange(int(lengths.sum()))
    idx = torch.from_numpy(rows)
    parts = [
        batch.cat[idx].reshape(-1),
        batch.item[idx],
        batch.dense[idx].view(torch.int32).reshape(-1).long(),
        batch.labels[idx].view(torch.int32).long(),
        batch.history_values[torch.from_numpy(history)],
    ]
    return torch.cat(parts)


def _unpack(payload: torch.Tensor, lengths: np.ndarray, num_cat: int, num_dense: int) -> Batch:
    """The inverse of ``_pack`` for rows with these history lengths."""
    n = lengths.size
    sizes = [n * num_cat, n, n * num_dense, n, int(lengths.sum())]
    cat, item, dense, labels, history = payload.split(sizes)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Batch(
        dense=dense.int().view(torch.float32).reshape(n, num_dense),
        cat=cat.reshape(n, num_cat),
        item=item,
        history_values=history,
        history_offsets=torch.from_numpy(offsets),
        labels=labels.int().view(torch.float32),
    )


def _concat(parts: list[Batch]) -> Batch:
    if len(parts) == 1:
        return parts[0]
    offsets, shift = [torch.zeros(1, dtype=torch.int64)], 0
    for p in parts:
        offsets.append(p.history_offsets[1:] + shift)
        shift += int(p.history_offsets[-1])
    cols = {
        f.name: torch.cat([getattr(p, f.name) for p in parts])
        for f in fields(Batch)
        if f.name != "history_offsets"
    }
    return Batch(history_offsets=torch.cat(offsets), **cols)


class RankBalancer:
    """The loader hook: ``balancer(batch, index) -> batch`` (see the module docstring)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        rank: int,
        world_size: int,
        flops: ModelFlops,
        capacity: int,
        min_excess: float = MIN_EXCESS,
    ) -> None:
        self.group, self.rank, self.world_size = group, rank, world_size
        self.flops, self.capacity, self.min_excess = flops, capacity, min_excess
        self.exchanged = self.skipped = 0  # batches whose rows moved / were even enough

    def __call__(self, batch: Batch, index: int) -> Batch:
        lengths = np.diff(batch.history_offsets.numpy())
        n = lengths.size
        if n > self.capacity:
            raise ValueError(f"a batch of {n} rows exceeds a rank's share {self.capacity}")
        mine = torch.zeros(_HEADER + self.capacity, dtype=torch.int64)
        mine[0], mine[1] = index, n
        mine[_HEADER : _HEADER + n] = torch.from_numpy(lengths)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine, group=self.group)
        indices = {int(t[0]) for t in every}
        if len(indices) != 1:
            raise RuntimeError(
                f"rank balancing: ranks are at different batches {sorted(indices)} (rank "
                f"{self.rank} at {index}); every rank must take the same batches in order"
            )
        all_lengths = [t[_HEADER : _HEADER + int(t[1])].numpy() for t in every]
        costs = [self.flops.of_lengths(x) for x in all_lengths]
        loads = [int(c.sum()) for c in costs]  # the same numbers, so the same choice, everywhere
        if max(loads) - sum(loads) / len(loads) < self.min_excess * max(loads):
            self.skipped += 1
            return batch
        self.exchanged += 1
        dest = deal(costs)
        bounds = np.cumsum([0] + [x.size for x in all_lengths])
        num_cat, num_dense = batch.cat.shape[1], batch.dense.shape[1]

        # Send: my rows grouped by destination (ascending row within each).
        my_dest = dest[bounds[self.rank] : bounds[self.rank + 1]]
        sends = [np.flatnonzero(my_dest == d) for d in range(self.world_size)]
        out = [_pack(batch, rows) for rows in sends]
        # Receive: from each source, its rows dealt to me, in the same order.
        incoming = [
            all_lengths[s][dest[bounds[s] : bounds[s + 1]] == self.rank]
            for s in range(self.world_size)
        ]
        in_sizes = [x.size * (num_cat + 2 + num_dense) + int(x.sum()) for x in incoming]
        received = torch.empty(sum(in_sizes), dtype=torch.int64)
        dist.all_to_all_single(
            received,
            torch.cat(out),
            output_split_sizes=in_sizes,
            input_split_sizes=[t.numel() for t in out],
            group=self.group,
        )
        parts = [
            _unpack(chunk, x, num_cat, num_dense)
            for chunk, x in zip(received.split(in_sizes), incoming, strict=True)
            if x.size
        ]
        return _concat(parts)


def make_balancer(config: JobConfig, env: DistEnv) -> RankBalancer | None:
    """The loader's hook for this job, or None (one rank, or ``data.balance_ranks`` off)."""
    if env.world_size == 1 or not config.data.balance_ranks:
        return None
    return RankBalancer(
        env.data_group,
        env.rank,
        env.world_size,
        ModelFlops.of(config.data, config.model),
        rank_batch_size(config.data.batch_size, env.world_size),
    )
