"""Shared fixtures. Servers (S3, MLflow, Prefect) are real processes on loopback with free
ports, started once per session by tests/servers.py and stopped at the end."""

from __future__ import annotations

import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

from tests.servers import mlflow_server, prefect_server, s3_server  # noqa: E402,F401
