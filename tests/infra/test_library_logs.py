"""infra/library_logs.py: TorchRec's and FBGEMM's dumps only show at DEBUG; library noise is
DEBUG once per job, at its source."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

from infra.library_logs import NOISE, LibraryNoise, quiet_library_dumps, quiet_library_noise


@pytest.fixture
def root_stream() -> Iterator[io.StringIO]:
    """The root logger writing to a string, as trainer/train.py sets it up (basicConfig)."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    stream = io.StringIO()
    root.handlers = [logging.StreamHandler(stream)]
    try:
        yield stream
    finally:
        root.handlers, root.level = saved


def _emit() -> None:
    logging.getLogger("torchrec.distributed.planner.stats").info("# Parameter Info: ...")
    logging.info("[TBE=a30e] SplitTableBatchedEmbeddingBagsCodegen Arguments: {...}")
    logging.getLogger("torchrec.distributed.planner").warning("planner: no plan fits memory")
    logging.getLogger("trainer").info("step 5/20 loss 0.70")


def test_dumps_are_dropped_at_info(root_stream: io.StringIO) -> None:
    logging.getLogger().setLevel(logging.INFO)
    quiet_library_dumps()
    _emit()
    assert root_stream.getvalue().splitlines() == [
        "planner: no plan fits memory",  # a library's warning still shows
        "step 5/20 loss 0.70",
    ]


def test_dumps_show_at_debug_as_debug(root_stream: io.StringIO) -> None:
    logging.getLogger().setLevel(logging.DEBUG)
    root_stream.seek(0)
    logging.getLogger().handlers[0].setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    quiet_library_dumps()
    _emit()
    lines = root_stream.getvalue().splitlines()
    assert "DEBUG # Parameter Info: ..." in lines
    assert any(line.startswith("DEBUG [TBE=a30e]") for line in lines)
    assert "INFO step 5/20 loss 0.70" in lines


# Lines as the demo printed them before they were noise (docs/logging.md), by their logger.
NOISE_LINES = {
    "torchrec.distributed.planner.types": "The topology was constructed directly rather than "
    "via TopologyFactory.create_topology(). Please use TopologyFactory",
    "torchrec.distributed.planner.storage_reservations": "There is a known issue with "
    "TorchRec's dense tensor size calculation in dry run scenarios",
    "torch.fx._symbolic_trace": "is_fx_tracing will return true for both fx.symbolic_trace "
    "and torch.export.",
    "py.warnings": "/x/planner_helpers.py:489: FutureWarning: Please use DTensor instead and "
    "we are deprecating ShardedTensor.\n  device = getattr(value, 'device', None)\n",
    "aiobotocore.credentials": "Found credentials in environment variables.",
    "prefect": "Starting temporary server on http://127.0.0.1:8486\nSee https://www.prefect.io",
    "prefect.task_runs": "Task run failed with state: Failed(message='attempt 0 failed: "
    "sigkill at step 299 (killed by SIGKILL (137))', type=FAILED)",
}


def _record(name: str, msg: str, level: int = logging.WARNING, **kw: object) -> logging.LogRecord:
    return logging.makeLogRecord({"name": name, "msg": msg, "levelno": level, **kw})


def _noise_filter(name: str, first_of_job: bool) -> LibraryNoise:
    return LibraryNoise(tuple(r for r in NOISE if r.logger == name), first_of_job)


def test_each_noise_line_is_debug_once_in_the_jobs_first_process() -> None:
    root = logging.getLogger()
    saved = root.level
    root.setLevel(logging.DEBUG)  # shown at DEBUG when asked for (ett -v, ETT_LOG_LEVEL)
    try:
        for name, text in NOISE_LINES.items():
            first, other = _noise_filter(name, True), _noise_filter(name, False)
            record = _record(name, text)
            assert first.filter(record) and record.levelname == "DEBUG", name
            assert not first.filter(_record(name, text)), name  # once
            assert not other.filter(_record(name, text)), name  # another rank: never
            assert first.filter(_record(name, "a line about the job")), name
    finally:
        root.setLevel(saved)


def test_noise_is_dropped_at_info() -> None:
    for name, text in NOISE_LINES.items():
        assert not _noise_filter(name, True).filter(_record(name, text)), name


def test_a_record_logged_with_exc_info_but_no_exception_has_no_stray_traceback() -> None:
    """Prefect logs a failed state "with exc_info" where no exception is active; formatted
    as is, that is a line "NoneType: None"."""
    record = _record("prefect.task_runs", "Finished in state Failed('x')", logging.ERROR)
    record.exc_info = (None, None, None)
    assert _noise_filter("prefect.task_runs", True).filter(record)
    assert logging.Formatter("%(message)s").format(record) == "Finished in state Failed('x')"


def test_quiet_libraries_installs_one_filter_per_noisy_logger() -> None:
    loggers = [logging.getLogger(name) for name in {r.logger for r in NOISE}]
    saved = {log.name: list(log.filters) for log in loggers}  # flows/__init__ installs them
    quiet_library_noise(first_of_job=False)
    quiet_library_noise(first_of_job=True)  # again: replaced, not stacked
    try:
        for log in loggers:
            filters = [f for f in log.filters if isinstance(f, LibraryNoise)]
            assert len(filters) == 1 and filters[0].first_of_job, log.name
    finally:
        for log in loggers:
            log.filters[:] = saved[log.name]
