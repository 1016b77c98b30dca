"""Read ahead on a background thread: decoding the next batches overlaps the training step.

The queue is bounded, so the reader is never more than ``depth`` items ahead; an exception
raised while reading is handed over and raised by the consumer's ``next()``; ``close()`` stops
the thread without waiting for the reader to find room in a full queue.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _End:
    pass


class Prefetcher(Generic[T]):
    """Iterates ``items`` on a thread named ``name``, up to ``depth`` items ahead."""

    def __init__(self, items: Iterator[T], depth: int, name: str) -> None:
        self._queue: queue.Queue[T | _Failure | _End] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(items,), name=name, daemon=True)
        self._thread.start()

    def _put(self, item: T | _Failure | _End) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, items: Iterator[T]) -> None:
        try:
            for item in items:
                if not self._put(item):
                    return
            self._put(_End())
        except BaseException as exc:  # handed to the consumer, raised there
            self._put(_Failure(exc))
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    def __iter__(self) -> Prefetcher[T]:
        return self

    def __next__(self) -> T:
        while True:
            try:
                item = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError(f"{self._thread.name} stopped unexpectedly") from None
        if isinstance(item, _Failure):
            raise item.exc
        if isinstance(item, _End):
            raise StopIteration
        return item

    def close(self) -> None:
        """Stop the thread; items read ahead are dropped."""
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._queue.get_nowait()
            except queue.Empty:
                self._thread.join(timeout=0.05)
