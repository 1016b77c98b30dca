"""Library dumps at DEBUG, so a job's log at INFO says what a user needs: steps,
checkpoints, failures.

At INFO, TorchRec prints its sharding planner's report (~100 lines of a ``#`` box) and FBGEMM
prints each embedding table's kernel arguments (``[TBE=...]``) and each library it loads
through the root logger, on every rank and every attempt: most of a short job's log.
``quiet_library_dumps`` relabels those records DEBUG at the handlers, so they show only when
the root logger is at DEBUG, and silences TorchRec's FutureWarnings about its own internals.
"""

from __future__ import annotations

import logging
import warnings

DUMP_LOGGERS = ("torchrec", "fbgemm_gpu")
# FBGEMM logs these through the root logger: its table arguments, and each library it loads.
DUMP_PREFIXES = ("[TBE=", "Successfully loaded: 'fbgemm_gpu")


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


def quiet_library_dumps() -> None:
    """Install the filter on every handler of the root logger (call after basicConfig)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, LibraryDumps) for f in handler.filters):
            handler.addFilter(LibraryDumps())
    if not logging.getLogger().isEnabledFor(logging.DEBUG):
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"torchrec(\.|$)")
