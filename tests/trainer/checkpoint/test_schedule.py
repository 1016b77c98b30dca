"""Which steps the checkpointer saves (trainer/checkpoint/schedule.py), without the loop: by
step count, by rank 0's clock once every rank agreed, at eval steps for the side evaluator;
never a step twice, never the last step (it gets the anchor), never with checkpoints off."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from infra import storage
from infra.accounting.ledger import Ledger
from infra.accounting.ledger_format import Span
from infra.accounting.ledger_read import read_events
from infra.checkpoint_manifest import committed_checkpoints
from infra.job_layout import JobLayout
from infra.settings import load_config
from tests.factories import HeldState
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.interval import FailureHistory
from trainer.checkpoint.schedule import SaveSchedule
from trainer.checkpoint.state import RankState
from trainer.consensus import Agreed

TOTAL = 20


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def schedule(
    tmp_path: Path,
    clock: Clock | None = None,
    rank: int = 0,
    start: int = 0,
    train: dict[str, Any] | None = None,
    **checkpoint: Any,
) -> SaveSchedule:
    train = {"steps": TOTAL, "eval": "off", **(train or {})}
    config = load_config(train=train, checkpoint=checkpoint)
    ledger = Ledger(JobLayout.at(f"file://{tmp_path}/job"))
    return SaveSchedule(config, ledger, rank, start, clock=clock or Clock())


def saves(s: SaveSchedule, agreed_at: frozenset[int] = frozenset()) -> list[int]:
    """The steps saved over a whole run, every step boundary asked once."""
    out = []
    for step in range(TOTAL + 2):
        if s.due(step, step in agreed_at):
            s.saved(step, 0.0)
            out.append(step)
    return out


def test_by_step_count_every_rank_alike_and_never_the_last_step(tmp_path: Path) -> None:
    for rank in (0, 1):
        assert saves(schedule(tmp_path, rank=rank, every_steps=5)) == [5, 10, 15]  # 20: anchor


def test_by_the_clock_only_what_every_rank_agreed(tmp_path: Path) -> None:
    clock = Clock()
    s = schedule(tmp_path, clock, every_steps=None, every_seconds=10)
    assert not s.by_clock(1)
    clock.t += 10
    assert s.by_clock(1)  # rank 0's clock asks...
    assert not s.due(1, agreed_by_clock=False)  # ...but nothing is saved until all agreed
    assert s.due(1, agreed_by_clock=True)
    other = schedule(tmp_path, clock, rank=1, every_steps=None, every_seconds=10)
    assert not other.by_clock(1)  # other ranks' clocks never ask
    assert saves(s, agreed_at=frozenset({3, 7})) == [3, 7]


def test_the_clock_is_not_asked_at_a_step_the_count_saves(tmp_path: Path) -> None:
    """Its flag would arrive one step later and save that step too."""
    clock = Clock()
    s = schedule(tmp_path, clock, every_steps=5, every_seconds=1)
    clock.t += 2
    assert [step for step in range(1, 8) if s.by_clock(step)] == [1, 2, 3, 4, 6, 7]


def test_eval_steps_are_saved_for_the_side_evaluator_only(tmp_path: Path) -> None:
    side, inline = {"eval": "async", "eval_every": 4}, {"eval": "inline", "eval_every": 4}
    rarely = {"every_steps": None, "every_seconds": 1e5}
    assert saves(schedule(tmp_path, train=side, **rarely)) == [4, 8, 12, 16]  # 20: anchor
    assert saves(schedule(tmp_path, train=inline, **rarely)) == []
    both = schedule(tmp_path, train=side, every_steps=6)
    assert saves(both, agreed_at=frozenset({9})) == [4, 6, 8, 9, 12, 16, 18]


def test_never_a_step_twice_nor_the_step_training_resumed_from(tmp_path: Path) -> None:
    s = schedule(tmp_path, start=10, every_steps=5)
    assert not s.due(10, agreed_by_clock=True)  # restored from it: committed already
    assert not s.by_clock(10)
    assert s.due(15, agreed_by_clock=False)
    s.saved(15, 0.01)
    assert not s.due(15, agreed_by_clock=True)
    assert not s.due(TOTAL, agreed_by_clock=True) and not s.due(TOTAL + 1, True)
    s.restored(12, after_failure=False)  # an older commit loaded back: 12 is not saved again
    assert not s.due(12, agreed_by_clock=True) and s.due(13, agreed_by_clock=True)


def test_checkpoints_off_saves_nothing(tmp_path: Path) -> None:
    clock = Clock()
    s = schedule(tmp_path, clock, mode="off", every_steps=5, every_seconds=1)
    clock.t += 10
    assert not s.by_clock(3)
    assert saves(s, agreed_at=frozenset(range(TOTAL))) == []


def test_the_deferred_consensus_saves_every_step_from_the_second_on(tmp_path: Path) -> None:
    """A clock far below a step's time, the flags agreed one step after rank 0 raised them
    (trainer/consensus.py): the steps tests/reliability/test_recovery_paths.py sees."""
    clock = Clock()
    s = schedule(tmp_path, clock, every_steps=None, every_seconds=1e-6)
    raised, saved = False, []
    for step in range(6):
        clock.t += 1  # a step's time
        agreed, raised = raised, s.by_clock(step)
        if s.due(step, agreed):
            s.saved(step, 0.0)
            saved.append(step)
    assert saved == [2, 3, 4, 5]  # 6: the anchor


def test_a_failure_survived_in_process_counts_towards_the_interval(tmp_path: Path) -> None:
    s = schedule(tmp_path, every_steps="auto")
    s.restored(4, after_failure=True)
    assert s.interval.history.failures == 1 and s.last_saved == 4


def test_the_checkpointer_saves_what_its_schedule_says(
    tmp_path: Path, group: dist.ProcessGroup
) -> None:
    """The real Checkpointer as the loop drives it: ``maybe_save`` at each step boundary
    with what the ranks agreed, ``step_done`` after each step."""
    config = load_config(
        job_id="schedule",
        storage={"root": f"file://{tmp_path}/store"},
        train={"steps": 10, "eval": "async", "eval_every": 4},
        checkpoint={"mode": "sync", "every_steps": 3, "keep_latest_k": 10},
    )
    storage.configure(config.storage)
    layout = JobLayout.at(f"file://{tmp_path}/ledger")
    ledger = Ledger(layout)
    ckpt = Checkpointer(config, 0, 1, ledger, process_group=group)
    ckpt.register({"model": HeldState({"w": torch.ones(2)}), "loader": RankState(HeldState({}))})
    ckpt.start(0, FailureHistory())
    try:
        for step in range(10):
            ckpt.maybe_save(step, Agreed(checkpoint=step == 7))
            ckpt.step_done()
        ckpt.maybe_save(9, Agreed(checkpoint=True))  # the same boundary again: not saved twice
    finally:
        ckpt.close()
        ledger.close()
    expected = [3, 4, 6, 7, 8, 9]  # count 3, 6, 9; eval 4, 8; the clock 7; never 0 or 10
    assert sorted(c.step for c in committed_checkpoints(config.layout)) == expected
    blocking = [e.step for e in read_events(layout) if e.name == Span.CHECKPOINT_BLOCKING]
    assert blocking == expected


def test_ranks_that_agreed_to_stop_keep_the_counts_save_not_the_clocks(
    tmp_path: Path, group: dist.ProcessGroup
) -> None:
    """The save on SIGTERM follows at the same step: it finds the count's save there (and
    waits for it), and takes the step the clock asked for itself."""
    config = load_config(
        job_id="stopping",
        storage={"root": f"file://{tmp_path}/store"},
        train={"steps": 10, "eval": "off"},
        checkpoint={"mode": "sync", "every_steps": 3},
    )
    storage.configure(config.storage)
    ledger = Ledger(JobLayout.at(f"file://{tmp_path}/ledger"))
    ckpt = Checkpointer(config, 0, 1, ledger, process_group=group)
    ckpt.register({"model": HeldState({"w": torch.ones(2)}), "loader": RankState(HeldState({}))})
    ckpt.start(0, FailureHistory())
    try:
        ckpt.maybe_save(1, Agreed(preempt=True, checkpoint=True))
        ckpt.maybe_save(3, Agreed(preempt=True))
    finally:
        ckpt.close()
        ledger.close()
    assert [c.step for c in committed_checkpoints(config.layout)] == [3]
