"""The checkpointer's background thread: jobs run in turn, each under its own name, and a
job that raises (a bug) neither kills the thread nor the jobs after it."""

from __future__ import annotations

import logging
import threading

import pytest

from trainer.checkpoint.worker import Worker


def test_jobs_run_in_order_on_one_thread_each_under_its_name(caplog) -> None:
    worker = Worker("ckpt-worker-test")
    gate = threading.Event()
    ran: list[tuple[str, threading.Thread]] = []

    def record(tag: str) -> None:
        me = threading.current_thread()
        ran.append((me.name, me))

    first = worker.job(lambda: (gate.wait(10), record("first")), "ckpt-commit-1")
    assert not first.is_alive()
    with pytest.raises(RuntimeError, match="before it is started"):
        first.join()
    first.start()
    assert first.is_alive()  # held at the gate
    broken = worker.job(lambda: 1 / 0, "ckpt-memory-2")
    second = worker.job(lambda: record("second"), "ckpt-memory-3")
    with caplog.at_level(logging.ERROR):
        broken.start()
        second.start()
        gate.set()
        second.join(10)
    assert not first.is_alive() and not second.is_alive()
    assert [name for name, _ in ran] == ["ckpt-commit-1", "ckpt-memory-3"]
    assert ran[0][1] is ran[1][1]  # one thread for all of them
    assert "checkpoint job ckpt-memory-2 failed" in caplog.text
    with pytest.raises(RuntimeError, match="started twice"):
        second.start()
    worker.close()
    after = worker.job(lambda: record("after close"), "ckpt-commit-4")
    after.start()
    after.join(10)
    assert ran[-1][0] == "ckpt-commit-4" and ran[-1][1] is not ran[0][1]  # a new thread
    worker.close()
    for thread in threading.enumerate():
        if thread.name.startswith("ckpt-"):
            thread.join(10)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("ckpt-")]
