"""Shared fixtures. Servers (S3, MLflow, Prefect) are real processes on loopback with free
ports, started once per session by tests/servers.py and stopped at the end."""

from __future__ import annotations

import os
from collections import Counter

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402

from tests.servers import (  # noqa: E402,F401
    STACK_FIXTURES,
    mlflow_server,
    prefect_server,
    s3_server,
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest modules first: `make test` hands whole modules to its two pytest-xdist workers
    (``--dist loadfile``: a module-scoped fixture is built once and a module's tests keep
    their order), and starting the long ones first leaves no long one alone at the end.
    Longest: those with a test that needs the MLflow or Prefect server, then by their number
    of ``slow`` tests. The order within a module is kept."""

    def module(item: pytest.Item) -> str:
        return item.nodeid.split("::", 1)[0]

    stack = {
        module(item)
        for item in items
        if set(STACK_FIXTURES) & set(getattr(item, "fixturenames", ()))
    }
    slow = Counter(module(item) for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: (module(item) not in stack, -slow[module(item)]))
