"""The rank slots of this host a job may still use (docs/recovery.md, "Capacity lost").

A slot is lost when the host's health check says so (``lose``, tasks/health.py): its rank's
next launch would fail again. The orchestrator reads ``ranks`` before each launch: fewer than the
launched size means the next attempt waits for the slot to return and, past
``recovery.wait_for_capacity_s``, runs smaller, resharded from the newest commit. Thread-safe:
a health check marks slots from a thread of its own while the orchestrator watches."""

from __future__ import annotations

import threading


class Capacity:
    """``launched`` slots, numbered 0..launched-1; some of them lost."""

    def __init__(self, launched: int) -> None:
        if launched < 1:
            raise ValueError(f"a job needs at least one rank slot, got {launched}")
        self.launched = launched
        self._lost: set[int] = set()
        self._lock = threading.Lock()

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.launched:
            raise ValueError(f"rank slot {slot} is not one of 0..{self.launched - 1}")

    def lose(self, slot: int) -> None:
        """Slot ``slot`` is unusable (its device failed) until ``regain``."""
        self._check(slot)
        with self._lock:
            self._lost.add(slot)

    def regain(self, slot: int) -> None:
        """Slot ``slot`` is usable again: the job grows back at its next relaunch."""
        self._check(slot)
        with self._lock:
            self._lost.discard(slot)

    @property
    def ranks(self) -> int:
        """The ranks a launch may use now."""
        with self._lock:
            return self.launched - len(self._lost)

    @property
    def lost(self) -> tuple[int, ...]:
        """The slots lost now, in order."""
        with self._lock:
            return tuple(sorted(self._lost))

    @property
    def usable(self) -> tuple[int, ...]:
        """The slots a launch may use now, in order: local rank i runs on the i-th."""
        with self._lock:
            return tuple(s for s in range(self.launched) if s not in self._lost)
