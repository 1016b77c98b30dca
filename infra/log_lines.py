"""One log line format for this product's processes, and its reader.

Every process writes ``<time> <LEVEL> [<tag>] <logger>: <message>`` (``configure``): ranks
(tag ``rank<N>``), the side evaluator, the launcher, the ``ett`` CLI. The process that reads
a child's output and logs it again (the orchestrator's ``OutputPump``, tasks/local_node.py,
into the Prefect run's logs) reads each line with ``LineLevels``: the record it makes has
the line's level, so a rank's WARNING is a WARNING in Prefect, and the child's timestamp
is dropped, since the record carries its own: one timestamp per line.

Lines in another shape keep a level too: torch's own (``[rank0]:W1205 10:47:46.077 7548
file.py:56] ...``) by their letter; a line with no level at all (a traceback's, the source
line under a warning) takes the level of the line before it.

``ETT_LOG_LEVEL`` (default INFO) is the level of every process ``configure`` sets up, so
``ett -v`` (which sets it to DEBUG) reaches the ranks too.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from typing import IO

from infra.control import ENV_ATTEMPT
from infra.library_logs import quiet_libraries

ENV_LEVEL = "ETT_LOG_LEVEL"
LEVEL_NAMES = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# <time> <LEVEL> <rest>, the time optional (a line already stripped of it reads the same).
OURS = re.compile(
    r"^(?:\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[,.]\d+)? )?(" + "|".join(LEVEL_NAMES) + r") (.*)$"
)
# torch's glog-style lines: [rank0]:W1205 10:47:46.077000 7548 path/file.py:56] message
TORCH = re.compile(
    r"^(?:\[(rank\d+)\]:)?([DIWEC])\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ([^\]\s]+)\] ?(.*)$"
)
TORCH_LEVELS = {
    "D": logging.DEBUG,
    "I": logging.INFO,
    "W": logging.WARNING,
    "E": logging.ERROR,
    "C": logging.CRITICAL,
}


def line_format(tag: str = "") -> str:
    """The format string of ``configure`` (``tag``: rank0, evaluator, ...; none for the CLI)."""
    return "%(asctime)s %(levelname)s " + (f"[{tag}] " if tag else "") + "%(name)s: %(message)s"


def level() -> int:
    """The level ``ETT_LOG_LEVEL`` names (INFO when unset); ValueError naming a bad one."""
    name = os.environ.get(ENV_LEVEL, "INFO").strip().upper()
    if name not in LEVEL_NAMES:
        raise ValueError(f"{ENV_LEVEL}={name!r} is not one of {', '.join(LEVEL_NAMES)}")
    return int(getattr(logging, name))


def configure(tag: str, first_of_job: bool, stream: IO[str] | None = None) -> None:
    """Logging of a child process (rank, evaluator): ``line_format(tag)`` on ``stream``
    (stdout), at ``level()``, Python warnings as records, library noise quieted
    (``first_of_job``: whether this process shows it once at DEBUG; infra/library_logs.py)."""
    logging.basicConfig(
        level=level(),
        format=line_format(tag),
        stream=stream or sys.stdout,
        force=True,  # an imported library may have configured logging already
    )
    logging.captureWarnings(True)
    quiet_libraries(first_of_job)


def configure_rank() -> None:
    """A trainer rank's logging: tagged ``rank<RANK>``; library noise shown once per job,
    by rank 0 of the job's first attempt (``ETT_ATTEMPT`` 0, or unset: a rank on its own)."""
    rank = os.environ.get("RANK", "0")
    configure(f"rank{rank}", first_of_job=rank == "0" and os.environ.get(ENV_ATTEMPT, "0") == "0")


class LineLevels:
    """Reads one child's output, line by line: ``(level, text)`` for each, the text without
    the child's timestamp and level."""

    def __init__(self) -> None:
        self.last = logging.INFO

    def __call__(self, line: str) -> tuple[int, str]:
        if found := OURS.match(line):
            self.last = int(getattr(logging, found.group(1)))
            return self.last, found.group(2)
        if found := TORCH.match(line):
            rank, letter, where, message = found.groups()
            self.last = TORCH_LEVELS[letter]
            return self.last, (f"[{rank}] " if rank else "") + f"{where}: {message}"
        if line.startswith("Traceback (most recent call last)"):
            self.last = logging.ERROR
        return self.last, line
