"""infra/devstack/stack.py and infra/devstack/servers.py: the local stack of real servers (moto S3,
MLflow, Prefect)
starts, serves and stops; plus its fast failure paths."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from infra.devstack import servers, stack


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.status, resp.read()


def test_wait_healthy_times_out_with_the_log_tail(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("booting\nERROR: cannot bind\n")
    port = servers.free_port()
    with pytest.raises(TimeoutError, match="cannot bind"):
        servers.wait_healthy(f"http://127.0.0.1:{port}/health", timeout_s=0.5, log_path=log)


def test_a_server_that_exits_is_reported_at_once_with_its_log(tmp_path, monkeypatch):
    crash = [sys.executable, "-c", "print('boom: bad flag'); raise SystemExit(3)"]
    monkeypatch.setattr(servers, "_command", lambda *args: (crash, {}))
    service = servers.launch("prefect", tmp_path)
    # A StackError naming the exit code: seen as an exit, not waited out (that would be a
    # TimeoutError after timeout_s, without the code).
    with pytest.raises(servers.StackError, match="(?s)exited with code 3.*boom: bad flag"):
        servers.wait_ready(service, timeout_s=60)


def test_launch_refuses_a_busy_port_and_mlflow_without_s3(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        with pytest.raises(servers.StackError, match="in use"):
            servers.launch("s3", tmp_path, sock.getsockname()[1])
    with pytest.raises(servers.StackError, match="needs the s3 service"):
        servers.launch("mlflow", tmp_path)


def test_down_never_signals_a_process_that_reused_a_recorded_pid(tmp_path, capsys):
    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)  # not a moto server
    try:
        svc = {"name": "s3", "url": "http://127.0.0.1:1", "port": 1, "pid": sleeper.pid}
        record = {"bucket": "ett", "services": {"s3": svc | {"log": str(tmp_path / "s3.log")}}}
        (tmp_path / "stack.json").write_text(json.dumps(record))
        for argv in (["env", "--state-dir", str(tmp_path)], ["--state-dir", str(tmp_path), "env"]):
            assert stack.main(argv) == 0  # flags before or after the command
            assert "export AWS_ENDPOINT_URL_S3=http://127.0.0.1:1\n" in capsys.readouterr().out
        assert stack.status(tmp_path)["s3"]["running"] is False
        assert stack.down(tmp_path) == ["s3"]
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()


def test_env_has_local_settings_only():
    st = stack.Stack(
        state_dir="/x",
        s3_endpoint="http://127.0.0.1:1",
        mlflow_uri="http://127.0.0.1:2",
        prefect_api_url="http://127.0.0.1:3/api",
    )
    env = st.env()
    assert env["AWS_ENDPOINT_URL_S3"] == env["ETT_STORAGE__S3_ENDPOINT_URL"] == "http://127.0.0.1:1"
    assert env["AWS_ACCESS_KEY_ID"] == "testing"
    assert env["ETT_STORAGE__ROOT"].startswith("s3://ett/")
    assert env["MLFLOW_TRACKING_URI"] == env["ETT_TRACKING__MLFLOW_URI"] == "http://127.0.0.1:2"
    assert env["PREFECT_API_URL"] == "http://127.0.0.1:3/api"
    assert st.prefect_ui_url == "http://127.0.0.1:3"
    assert "AWS_ACCESS_KEY_ID" not in stack.Stack(state_dir="/x").env()


@pytest.mark.slow
def test_stack_up_serves_s3_mlflow_prefect_and_down_stops_them(tmp_path):
    state = tmp_path / "stack"
    booting = ThreadPoolExecutor(1).submit(stack.up, state)  # servers boot while we import
    try:
        import s3fs
        from mlflow.tracking import MlflowClient
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.actions import WorkPoolCreate
        from prefect.settings import PREFECT_API_URL, temporary_settings

        st = booting.result()
        assert set(st.services) == set(servers.SERVICES)
        for name, svc in st.services.items():
            assert _get(svc.url + servers.HEALTH_PATHS[name])[0] == 200, name
        recorded = (state / "stack.json").read_text()
        assert "testing" not in recorded and "SECRET" not in recorded.upper()
        assert {s: r["healthy"] for s, r in stack.status(state).items()} == dict.fromkeys(
            servers.SERVICES, True
        )

        # S3: an object written through s3fs reads back.
        fs = s3fs.S3FileSystem(
            key="testing",
            secret="testing",
            client_kwargs={"endpoint_url": st.s3_endpoint, "region_name": "us-east-1"},
            skip_instance_cache=True,
        )
        fs.pipe_file("ett/smoke/hello.txt", b"hello s3")
        assert fs.cat_file("ett/smoke/hello.txt") == b"hello s3"

        # MLflow: an artifact logged through the server lands in the S3 bucket.
        client = MlflowClient(tracking_uri=st.mlflow_uri)
        run = client.create_run(client.create_experiment("stack-smoke"))
        client.log_metric(run.info.run_id, "loss", 0.5)
        client.log_text(run.info.run_id, "hello mlflow", "notes/hello.txt")
        client.set_terminated(run.info.run_id)
        keys = fs.find("ett/mlflow-artifacts")
        hits = [k for k in keys if run.info.run_id in k and k.endswith("notes/hello.txt")]
        assert hits, keys
        assert fs.cat_file(hits[0]) == b"hello mlflow"

        # Prefect: health, and the API lists (and stores) work pools.
        status, body = _get(st.prefect_api_url + "/health")
        assert status == 200 and json.loads(body) is True
        with (
            temporary_settings(updates={PREFECT_API_URL: st.prefect_api_url}),
            get_client(sync_client=True) as prefect,
        ):
            prefect.create_work_pool(WorkPoolCreate(name="stack-smoke", type="process"))
            assert "stack-smoke" in [p.name for p in prefect.read_work_pools()]
    finally:
        booting.exception()  # let up() finish (or clean up after itself) before down()
        stopped = stack.down(state)

    assert sorted(stopped) == sorted(servers.SERVICES)
    assert not (state / "stack.json").exists()
    for svc in st.services.values():
        assert not servers.group_alive(svc.pid), svc.name
        with pytest.raises(ProcessLookupError):
            os.kill(svc.pid, 0)
