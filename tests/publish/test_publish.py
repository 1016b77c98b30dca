"""Publishing a real 2-rank anchor checkpoint from one CPU process into a real MLflow server.

Servers: MLflow (SQLite backend, artifacts proxied to moto S3) from tests/servers.py. The
tests share one registered model and run in file order: the first publish makes the
champion, later ones are checked against it. What needs neither a server nor a trained
model (the promotion comparison, the validation bounds, a manifest that does not match the
request) is in the fast tier: tests/publish/test_gate.py.
"""

from __future__ import annotations

import dataclasses
import email.parser
import importlib.metadata
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import zipfile
from pathlib import Path

import mlflow
import numpy as np
import pytest
import torch
import yaml
from mlflow import MlflowClient
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from infra import storage
from infra.accounting.ledger_format import PUBLISH_SPANS
from infra.accounting.ledger_read import read_events
from infra.checkpoint_manifest import MANIFEST, CommittedCheckpoint, read_manifest
from infra.job_layout import JobLayout
from infra.tracking import logged_models
from publish import registry, serving
from publish.load import resolve
from publish.pipeline import publish
from publish.settings import PublishError
from tests.factories import ROOT
from tests.publish.conftest import TrainedJob, _copy_tree
from trainer.checkpoint.restore import load_into
from trainer.data.sequential import holdout_batches
from trainer.holdout_metrics import predict
from trainer.model import RankingModel

pytestmark = pytest.mark.slow

HOLDOUT_ROWS = 1000
# 20 tiny steps do not calibrate a model tightly; the bound under test is set per test.
SETTINGS = {"holdout_rows": HOLDOUT_ROWS, "calibration_ratio": 3.0}


@pytest.fixture(autouse=True)
def worker_env(trained_job: TrainedJob, monkeypatch: pytest.MonkeyPatch) -> None:
    """This test process is the publishing worker: its MLflow is the test server (S3 comes
    from the s3_server fixture's AWS_* variables)."""
    monkeypatch.setenv("ETT_TRACKING__MLFLOW_URI", trained_job.tracking_uri)


def _versions(job: TrainedJob) -> list:
    return MlflowClient(job.tracking_uri).search_model_versions(f"name = '{job.registered_model}'")


def _trainer_side_probs(job: TrainedJob, url: str) -> tuple[np.ndarray, list]:
    """What the trainer's eval predicts for the holdout rows, with the model loaded the
    trainer's way (restore.load_into, one process) -- independent of publish/."""
    config = job.config
    model = RankingModel(config.data, config.model)
    state = {"model": model.state_dict()}
    load_into(CommittedCheckpoint(url, read_manifest(url)), state, 0, None, no_dist=True)
    model.load_state_dict(state["model"])
    batches = holdout_batches(config.data, 0, 1, HOLDOUT_ROWS, config.data.eval_batch_size)
    return predict(model, batches, torch.device("cpu")).numpy(), batches


def _job_logged_model(job: TrainedJob) -> str:
    """What logging the job did for its anchor (infra/tracking/mlflow_runs.log_job_report):
    its LoggedModel on the training run, at its step. Returns its id."""
    client = MlflowClient(job.tracking_uri)
    run = client.get_run(job.training_run_id)
    manifest = storage.read_text(storage.join(job.s3_anchor_url, MANIFEST))
    ckpt = logged_models.checkpoint_model(job.s3_anchor_url, manifest)
    model = logged_models.ensure_model(client, run.info.experiment_id, ckpt, job.training_run_id)
    return model.model_id


