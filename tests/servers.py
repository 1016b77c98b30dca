"""Session-scoped fixtures that run the real local servers of infra/devstack/servers.py for tests.

Import them into tests/conftest.py:

    from tests.servers import mlflow_server, prefect_server, s3_server  # noqa: F401

- ``s3_server`` -> the S3 endpoint URL (moto, bucket ``ett`` created). While it is active the
  AWS_* variables (dummy credentials, AWS_ENDPOINT_URL_S3, MLFLOW_S3_ENDPOINT_URL) are set,
  so s3fs, boto3, infra.storage and subprocesses use it; they are restored afterwards.
- ``mlflow_server`` -> the tracking URI (artifacts proxied to ``s3://ett/mlflow-artifacts``);
  depends on ``s3_server``. Nothing global is set: pass the URI on (MlflowClient(uri),
  config.tracking.mlflow_uri).
- ``prefect_server`` -> the API URL (``http://127.0.0.1:PORT/api``) of ``prefect server
  start`` (scheduler and triggers run); PREFECT_API_URL is set in os.environ (for
  subprocesses: workers, ``prefect deploy``) and in Prefect's in-process settings, and both
  are restored afterwards.

Each server runs once per session on a free 127.0.0.1 port with its state and logs in one
pytest tmp dir (``servers0/<name>.log``), and is stopped at the end of the session. Servers
boot slowly on 2 cores, so when the first one is needed, every server that any selected
test uses is launched at once and they boot in parallel (under pytest-xdist: those the
worker's tests are likely to need, see ``_wanted``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.devstack import servers

STARTUP_TIMEOUT_S = 240.0  # generous: 2 shared cores
_NEEDS = {"s3_server": ("s3",), "mlflow_server": ("s3", "mlflow"), "prefect_server": ("prefect",)}
# The heavy servers: under pytest-xdist, a worker boots them only once one of its tests needs
# one; S3 (moto) is light and starts wherever a test needs it.
STACK_FIXTURES = ("mlflow_server", "prefect_server")


class _Servers:
    """The servers launched for this session; each fixture waits for its own once."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.launched: dict[str, servers.Service] = {}

    def launch(self, name: str) -> servers.Service:
        if name not in self.launched:
            s3 = self.launched.get("s3")
            self.launched[name] = servers.launch(
                name, self.state_dir, s3_endpoint=s3.url if s3 else None
            )
        return self.launched[name]

    def ready(self, name: str) -> servers.Service:
        service = self.launch(name)
        servers.wait_ready(service, STARTUP_TIMEOUT_S)
        return service

    def stop_all(self) -> None:
        servers.stop([s.pid for s in self.launched.values()])


_SERVERS = pytest.StashKey[_Servers]()


def _servers(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, fixture: str
) -> _Servers:
    """The session's servers; launches, all at once, every server that the tests which will
    run in this process need, so that they boot in parallel (see ``_wanted``).

    (A session stash rather than a fixture, so conftest imports only the public fixtures.)
    The first fixture set up is torn down last, so its finalizer stops them all."""
    stash = request.session.stash
    if _SERVERS not in stash:
        stash[_SERVERS] = _Servers(tmp_path_factory.mktemp("servers"))
        request.addfinalizer(stash[_SERVERS].stop_all)
    wanted = _wanted(request.session.items, fixture)
    for name in servers.SERVICES:  # s3 first: mlflow's artifact store
        if name in wanted:
            stash[_SERVERS].launch(name)
    return stash[_SERVERS]


def _needs(item: pytest.Item) -> set[str]:
    names = getattr(item, "fixturenames", ())
    return {server for fixture, need in _NEEDS.items() if fixture in names for server in need}


def _wanted(items: list[pytest.Item], fixture: str) -> set[str]:
    """Every server the selected tests need. Under pytest-xdist each worker is a session of
    its own and runs only some modules: ``fixture``'s needs, and when it is a stack server
    those of every test that uses one (the worker will likely run more of them)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return {server for item in items for server in _needs(item)}
    if fixture not in STACK_FIXTURES:
        return set(_NEEDS[fixture])
    stack = [item for item in items if _needs(item) & {"mlflow", "prefect"}]
    return {server for item in stack for server in _needs(item)}


def _clear_s3fs_cache() -> None:
    # fsspec caches filesystem instances by their arguments: one made before the env
    # changed would keep talking to the old endpoint.
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="session")
def s3_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The endpoint URL of a moto S3 server holding the bucket ``ett``."""
    url = _servers(request, tmp_path_factory, "s3_server").ready("s3").url
    env = servers.LOCAL_AWS_ENV | {"AWS_ENDPOINT_URL_S3": url, "MLFLOW_S3_ENDPOINT_URL": url}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        for key in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN"):
            mp.delenv(key, raising=False)  # a real profile or token must not mix in
        _clear_s3fs_cache()
        yield url
        _clear_s3fs_cache()


@pytest.fixture(scope="session")
def mlflow_server(
    s3_server: str, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> str:
    """The tracking URI of an MLflow server (SQLite backend, artifacts in s3://ett)."""
    return _servers(request, tmp_path_factory, "mlflow_server").ready("mlflow").url


@pytest.fixture(scope="session")
def prefect_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The API URL of a real Prefect server; PREFECT_API_URL points at it meanwhile.

    The settings are also made process-global, as prefect_test_harness does: Prefect's
    background services (the API log worker, the events worker) run in threads that do not
    inherit this context, and without it they would start an ephemeral server of their own."""
    api_url = _servers(request, tmp_path_factory, "prefect_server").ready("prefect").url + "/api"
    with prefect_api(api_url):
        yield api_url


@contextlib.contextmanager
def prefect_api(api_url: str) -> Iterator[None]:
    """PREFECT_API_URL points at ``api_url`` meanwhile, in os.environ and in Prefect's
    process-global settings (see ``prefect_server``)."""
    import prefect.context
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with (
        pytest.MonkeyPatch.context() as mp,
        temporary_settings(updates={PREFECT_API_URL: api_url}),
        prefect.context._temporary_global_settings_context(prefect.context.get_settings_context()),
    ):
        mp.setenv("PREFECT_API_URL", api_url)
        yield
        APILogWorker.drain_all(timeout=10)  # before the server stops
