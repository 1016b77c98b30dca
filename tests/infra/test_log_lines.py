"""infra/log_lines.py and the orchestrator's pump (tasks/local_node.OutputPump): a child's
line keeps its level, carries one timestamp, and library noise is DEBUG once per job.

The children are real processes that set up logging as a rank does (``configure_rank``) and
log through the real library loggers; their output goes through the real pump."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from infra.log_lines import LineLevels
from tasks.local_node import OutputPump
from tests.factories import ROOT

# What a rank of this product says, and what its libraries say around it (infra/library_logs).
CHILD = """
import logging, warnings
from infra import log_lines
log_lines.configure_rank()
logging.getLogger("trainer").warning("loss is NaN at step 3")
logging.getLogger("trainer").info("step 4/10 loss 0.61")
for _ in range(2):  # a library says it again: still once
    logging.getLogger("torchrec.distributed.planner.types").warning(
        "The topology was constructed directly rather than via TopologyFactory.create_topology()."
    )
warnings.warn("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning)
logging.getLogger("aiobotocore.credentials").info("Found credentials in environment variables.")
logging.getLogger("trainer").error("shard 2 unreadable")
"""
NOISE_WORDS = ("topology was constructed", "deprecating ShardedTensor", "Found credentials")


@pytest.fixture
def captured() -> Iterator[list[logging.LogRecord]]:
    """The records a pump makes, at every level (the Prefect run logger in production)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    log = logging.getLogger("test-log-lines")
    handler, saved = Keep(level=logging.DEBUG), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        yield records
    finally:
        log.removeHandler(handler)
        log.setLevel(saved)


def _rank(rank: int, attempt: int, level: str = "DEBUG") -> None:
    """One rank of a job, its output read by the pump into logger test-log-lines."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "RANK": str(rank),
        "ETT_ATTEMPT": str(attempt),
        "ETT_LOG_LEVEL": level,
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    pump = OutputPump(proc.stdout, logging.getLogger("test-log-lines"), "")
    assert proc.wait(timeout=60) == 0
    pump.thread.join(timeout=10)


def _at(records: list[logging.LogRecord], level: int) -> list[str]:
    return [r.getMessage() for r in records if r.levelno == level]


def test_a_ranks_lines_keep_their_level_and_one_timestamp(
    captured: list[logging.LogRecord],
) -> None:
    _rank(1, 0, level="INFO")
    assert _at(captured, logging.WARNING) == ["[rank1] trainer: loss is NaN at step 3"]
    assert _at(captured, logging.ERROR) == ["[rank1] trainer: shard 2 unreadable"]
    assert "[rank1] trainer: step 4/10 loss 0.61" in _at(captured, logging.INFO)
    # The record has its own time: the rank's is not in the message.
    assert all(not r.getMessage()[:4].isdigit() for r in captured), captured


def test_library_noise_is_debug_once_per_job(captured: list[logging.LogRecord]) -> None:
    """Rank 0 of attempt 0 shows each noise line once, at DEBUG; rank 1 and a later attempt
    (a standby, a relaunch) drop it. Everything else still comes from every rank."""
    for rank, attempt in ((0, 0), (1, 0), (0, 1)):
        _rank(rank, attempt)
    debug = _at(captured, logging.DEBUG)
    for words in NOISE_WORDS:
        shown = [line for line in debug if words in line]
        assert len(shown) == 1 and shown[0].startswith("[rank0] "), (words, debug)
    above = [r.getMessage() for r in captured if r.levelno > logging.DEBUG]
    assert not [line for line in above if any(w in line for w in NOISE_WORDS)], above
    assert len(_at(captured, logging.WARNING)) == 3  # the rank's own warning, from each


def test_lines_in_other_shapes_keep_a_level() -> None:
    levels = LineLevels()
    torch_line = (
        "[rank0]:W1205 10:47:46.077000 7548 torch/_dynamo/convert_frame.py:1016] "
        "recompile limit reached"
    )
    assert levels(torch_line) == (
        logging.WARNING,
        "[rank0] torch/_dynamo/convert_frame.py:1016: recompile limit reached",
    )
    assert levels("  a warning's source line") == (logging.WARNING, "  a warning's source line")
    assert levels("Traceback (most recent call last):")[0] == logging.ERROR
    assert levels('  File "x.py", line 1')[0] == logging.ERROR  # the traceback goes on
    assert levels("2026-12-05 10:47:29,523 INFO trainer: back") == (logging.INFO, "trainer: back")


def test_a_bad_log_level_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from infra.log_lines import level

    monkeypatch.setenv("ETT_LOG_LEVEL", "LOUD")
    with pytest.raises(ValueError, match="^ETT_LOG_LEVEL='LOUD' is not one of DEBUG, INFO"):
        level()
