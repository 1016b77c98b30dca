"""Shared fixtures. Servers (S3, MLflow, Prefect) are real processes on loopback with free
ports, started once per session by tests/servers.py and stopped at the end."""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Iterator

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# The test servers (which inherit this environment) retry a flow run that waits for its
# deployment's concurrency slot (publish: one at a time, ENQUEUE) after 2 s, not Prefect's
# default 30 s: the wait is what the tests check, not its length.
os.environ.setdefault("PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS", "2")

import pytest  # noqa: E402

from infra import memory_tier  # noqa: E402
from tests.factories import tiny_config, write_dataset  # noqa: E402
from tests.servers import (  # noqa: E402,F401
    STACK_FIXTURES,
    mlflow_server,
    prefect_server,
    s3_server,
)

# The longest modules, longest first, by their seconds under `make test` (2 workers on 2
# shared cores, 2026-12-02, the last full run). Only the order matters: see below.
LONGEST = (
    "tests/reliability/test_multi_host.py",  # 180 s
    "tests/flows/test_deployments.py",  # 122 s
    "tests/flows/test_e2e.py",  # 115 s
    "tests/flows/test_cli.py",  # 100 s
    "tests/trainer/test_exact_resume.py",  # 98 s
    "tests/trainer/checkpoint/test_s3.py",  # 91 s
    "tests/reliability/test_storage_faults.py",  # 84 s
    # Long ones with no `slow` test, which the rule below would leave for the end (measured
    # alone, 2026-12-05): the agent pool 47 s, the node fleet 49 s (mostly waiting).
    "tests/tasks/test_node_fleet.py",
    "tests/tasks/test_agent_pool.py",
)


@pytest.fixture(autouse=True)
def no_memory_tier_left(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """Fails a test that leaves an in-memory checkpoint segment of its jobs in /dev/shm
    (and removes it). A segment is the test's if it appeared meanwhile and its job lives
    under this worker's temp folder, or on object storage when the test uses the S3 server
    (under pytest-xdist the other worker's S3 jobs run meanwhile, with segments of their
    own). A segment with no valid header after a second (torn, or still being written)
    names no job, so it cannot be told from the other worker's (its torn-copy tests make
    them on purpose): it is neither blamed nor removed here."""
    before = set(memory_tier.job_segments_all())
    yield
    uses_s3 = "s3_server" in request.fixturenames
    base, left = str(tmp_path_factory.getbasetemp()), []
    for path in sorted(set(memory_tier.job_segments_all()) - before):
        try:
            url = memory_tier.job_url_of(path, wait_s=1.0)
        except FileNotFoundError:  # removed meanwhile, by whoever owned it
            continue
        if url is None:
            continue
        if base in url or (uses_s3 and not url.startswith("file://")):
            left.append(os.path.basename(path))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    assert not left, f"in-memory checkpoint segments left in /dev/shm: {left}"


@pytest.fixture(scope="session")
def data_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One small data set for every test that trains on any (seconds to write, the same rows
    whoever writes them); a module may override it (its own data on S3, say)."""
    config = tiny_config(tmp_path_factory.mktemp("data"))
    write_dataset(config)
    return config.data.url


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest modules first: `make test` hands whole modules to its two pytest-xdist workers
    (``--dist loadfile``: a module-scoped fixture is built once and a module's tests keep
    their order) in this order (``--no-loadscope-reorder``: by default pytest-xdist 3.8 hands
    out the modules with the most tests first, and the long ones, which have few, came last
    and left one worker alone at the end). Each worker takes the next module when it is
    almost done, so starting the long ones first leaves only short ones for the end.
    Longest: those of LONGEST, then those with a test that needs the MLflow or Prefect
    server, then by their number of ``slow`` tests. The order within a module is kept."""

    def module(item: pytest.Item) -> str:
        return item.nodeid.split("::", 1)[0]

    stack = {
        module(item)
        for item in items
        if set(STACK_FIXTURES) & set(getattr(item, "fixturenames", ()))
    }
    slow = Counter(module(item) for item in items if item.get_closest_marker("slow"))
    rank = {name: n for n, name in enumerate(LONGEST)}
    items.sort(
        key=lambda item: (
            rank.get(module(item), len(rank)),
            module(item) not in stack,
            -slow[module(item)],
        )
    )
