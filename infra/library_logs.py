"""Library output a user of this product never needs: at DEBUG, once per job, at its source.

Two kinds, one place:

- **Dumps.** At INFO, TorchRec prints its sharding planner's report (~100 lines of a ``#``
  box) and FBGEMM prints each embedding table's kernel arguments (``[TBE=...]``) and each
  library it loads through the root logger, on every rank and every attempt: most of a short
  job's log. ``LibraryDumps`` relabels those records DEBUG at the handlers, so they show only
  when the root logger is at DEBUG, and TorchRec's FutureWarnings about its own internals are
  silenced.
- **Noise** (``NOISE``): known single lines, most at WARNING, that are about a library, not
  the job: TorchRec's topology and storage-reservation warnings, ``is_fx_tracing``, the
  ShardedTensor FutureWarnings, aiobotocore's "Found credentials", MLflow's and Prefect's
  own start-up lines, the duplicate "Task run failed with state" of a failed attempt (its
  "Finished in state Failed(...)" line says the same). Each becomes one DEBUG record the
  first time it comes up in the process that speaks for the job (rank 0 of attempt 0, the
  orchestrator), and is dropped everywhere else: every rank, standby and relaunch would
  print it again. A filter on the logger that makes it, so it is caught before any handler
  (torch's and MLflow's loggers have their own); Python warnings get there through
  ``logging.captureWarnings`` (logger ``py.warnings``), which ``infra/log_lines.configure``
  turns on.

Prefect's first-run telemetry notice is a print, not a record: ``quiet_libraries`` opts the
process out of Prefect's client telemetry (``DO_NOT_TRACK=1``) unless the user set it.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from dataclasses import dataclass

DUMP_LOGGERS = ("torchrec", "fbgemm_gpu")
# FBGEMM logs these through the root logger: its table arguments, and each library it loads.
DUMP_PREFIXES = ("[TBE=", "Successfully loaded: 'fbgemm_gpu")


@dataclass(frozen=True)
class Noise:
    """A library line that says nothing about the job: made by ``logger``, matching
    ``pattern`` (searched in the formatted message)."""

    logger: str
    pattern: str

    def matches(self, record: logging.LogRecord) -> bool:
        return re.search(self.pattern, record.getMessage()) is not None


NOISE: tuple[Noise, ...] = (
    # TorchRec's planner, once per process: about how it was called, not about the plan.
    Noise("torchrec.distributed.planner.types", r"topology was constructed directly"),
    Noise("torchrec.distributed.planner.storage_reservations", r"known issue with TorchRec"),
    # torch, once per process that compiles or exports.
    Noise("torch.fx._symbolic_trace", r"^is_fx_tracing will return true"),
    Noise("py.warnings", r"deprecating ShardedTensor"),
    Noise("py.warnings", r"torch\.distributed is disabled, unavailable or uninitialized"),
    # MLflow: the serving wrapper's predict() has no type hints by design (publish/), and
    # the SQLite store's schema set-up.
    Noise("py.warnings", r"Add type hints to the `predict` method"),
    Noise("mlflow.store.db.utils", r"(Creating initial MLflow database tables|Updating database)"),
    Noise("mlflow.pyfunc", r"^Validating input example against model signature"),
    # Storage credentials found where the user put them.
    Noise("aiobotocore.credentials", r"^Found credentials"),
    Noise("botocore.credentials", r"^Found credentials"),
    # Prefect: its temporary server's banner, and a failed task's state said twice.
    Noise("prefect", r"^(Starting|Stopping) temporary server"),
    Noise("prefect.task_runs", r"^Task run failed with state: "),
)


def is_dump(record: logging.LogRecord) -> bool:
    if record.name.split(".", 1)[0] in DUMP_LOGGERS:
        return True
    return record.name == "root" and str(record.msg).startswith(DUMP_PREFIXES)


class LibraryDumps(logging.Filter):
    """A handler filter: library dumps at INFO or below become DEBUG records."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO or not is_dump(record):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger().isEnabledFor(logging.DEBUG)


class LibraryNoise(logging.Filter):
    """A logger filter for ``NOISE``: the first matching record of each rule becomes DEBUG
    in the job's first process (``first_of_job``); every other one is dropped."""

    def __init__(self, rules: tuple[Noise, ...], first_of_job: bool) -> None:
        super().__init__()
        self.rules, self.first_of_job = rules, first_of_job
        self.seen: set[Noise] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info is not None and record.exc_info[0] is None:
            record.exc_info = None  # logged "with exc_info" where there was none: "NoneType: None"
        rule = next((r for r in self.rules if r.matches(record)), None)
        if rule is None:
            return True
        if not self.first_of_job or rule in self.seen:
            return False
        self.seen.add(rule)
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger().isEnabledFor(logging.DEBUG)  # the process's level


def quiet_library_dumps() -> None:
    """Install the dump filter on every handler of the root logger (call after basicConfig)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, LibraryDumps) for f in handler.filters):
            handler.addFilter(LibraryDumps())
    if not logging.getLogger().isEnabledFor(logging.DEBUG):
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torchrec(\.|$)")


def quiet_library_noise(first_of_job: bool = True) -> None:
    """Install ``LibraryNoise`` on each logger that ``NOISE`` names (again: replaced)."""
    by_logger: dict[str, list[Noise]] = {}
    for rule in NOISE:
        by_logger.setdefault(rule.logger, []).append(rule)
    for name, rules in by_logger.items():
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, LibraryNoise)]:
            logger.removeFilter(old)
        logger.addFilter(LibraryNoise(tuple(rules), first_of_job))


def quiet_libraries(first_of_job: bool = True) -> None:
    """Everything above for this process; ``first_of_job``: whether it shows each noise line
    once at DEBUG (rank 0 of attempt 0, the orchestrator) or drops them all."""
    os.environ.setdefault("DO_NOT_TRACK", "1")  # Prefect's first-run telemetry notice
    quiet_library_dumps()
    quiet_library_noise(first_of_job)
