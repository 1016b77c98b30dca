"""The orchestrator's logger: Prefect's run logger inside a flow or task run (so lines reach
the run's logs in the UI), a plain logger outside one (the CLI, tests, benchmarks)."""

from __future__ import annotations

import logging

from prefect import get_run_logger
from prefect.exceptions import MissingContextError


def logger() -> logging.Logger | logging.LoggerAdapter[logging.Logger]:
    """The Prefect run logger inside a flow/task run, a plain logger outside one."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("ett.orchestrator")
