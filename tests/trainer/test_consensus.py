"""StepConsensus with two real gloo ranks (forked processes): every rank acts on the same
step; the deferred exchange one step after the flag was raised, the blocking one at once."""

from __future__ import annotations

import multiprocessing as mp
import socket
from typing import Any

import pytest
import torch.distributed as dist

from trainer.consensus import StepConsensus

RAISED_AT = 3  # rank 1 alone sees the preemption at this step; rank 0's clock asks at 5
CLOCK_AT = 5
NEVER = 100


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, blocking: bool, raised_at: int, out: Any) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        consensus = StepConsensus(2, None, blocking=blocking)
        checkpoints, stopped = [], None
        for step in range(1, 10):
            agreed = consensus.exchange(
                preempt=rank == 1 and step >= raised_at, checkpoint=rank == 0 and step == CLOCK_AT
            )
            if agreed.checkpoint:
                checkpoints.append(step)
            if agreed.preempt:
                stopped = step
                break
        out.put((rank, checkpoints, stopped))
    finally:
        dist.destroy_process_group()


def _two_ranks(blocking: bool, raised_at: int) -> list[tuple[int, list[int], int | None]]:
    """(rank, steps checkpointed, step stopped at) of each rank."""
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, blocking, raised_at, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        results = sorted(out.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    return results


@pytest.mark.parametrize(("blocking", "lag"), [(False, 1), (True, 0)], ids=["deferred", "blocking"])
def test_a_preemption_one_rank_saw_stops_both_at_the_same_step(blocking: bool, lag: int) -> None:
    # The preemption raised at step 3 wins before the clock's checkpoint at step 5.
    stop = RAISED_AT + lag
    assert _two_ranks(blocking, RAISED_AT) == [(0, [], stop), (1, [], stop)]


@pytest.mark.parametrize(("blocking", "lag"), [(False, 1), (True, 0)], ids=["deferred", "blocking"])
def test_rank_zeros_clock_checkpoint_is_taken_by_both(blocking: bool, lag: int) -> None:
    at = CLOCK_AT + lag
    assert _two_ranks(blocking, NEVER) == [(0, [at], None), (1, [at], None)]
