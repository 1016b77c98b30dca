"""Balanced jagged batches across ranks: the deal, the row exchange, determinism.

The exchange runs between two real processes over gloo; the trainer's use of it (two ranks,
killed and resumed, bit-identical) is tests/trainer/test_exact_resume.py's 2proc case, which
trains with ``data.balance_ranks`` on (the default).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.factories import tiny_config
from trainer.data.balance import RankBalancer, _pack, _unpack, deal
from trainer.data.batch import Batch
from trainer.flops import ModelFlops

CAPACITY = 64


def zipf_lengths(rng: np.random.Generator, n: int, max_len: int = 512) -> np.ndarray:
    return np.minimum(rng.zipf(1.6, n), max_len) - 1  # long-tailed, some empty


def make_batch(seed: int, rows: int, num_cat: int = 3, num_dense: int = 5) -> Batch:
    rng = np.random.default_rng(seed)
    lengths = zipf_lengths(rng, rows, 96)
    offsets = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    t = torch.from_numpy
    return Batch(
        dense=t(rng.standard_normal((rows, num_dense)).astype(np.float32)),
        cat=t(rng.integers(0, 50, (rows, num_cat))),
        item=t(rng.integers(0, 100, rows)),
        history_values=t(rng.integers(0, 100, int(offsets[-1]))),
        history_offsets=t(offsets),
        labels=t((rng.random(rows) < 0.3).astype(np.float32)),
    )


def rows_of(batch: Batch) -> list[tuple]:
    """Each row as a hashable tuple (history included), to compare row multisets."""
    off = batch.history_offsets.tolist()
    return [
        (
            tuple(batch.dense[i].tolist()),
            tuple(batch.cat[i].tolist()),
            int(batch.item[i]),
            float(batch.labels[i]),
            tuple(batch.history_values[off[i] : off[i + 1]].tolist()),
        )
        for i in range(len(batch))
    ]


def loads(dest: np.ndarray, costs: list[np.ndarray], world: int) -> np.ndarray:
    return np.bincount(dest, weights=np.concatenate(costs), minlength=world)


@pytest.mark.parametrize("world", [2, 3, 8])
def test_deal_keeps_counts_and_evens_out_the_cost(world: int) -> None:
    rng = np.random.default_rng(world)
    costs = [zipf_lengths(rng, CAPACITY).astype(np.int64) ** 2 + 1 for _ in range(world)]
    dest = deal(costs)
    assert np.bincount(dest, minlength=world).tolist() == [CAPACITY] * world
    before = np.array([c.sum() for c in costs])
    after = loads(dest, costs, world)
    assert after.max() - after.min() <= max(c.max() for c in costs)  # the greedy bound
    assert after.max() - after.min() < before.max() - before.min()
    assert after.max() < before.max()  # the slowest rank has less to do
    assert np.array_equal(dest, deal([c.copy() for c in costs]))  # deterministic


def test_deal_gives_each_rank_back_its_row_count() -> None:
    rng = np.random.default_rng(0)
    counts = [CAPACITY, CAPACITY // 3, CAPACITY, 1]  # short last batches of a shard
    dest = deal([zipf_lengths(rng, n).astype(np.int64) ** 2 for n in counts])
    assert np.bincount(dest, minlength=len(counts)).tolist() == counts


def test_pack_and_unpack_round_trip_every_row() -> None:
    batch = make_batch(0, 40)
    rows = np.array([3, 0, 17, 39, 8])
    lengths = np.diff(batch.history_offsets.numpy())[rows]
    back = _unpack(_pack(batch, rows), lengths, num_cat=3, num_dense=5)
    assert rows_of(back) == [rows_of(batch)[i] for i in rows]
    assert back.dense.dtype == torch.float32 and back.labels.dtype == torch.float32


def _worker(rank: int, world: int, port: int, out: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        config = tiny_config(Path(out))
        flops = ModelFlops.of(config.data, config.model)
        balancer = RankBalancer(None, rank, world, flops, CAPACITY, min_excess=0.0)
        results = {}
        for index in (1, 2):
            batch = make_batch(10 * index + rank, CAPACITY if rank else CAPACITY - 7)
            results[index] = (batch, balancer(batch, index), balancer(batch, index))
        # Even work already (the same batch on both ranks): nothing moves, by default.
        even = make_batch(7, CAPACITY)
        results["even"] = RankBalancer(None, rank, world, flops, CAPACITY)(even, 9) is even
        try:  # a rank one batch ahead of the other: both fail loudly
            balancer(make_batch(99, CAPACITY), 3 + rank)
            results["mismatch"] = "no error"
        except RuntimeError as exc:
            results["mismatch"] = str(exc)
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_two_ranks_exchange_rows_into_balanced_batches(tmp_path: Path) -> None:
    world = 2
    mp.spawn(_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    res = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    flops = ModelFlops.of(tiny_config(tmp_path).data, tiny_config(tmp_path).model)

    def cost(batch: Batch) -> int:
        return flops.of_batch(batch.history_offsets)

    for index in (1, 2):
        given = [res[r][index][0] for r in range(world)]
        dealt = [res[r][index][1] for r in range(world)]
        again = [res[r][index][2] for r in range(world)]
        # Same rows overall, same count per rank, the same deal when repeated.
        assert sorted(sum((rows_of(b) for b in dealt), [])) == sorted(
            sum((rows_of(b) for b in given), [])
        )
        assert [len(b) for b in dealt] == [len(b) for b in given]
        assert [rows_of(b) for b in dealt] == [rows_of(b) for b in again]
        spread_before = abs(cost(given[0]) - cost(given[1]))
        spread_after = abs(cost(dealt[0]) - cost(dealt[1]))
        assert spread_after < spread_before
        lengths = np.concatenate([np.diff(b.history_offsets.numpy()) for b in given])
        assert spread_after <= int(flops.of_lengths(lengths).max())
    for r in range(world):
        assert "different batches [3, 4]" in res[r]["mismatch"], res[r]["mismatch"]
        assert res[r]["even"] is True
