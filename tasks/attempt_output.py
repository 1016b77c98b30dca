"""The log level of each line of an attempt's output, as the orchestrator passes it on.

When a worker dies, torchrun raises ChildFailedError and Python prints torchrun's own
traceback (~20 lines of torch.distributed internals) before the summary box that names the
failed rank and its exit code. The traceback says nothing about the job, so it goes to DEBUG;
the box stays at INFO. A traceback cannot be told apart before its last line (the exception),
so its lines are held until then; any other traceback (a rank's real error) is passed on at
INFO as it came.
"""

from __future__ import annotations

import logging

TRACEBACK = "Traceback (most recent call last):"
LAUNCHER_EXCEPTION = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
MAX_HELD = 500  # lines: a traceback longer than this is passed on as it is


class OutputLevels:
    """Feed it the attempt's output lines in order; it returns them with their levels."""

    def __init__(self) -> None:
        self._held: list[str] = []

    def feed(self, line: str) -> list[tuple[int, str]]:
        if not self._held:
            if line.strip() == TRACEBACK:
                self._held.append(line)
                return []
            return [(logging.INFO, line)]
        if line[:1].isspace() or line.strip() == TRACEBACK:  # a frame, its code, ^^^ marks
            self._held.append(line)
            return self.flush() if len(self._held) > MAX_HELD else []
        held, self._held = self._held, []
        level = logging.DEBUG if line.startswith(LAUNCHER_EXCEPTION) else logging.INFO
        return [(level, text) for text in (*held, line)]

    def flush(self) -> list[tuple[int, str]]:
        """Whatever is held, at INFO (the output ended inside a traceback)."""
        held, self._held = self._held, []
        return [(logging.INFO, text) for text in held]