@pytest.fixture(scope="module")
def published(trained_job: TrainedJob) -> dict:
    """The S3 copy of the 2-rank anchor, published by ``python -m publish`` in a fresh
    single CPU process (no torchrun, no process group, no GPU), after the job's logging made
    its LoggedModel."""
    job = trained_job
    model_id = _job_logged_model(job)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        CUDA_VISIBLE_DEVICES="",
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        ETT_TRACKING__MLFLOW_URI=job.tracking_uri,  # the worker's MLflow
    )
    cmd = [
        sys.executable,
        "-m",
        "publish",
        "--uri",
        job.s3_anchor_url,
        "--step",
        "20",
        "--job-id",
        job.config.job_id,
        "--mlflow-run-id",
        job.training_run_id,
        "--holdout-rows",
        str(HOLDOUT_ROWS),
        "--calibration-ratio",
        "3.0",
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    logging.getLogger(__name__).info("python -m publish: %.1f s", time.perf_counter() - start)
    return {**json.loads(proc.stdout), "job_model_id": model_id}


def test_two_rank_anchor_is_published_from_one_cpu_process(
    trained_job: TrainedJob, published: dict
) -> None:
    job = trained_job
    assert read_manifest(job.s3_anchor_url).world_size == 2
    assert read_manifest(job.s3_anchor_url).anchor
    assert published["already_published"] is False
    assert published["promoted"] is True  # the first version becomes the champion
    assert set(published["aliases"]) == {"candidate", "champion"}
    metrics = published["metrics"]
    assert metrics["publish/parity_max_abs_diff"] <= 1e-5
    assert 0.0 < metrics["publish/holdout_auc"] <= 1.0
    assert metrics["publish/holdout_rows"] == HOLDOUT_ROWS

    client = MlflowClient(job.tracking_uri)
    version = client.get_model_version(job.registered_model, published["version"])
    # Five tags; the rest of what identifies the anchor is on its LoggedModel.
    assert set(version.tags) == set(registry.VERSION_TAGS)
    assert version.tags["step"] == "20" and version.tags["job_id"] == job.config.job_id
    assert version.tags["anchor_key"] == resolve(job.s3_anchor_url).key
    assert version.tags["publish_status"] == "complete" and version.tags["promoted"] == "true"
    # The description opens with the decision, then one paragraph.
    first, _, rest = version.description.partition("\n\n")
    assert first == "promoted to champion: first version" == published["gate"]["reason"]
    assert f"first {HOLDOUT_ROWS} holdout rows" in rest and "step 20" in rest
    # Registered from the model the job's logging made: the training run's LoggedModel at the
    # anchor's step, so MLflow records the lineage to the training run itself.
    model_id = published["job_model_id"]
    assert version.source == f"models:/{model_id}" and published["model_id"] == model_id
    assert version.run_id == job.training_run_id
    model = client.get_logged_model(model_id)
    assert model.name == f"ranker-{job.config.job_id}-step-20"
    assert model.source_run_id == job.training_run_id
    training = client.get_run(job.training_run_id)
    assert [(o.model_id, o.step) for o in training.outputs.model_outputs] == [(model_id, 20)]
    params = model.params
    assert params["anchor_uri"] == job.s3_anchor_url and params["anchor_world_size"] == "2"
    assert params["anchor_key"] == version.tags["anchor_key"]
    assert params["training_run_id"] == job.training_run_id
    assert params["publish_run_id"] == published["publish_run_id"]
    assert params["anchor_manifest_sha256"] == resolve(job.s3_anchor_url).manifest_sha256
    assert "mlflow.model.isExternal" not in model.tags  # it holds the served model now
    assert json.loads(model.tags["ett.gate"]) == published["gate"]
    listed = json.loads(model.tags["mlflow.modelVersions"])
    assert {"name": job.registered_model, "version": int(version.version)} in listed
    # The publish run: nested under the training run, the model its input, the gate's metrics
    # logged with the model's id (so the model's page has them, with their rows).
    publish_run = client.get_run(published["publish_run_id"])
    assert publish_run.data.tags["mlflow.parentRunId"] == job.training_run_id
    assert publish_run.info.status == "FINISHED"
    assert publish_run.data.tags["mlflow.source.git.commit"]
    assert [i.model_id for i in publish_run.inputs.model_inputs] == [model_id]
    assert not publish_run.outputs or not publish_run.outputs.model_outputs
    on_model = {m.key: m for m in model.metrics}
    assert on_model["publish/holdout_auc"].value == metrics["publish/holdout_auc"]
    assert on_model["publish/holdout_auc"].dataset_name == f"holdout[:{HOLDOUT_ROWS}]"
    assert set(on_model) == set(metrics)
    gate = published["gate"]
    assert gate["champion_version"] is None and gate["promoted"] is True
    assert gate["candidate_auc"] == pytest.approx(metrics["publish/holdout_auc"], abs=1e-4)

    # The publisher's own spans, in the job's ledger next to the S3 anchor.
    s3_job_url = job.s3_anchor_url.rsplit("/checkpoints/", 1)[0]
    spans = [e for e in read_events(JobLayout.at(s3_job_url)) if e.name in PUBLISH_SPANS]
    assert [e.name for e in spans] == list(PUBLISH_SPANS)
    assert all(e.attrs["ok"] and e.step == 20 for e in spans)
    assert storage.exists(f"{s3_job_url}/ledger/publish-attempt000-rank000.jsonl")


def test_champion_loads_from_registry_and_matches_trainer_eval(
    trained_job: TrainedJob, published: dict
) -> None:
    job = trained_job
    mlflow.set_tracking_uri(job.tracking_uri)
    champion = mlflow.pyfunc.load_model(f"models:/{job.registered_model}@champion")
    expected, batches = _trainer_side_probs(job, job.anchor_url)
    frames = [serving.batch_to_frame(b, job.config.data) for b in batches]
    served = np.concatenate([champion.predict(f)[serving.OUTPUT].to_numpy() for f in frames])
    assert served.shape == expected.shape == (HOLDOUT_ROWS,)
    assert np.abs(served - expected).max() <= 1e-5
    # A plain client request: JSON-style lists for the history column.
    one = serving.batch_to_frame(batches[0], job.config.data, as_lists=True).head(3)
    assert np.allclose(champion.predict(one)[serving.OUTPUT].to_numpy(), expected[:3], atol=1e-5)


# Run with ``python -S``: site-packages is added by hand, so the project's editable-install
# hook (a .pth file) is not run and the project's packages are not importable.
BARE_LOAD = """
import importlib.util, json, sys
sys.path.append(sys.argv[3])
import mlflow, pandas as pd
assert importlib.util.find_spec("publish") is None, "not a bare process"
model = mlflow.pyfunc.load_model(sys.argv[1])
frame = pd.DataFrame(json.loads(sys.argv[2]))
print(json.dumps(model.predict(frame)["probability"].tolist()))
"""


def test_champion_loads_in_a_fresh_bare_process(
    trained_job: TrainedJob, published: dict, tmp_path: Path
) -> None:
    """``models:/<name>@champion`` loads in a fresh process outside the repository (project
    neither on the path nor installed): it carries its code; weights load with weights_only
    (no pickled objects)."""
    job = trained_job
    expected, batches = _trainer_side_probs(job, job.anchor_url)
    rows = serving.batch_to_frame(batches[0], job.config.data, as_lists=True).head(5)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(MLFLOW_TRACKING_URI=job.tracking_uri, MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR="false")
    proc = subprocess.run(
        [
            sys.executable,
            "-S",
            "-c",
            BARE_LOAD,
            f"models:/{job.registered_model}@champion",
            rows.to_json(orient="columns", double_precision=15),
            sysconfig.get_paths()["purelib"],
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = np.array(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert np.abs(got - expected[:5]).max() <= 1e-5


def test_publishing_twice_yields_one_version(trained_job: TrainedJob, published: dict) -> None:
    job = trained_job
    before = len(_versions(job))
    again = publish(
        job.s3_anchor_url, step=20, mlflow_run_id=job.training_run_id, settings=SETTINGS
    )
    assert again.already_published and again.version == published["version"]
    assert again.aliases == sorted(published["aliases"])  # as registered, not "none"
    # The decision is not made again: it is read back from the model.
    assert again.gate == published["gate"] and again.model_id == published["model_id"]
    assert again.publish_run_id == published["publish_run_id"]
    key = resolve(job.s3_anchor_url).key
    same = MlflowClient(job.tracking_uri).search_model_versions(
        f"name = '{job.registered_model}' AND tags.anchor_key = '{key}'"
    )
    assert len(same) == 1 and len(_versions(job)) == before


def test_corrupt_anchor_registers_nothing(
    trained_job: TrainedJob, published: dict, tmp_path: Path
) -> None:
    job = trained_job
    src = storage.local_path(job.anchor_url)
    dst = tmp_path / "jobs" / "corrupt" / "checkpoints" / "step-000000020"
    shutil.copytree(src, dst)
    shard = sorted(dst.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    before = len(_versions(job))
    with pytest.raises(PublishError, match=rf"corrupt: checksum mismatch in {shard.name}"):
        publish(f"file://{dst}", settings=SETTINGS)
    assert len(_versions(job)) == before


def test_failed_calibration_registers_nothing(trained_job: TrainedJob, published: dict) -> None:
    job = trained_job
    before = len(_versions(job))
    with pytest.raises(PublishError, match="validation .* failed, nothing registered: miscalib"):
        publish(job.anchor_url, settings={**SETTINGS, "calibration_ratio": 1.0})
    assert len(_versions(job)) == before
    client = MlflowClient(job.tracking_uri)
    runs = client.search_runs(
        [client.get_experiment_by_name("publish-tests").experiment_id],
        f"tags.`ett.anchor_key` = '{resolve(job.anchor_url).key}'",
    )
    assert runs and all(r.info.status == "FAILED" for r in runs)
    assert "miscalibrated" in runs[0].data.tags["ett.publish_error"]


def test_nan_weights_register_nothing(
    trained_job: TrainedJob, published: dict, tmp_path: Path
) -> None:
    job = trained_job
    url = _nan_copy(job, tmp_path / "jobs" / "nan" / "checkpoints" / "step-000000020")
    before = len(_versions(job))
    with pytest.raises(PublishError, match="NaN or infinite"):
        publish(url, settings=SETTINGS)
    assert len(_versions(job)) == before


def test_worse_model_is_candidate_not_champion(trained_job: TrainedJob, published: dict) -> None:
    """An earlier checkpoint, with a margin no model can meet: registered, not promoted. Its
    job's run is not known (no run id, none tagged with its job): publishing makes its
    LoggedModel, on the publish run."""
    job = trained_job
    result = publish(
        job.step10_url,
        settings={**SETTINGS, "require_anchor": False, "champion_margin": -1.0},
    )
    assert not result.already_published and not result.promoted
    assert result.aliases == ["candidate"]
    client = MlflowClient(job.tracking_uri)
    champion = client.get_model_version_by_alias(job.registered_model, "champion")
    assert champion.version == published["version"]
    version = client.get_model_version(job.registered_model, result.version)
    assert set(version.tags) == set(registry.VERSION_TAGS) and version.tags["promoted"] == "false"
    gate = result.gate
    assert gate is not None and gate["promoted"] is False
    assert gate["champion_version"] == published["version"] and gate["margin"] == -1.0
    assert gate["champion_auc"] == pytest.approx(
        published["metrics"]["publish/holdout_auc"], abs=1e-4
    )
    assert gate["champion_logloss"] == pytest.approx(
        published["metrics"]["publish/holdout_logloss"], abs=1e-4
    )
    first = version.description.split("\n", 1)[0]
    assert first == gate["reason"]
    assert first.startswith(
        f"kept as candidate: AUC {gate['candidate_auc']:.4f} vs {gate['champion_auc']:.4f} "
        f"(champion v{published['version']}), short of the required gain 1"
    )
    model = client.get_logged_model(result.model_id)
    assert model.name == f"ranker-{job.config.job_id}-step-10"
    assert model.source_run_id == result.publish_run_id  # no training run to hang it on
    assert version.source == f"models:/{result.model_id}"


def test_interrupted_registration_is_completed_not_duplicated(
    trained_job: TrainedJob, published: dict, tmp_path: Path
) -> None:
    """A publisher died after creating its version (no aliases, not marked complete): the
    next publish of that anchor completes that version instead of adding another."""
    job = trained_job
    dst = tmp_path / "jobs" / "crashed" / "checkpoints" / "step-000000020"
    shutil.copytree(storage.local_path(job.anchor_url), dst)
    url = f"file://{dst}"
    key = resolve(url).key
    client = MlflowClient(job.tracking_uri)
    model_id = published["model_id"]  # the model the first publish registered
    left = client.create_model_version(
        job.registered_model,
        source=f"models:/{model_id}",
        model_id=model_id,
        tags={"anchor_key": key},
    )
    result = publish(url, settings=SETTINGS)
    assert result.version == left.version and "candidate" in result.aliases
    same = client.search_model_versions(
        f"name = '{job.registered_model}' AND tags.anchor_key = '{key}'"
    )
    assert [v.version for v in same] == [left.version]
    assert same[0].tags["publish_status"] == "complete"


def test_prefect_flow_publishes_once(
    trained_job: TrainedJob, published: dict, prefect_server: str, tmp_path: Path
) -> None:
    """The ``publish`` flow against a real Prefect server: every stage as a task, then the
    same event again (a duplicate trigger) returns the version registered the first time."""
    from prefect.settings import PREFECT_LOGGING_TO_API_ENABLED, temporary_settings

    from flows.publish_flow import publish_flow

    job = trained_job
    dst = tmp_path / "jobs" / job.config.job_id / "checkpoints" / "step-000000020"
    shutil.copytree(storage.local_path(job.anchor_url), dst)
    params = {
        "uri": f"file://{dst}",
        "step": 20,
        "job_id": job.config.job_id,
        "mlflow_run_id": job.training_run_id,
        "settings": SETTINGS,
    }
    # Flow logs stay local: the API log handler would retry against the server after the
    # session stopped it.
    with temporary_settings(updates={PREFECT_LOGGING_TO_API_ENABLED: False}):
        first = publish_flow(**params)
        again = publish_flow(**{**params, "mlflow_run_id": ""})  # a template's "missing"
    assert not first["already_published"] and "candidate" in first["aliases"]
    assert first["metrics"]["publish/parity_max_abs_diff"] <= 1e-5
    assert first["gate"]["reason"].startswith(("promoted to champion", "kept as candidate"))
    assert again["already_published"] and again["version"] == first["version"]
    assert first["gate"]["promoted"] == first["promoted"]
    assert again["gate"] == first["gate"]  # the earlier decision, read back from the model
    spans = [
        e.name
        for e in read_events(JobLayout.at(f"file://{dst.parents[1]}"))
        if e.name in PUBLISH_SPANS
    ]
    assert spans == list(PUBLISH_SPANS)


def _nan_copy(job: TrainedJob, dst: Path) -> str:
    """A committed copy of the anchor whose model weights are all NaN (valid checksums)."""
    import torch.distributed.checkpoint as dcp

    from infra.checkpoint_manifest import MANIFEST, FileEntry, Manifest
    from trainer.checkpoint.verify import sha256_file

    config = job.config
    model = RankingModel(config.data, config.model)
    state = {"model": model.state_dict()}
    src = job.anchor_url
    load_into(CommittedCheckpoint(src, read_manifest(src)), state, 0, None, no_dist=True)
    with torch.no_grad():
        for tensor in state["model"].values():
            if tensor.is_floating_point():
                tensor.fill_(float("nan"))
    dst.mkdir(parents=True)
    dcp.save(state, checkpoint_id=str(dst), no_dist=True)
    shutil.copy(os.path.join(storage.local_path(src), "config.yaml"), dst / "config.yaml")
    files = {
        p.name: FileEntry(p.stat().st_size, sha256_file(str(p))) for p in sorted(dst.iterdir())
    }
    original = read_manifest(src)
    manifest = Manifest(
        step=original.step,
        world_size=1,
        config_hash=original.config_hash,
        files=files,
        anchor=True,
        job_id=original.job_id,
    )
    (dst / MANIFEST).write_text(manifest.to_json())
    return f"file://{dst}"


def _requirement_names(lines: list[str]) -> dict[str, Requirement]:
    return {
        canonicalize_name(r.name): r
        for r in (Requirement(x) for x in lines if x and not x.startswith(("-", "artifacts/")))
    }


def test_champion_environment_installs_on_a_cpu_machine(
    trained_job: TrainedJob, published: dict, tmp_path: Path
) -> None:
    """TorchRec's metadata asks for ``fbgemm-gpu``, the CUDA build, which cannot load on a CPU
    machine. The model's requirements name the CPU build and carry a metadata-only wheel that
    satisfies TorchRec's requirement with it; every other requirement of TorchRec is pinned.
    (docs/publishing.md shows ``mlflow models predict --env-manager virtualenv`` installing it.)
    """
    local = Path(
        mlflow.artifacts.download_artifacts(
            f"models:/{trained_job.registered_model}@champion",
            tracking_uri=trained_job.tracking_uri,
            dst_path=str(tmp_path),
        )
    )
    lines = (local / "requirements.txt").read_text().split("\n")
    reqs = _requirement_names(lines)
    fbgemm = importlib.metadata.version("fbgemm-gpu-cpu").split("+")[0]
    assert str(reqs["fbgemm-gpu-cpu"].specifier) == f"=={fbgemm}"
    assert "fbgemm-gpu" not in reqs  # never the CUDA build by name
    (shim_line,) = [x for x in lines if x.startswith("artifacts/")]
    with zipfile.ZipFile(local / shim_line) as wheel:
        names = wheel.namelist()
        (meta_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = email.parser.Parser().parsestr(wheel.read(meta_name).decode())
    assert all(".dist-info/" in n for n in names)  # no files: cannot shadow fbgemm_gpu
    assert canonicalize_name(meta["Name"]) == "fbgemm-gpu"
    assert meta.get_all("Requires-Dist") == [f"fbgemm-gpu-cpu=={fbgemm}"]
    provided = {**reqs, "fbgemm-gpu": Requirement(f"fbgemm-gpu=={meta['Version']}")}
    for line in importlib.metadata.requires("torchrec") or []:
        need = Requirement(line)
        if need.marker is not None and not need.marker.evaluate({"extra": ""}):
            continue  # an optional extra
        pinned = provided.get(canonicalize_name(need.name))
        assert pinned is not None, f"torchrec needs {need}: not in the model's requirements"
        (version,) = [s.version for s in pinned.specifier]
        assert need.specifier.contains(version, prereleases=True), (need, version)


class _Trap:
    """A loopback port that records every connection (and what was sent) and answers nothing
    useful: a host a tampered checkpoint might point the worker at."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.received: list[bytes] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    self.received.append(conn.recv(65536))
                except OSError:
                    self.received.append(b"")

    def close(self) -> None:
        self.sock.close()
        self.thread.join(timeout=5)


def _tampered_copy(job: TrainedJob, dst: Path, mlflow_uri: str, s3_endpoint: str) -> None:
    """A committed copy of the anchor whose config.yaml points MLflow and S3 at other hosts
    (with a manifest that matches it: whoever writes a checkpoint can write both)."""
    from infra.checkpoint_manifest import MANIFEST, FileEntry
    from trainer.checkpoint.verify import sha256_file

    shutil.copytree(storage.local_path(job.anchor_url), dst)
    config = yaml.safe_load((dst / "config.yaml").read_text())
    config["tracking"]["mlflow_uri"] = mlflow_uri
    config["storage"]["s3_endpoint_url"] = s3_endpoint
    (dst / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    manifest = read_manifest(f"file://{dst}")
    entry = FileEntry((dst / "config.yaml").stat().st_size, sha256_file(str(dst / "config.yaml")))
    files = {**manifest.files, "config.yaml": entry}
    (dst / MANIFEST).write_text(dataclasses.replace(manifest, files=files).to_json())


def test_publishing_uses_the_workers_mlflow_and_s3_never_the_checkpoints(
    trained_job: TrainedJob, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint on S3 whose config.yaml names another MLflow server and another S3
    endpoint: publishing registers it on the worker's MLflow, reads it through the worker's
    S3, and neither host ever sees a connection (nor the worker's MLflow token)."""
    job = trained_job
    token = "worker-token-must-stay-home-5d1e"
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", token)
    mlflow_trap, s3_trap = _Trap(), _Trap()
    try:
        local = tmp_path / "step-000000020"
        _tampered_copy(job, local, mlflow_trap.url, s3_trap.url)
        url = "s3://ett/jobs/tampered/checkpoints/step-000000020"
        _copy_tree(f"file://{local}", url)
        result = publish(url, settings=SETTINGS)  # no tracking_uri: the worker's environment
    finally:
        mlflow_trap.close()
        s3_trap.close()
    assert mlflow_trap.received == [] and s3_trap.received == []
    client = MlflowClient(job.tracking_uri)
    version = client.get_model_version(job.registered_model, result.version)
    assert registry.anchor_uri_of(client, version) == url
    assert version.tags["publish_status"] == "complete"
