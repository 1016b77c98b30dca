"""The checkpointer's background thread: commits and in-memory copies run on it, in turn.

At most one checkpoint or copy is in flight (checkpointer.py), so one long-lived thread
serves them all. A thread started per save costs the training loop the start itself:
``Thread.start`` returns only once the new thread runs, and on a small host the cores it
must be scheduled on are the training step's (a third of a millisecond per start, measured
on the 2-core demo host, hundreds of times a job).

A ``Job`` stands where the thread did (``start``, ``is_alive``, ``join``), and the worker
takes each job's name while it runs it, so what logs the thread's name still says which
checkpoint it was working on.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Job:
    """One piece of the checkpointer's background work, run by its ``Worker`` once
    started."""

    def __init__(self, worker: Worker, target: Callable[[], object], name: str) -> None:
        self.name, self._worker, self._target = name, worker, target
        self._started = False
        self._done = threading.Event()

    def start(self) -> None:
        if self._started:
            raise RuntimeError(f"job {self.name} started twice")
        self._started = True
        self._worker.submit(self)

    def is_alive(self) -> bool:
        """Started and not yet finished (as a thread is alive)."""
        return self._started and not self._done.is_set()

    def join(self, timeout: float | None = None) -> None:
        if not self._started:
            raise RuntimeError(f"cannot join job {self.name} before it is started")
        self._done.wait(timeout)

    def run(self) -> None:
        try:
            self._target()
        finally:
            self._done.set()


class Worker:
    """One daemon thread running started jobs in order; made at the first job, and again
    after ``close``. A job that never ends (an upload abandoned past the preemption budget)
    holds it: the process exits without waiting for it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[Job | None] | None = None

    def job(self, target: Callable[[], object], name: str) -> Job:
        return Job(self, target, name)

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._queue is None:
                self._queue = queue.SimpleQueue()
                thread = threading.Thread(
                    target=self._run, args=(self._queue,), name=self.name, daemon=True
                )
                thread.start()
            self._queue.put(job)

    def _run(self, jobs: queue.SimpleQueue[Job | None]) -> None:
        me = threading.current_thread()
        while (job := jobs.get()) is not None:
            me.name = job.name
            try:
                job.run()
            except Exception:  # a job reports its own failures: this is a bug, said loudly
                log.exception("checkpoint job %s failed", job.name)
            finally:
                me.name = self.name

    def close(self) -> None:
        """The thread ends once the jobs started before are done; a later job starts
        another."""
        with self._lock:
            if self._queue is not None:
                self._queue.put(None)
                self._queue = None
