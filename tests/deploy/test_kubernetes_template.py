"""The Kubernetes work pool template for node runs (deploy/kubernetes/node-run-template.json).

No cluster here: the template is rendered by prefect-kubernetes' own worker code for a sample
`train-node` flow run, exactly as a Kubernetes worker would before it submits the Job, and the
manifest is checked against the Kubernetes OpenAPI schema that kubernetes-validate ships.
No Prefect server and no network either: the stub client answers the two reads the worker
makes, and the schemas are files of the package.
"""

from __future__ import annotations

import ast
import asyncio
import copy
import json
import re
import socket
import uuid
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from prefect.client.schemas.objects import Flow, FlowRun, WorkPool
from prefect.client.schemas.responses import DeploymentResponse
from prefect.server.schemas.actions import validate_base_job_template
from prefect.utilities.schema_tools.validation import ValidationError as JobVariablesError
from prefect.utilities.schema_tools.validation import is_valid_schema
from prefect.utilities.schema_tools.validation import validate as validate_job_variables
from prefect_kubernetes.worker import KubernetesWorker, KubernetesWorkerJobConfiguration

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "deploy" / "kubernetes" / "node-run-template.json"
# The newest schema kubernetes-validate 1.37.0 ships, and an older release still common in
# managed clusters. Strict: an unknown field is an error, as `kubectl --validate=strict` has it.
K8S_VERSIONS = ("1.33", "1.37")
# prefect-kubernetes' own check (KubernetesWorkerJobConfiguration._validate_job_manifest)
# requires these two under the pod spec, where Kubernetes has no such fields: the API server
# drops them with a warning. They are the only keys taken out before the strict check.
PREFECT_POD_SPEC_EXTRAS = ("parallelism", "completions")

JOB_ID = "demo-20261130-142501"
IMAGE = "registry.example.com/ett-pipeline:1.0.0"
LABEL = "ett.dev/job-id"
PARAMETERS = {
    "job_url": f"s3://ml-ett/runs/jobs/{JOB_ID}",
    "attempt": 0,
    "node_rank": 1,
    "nnodes": 2,
    "rendezvous": "10.12.0.7:29400",
}
# In the worker's own environment, as a worker that can reach S3 itself would have them:
# none of these strings may reach the manifest.
SAMPLE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "AKIASAMPLEDONOTUSE77",
    "AWS_SECRET_ACCESS_KEY": "sample/secret+DoNotUse/4f1d9c2b7a6e5d",
    "AWS_SESSION_TOKEN": "sample-session-token-9e8d7c6b",
}


class _StubClient:
    """The Prefect API as the worker sees it: the flow run's deployment and flow, nothing
    else. Any other call fails the test, so rendering needs no server."""

    def __init__(self, deployment: DeploymentResponse, flow: Flow) -> None:
        self._deployment = deployment
        self._flow = flow

    async def read_deployment(self, deployment_id: uuid.UUID) -> DeploymentResponse:
        assert deployment_id == self._deployment.id
        return self._deployment

    async def read_flow(self, flow_id: uuid.UUID) -> Flow:
        assert flow_id == self._flow.id
        return self._flow

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"rendering asked the Prefect API for {name!r}")


def _template() -> dict[str, Any]:
    return json.loads(TEMPLATE.read_text())


def _render(
    run_variables: dict[str, Any] | None = None,
    deployment_variables: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], FlowRun]:
    """The Job manifest a Kubernetes worker builds for one train-node flow run: the same
    call as BaseWorker._submit_run_and_capture_errors (resolve_for_flow_run merges the
    deployment's and the run's job variables, then prepare_for_flow_run)."""
    flow = Flow(name="train-node")
    deployment = DeploymentResponse(
        name="train-node",
        flow_id=flow.id,
        job_variables=deployment_variables
        if deployment_variables is not None
        else {"image": IMAGE, "namespace": "ml-training"},
    )
    flow_run = FlowRun(
        name="train-node-demo-a0-n1",
        flow_id=flow.id,
        deployment_id=deployment.id,
        parameters=PARAMETERS,
        # what the orchestrator passes to run_deployment(..., job_variables=...)
        job_variables=run_variables if run_variables is not None else {"job_id": JOB_ID},
    )
    pool = WorkPool(name="ett-k8s", type="kubernetes", base_job_template=_template())
    config = asyncio.run(
        KubernetesWorkerJobConfiguration.resolve_for_flow_run(
            flow_run,
            client=_StubClient(deployment, flow),  # type: ignore[arg-type]
            work_pool=pool,
            worker_name="ett-k8s-worker",
        )
    )
    return config.job_manifest, flow_run


def _pod(manifest: dict[str, Any]) -> dict[str, Any]:
    return manifest["spec"]["template"]["spec"]


def _container(manifest: dict[str, Any]) -> dict[str, Any]:
    (container,) = _pod(manifest)["containers"]
    return container


def _env(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    entries = _container(manifest)["env"]
    names = [entry["name"] for entry in entries]
    assert len(names) == len(set(names)), f"an env name twice: {names}"
    return {entry["name"]: entry for entry in entries}


def _strict_validate(manifest: dict[str, Any], version: str) -> None:
    """kubernetes-validate in strict mode, less the two keys prefect-kubernetes insists on."""
    manifest = copy.deepcopy(manifest)
    for key in PREFECT_POD_SPEC_EXTRAS:
        del _pod(manifest)[key]
    kubernetes_validate.validate(manifest, version, strict=True)


def _server_check(variables: dict[str, Any]) -> None:
    """What the Prefect server does with a flow run's job variables (the deployment's under
    the run's) before it creates the run: server/api/validation.py,
    _validate_work_pool_job_variables, with the arguments it passes for a flow run."""
    schema = _template()["variables"]
    defaults = {
        name: prop["default"]
        for name, prop in schema["properties"].items()
        if prop.get("default") is not None
    }
    validate_job_variables(
        {**defaults, **variables},
        schema,
        raise_on_error=True,
        preprocess=True,
        ignore_required=False,
        allow_none_with_default=True,
    )


# --- the template file ----------------------------------------------------------------------


def test_prefect_accepts_the_template_and_it_keeps_the_default_s_fields() -> None:
    template = _template()
    validate_base_job_template(template)  # `prefect work-pool create`: every {{ var }} declared
    is_valid_schema(template["variables"], preprocess=False)
    default = KubernetesWorker.get_default_base_job_template()
    assert set(template["job_configuration"]) == set(default["job_configuration"])
    # backoff_limit is not a variable: backoffLimit is 0, fixed in the manifest
    dropped = set(default["variables"]["properties"]) - set(template["variables"]["properties"])
    assert dropped == {"backoff_limit"}


# --- the rendered manifest against the Kubernetes schema ------------------------------------


FULL_VARIABLES = {
    "job_id": JOB_ID,
    "image": IMAGE,
    "namespace": "ml-training",
    "gpu_count": 4,
    "aws_secret_name": "ml-ett-s3",
    "service_account_name": "ett-trainer",
    "cpu_request": "90",
    "memory_request": "900Gi",
    "cpu_limit": "96",
    "memory_limit": "1000Gi",
    "host_network": True,
    "termination_grace_period_seconds": 90,
    "node_selector": {"node.kubernetes.io/instance-type": "p5.48xlarge"},
    "scratch_size_limit": "500Gi",
    "shm_size_limit": "64Gi",
    "finished_job_ttl": 3600,
    "image_pull_policy": "Always",
}


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("variables", ["defaults", "all set"])
def test_the_rendered_job_is_valid_kubernetes(version: str, variables: str) -> None:
    if variables == "defaults":
        manifest, _ = _render()
    else:
        manifest, _ = _render(run_variables=FULL_VARIABLES, deployment_variables={})
        assert _pod(manifest)["hostNetwork"] is True
        assert _pod(manifest)["serviceAccountName"] == "ett-trainer"
    kubernetes_validate.validate(manifest, version, strict=False)
    _strict_validate(manifest, version)
    # ... and those two keys are all that strict mode would refuse
    with pytest.raises(kubernetes_validate.ValidationError) as refused:
        kubernetes_validate.validate(manifest, version, strict=True)
    assert list(refused.value.path) == ["spec", "template", "spec"]
    unexpected = re.search(r"\((.*) were unexpected\)", refused.value.message)
    assert unexpected and set(re.findall(r"'(\w+)'", unexpected[1])) == {*PREFECT_POD_SPEC_EXTRAS}


def _secret_ref(manifest: dict[str, Any]) -> dict[str, Any]:
    return _env(manifest)["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]


@pytest.mark.parametrize(
    ("break_it", "where"),
    [
        pytest.param(
            lambda m: m["spec"].__setitem__("backoffLimit", "zero"),
            "spec.backoffLimit",
            id="wrong type",
        ),
        pytest.param(
            lambda m: _container(m).__setitem__("gpus", 8),
            "spec.template.spec.containers.0",
            id="unknown field (strict)",
        ),
        pytest.param(
            lambda m: _secret_ref(m).pop("key"),
            "spec.template.spec.containers.0.env.",  # then the entry's index
            id="secretKeyRef without its key",
        ),
        pytest.param(
            lambda m: _pod(m).__setitem__("containers", {}),
            "spec.template.spec.containers",
            id="containers not a list",
        ),
    ],
)
def test_the_validation_step_can_fail(break_it: Any, where: str) -> None:
    manifest, _ = _render()
    break_it(manifest)
    with pytest.raises(kubernetes_validate.ValidationError) as refused:
        _strict_validate(manifest, K8S_VERSIONS[-1])
    assert ".".join(map(str, refused.value.path)).startswith(where)


def test_the_schema_has_no_enum_for_restart_policy() -> None:
    """Why the tests below assert restartPolicy themselves: the OpenAPI schema types it as a
    plain string, so a value Kubernetes refuses still passes the validator."""
    manifest, _ = _render()
    _pod(manifest)["restartPolicy"] = "Sometimes"
    _strict_validate(manifest, K8S_VERSIONS[-1])


def test_validation_needs_no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("kubernetes-validate opened a connection")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    manifest, _ = _render()
    for version in K8S_VERSIONS:
        _strict_validate(manifest, version)


# --- what matters for a node ----------------------------------------------------------------


def test_one_pod_is_one_node_on_its_own_host_and_never_restarted() -> None:
    manifest, _ = _render()
    pod = _pod(manifest)
    assert manifest["kind"] == "Job" and manifest["metadata"]["namespace"] == "ml-training"
    assert manifest["spec"]["backoffLimit"] == 0
    assert pod["restartPolicy"] == "Never"
    assert _container(manifest)["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert pod["terminationGracePeriodSeconds"] == 60  # > the trainer's 30 s preemption budget
    assert pod["hostNetwork"] is False

    (term,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term == {
        "labelSelector": {"matchLabels": {LABEL: JOB_ID}},
        "topologyKey": "kubernetes.io/hostname",
    }
    # the pod carries the label its own anti-affinity selects: two nodes of a job repel
    assert manifest["spec"]["template"]["metadata"]["labels"][LABEL] == JOB_ID
    assert manifest["metadata"]["labels"][LABEL] == JOB_ID

    manifest, _ = _render(run_variables={"job_id": JOB_ID, "gpu_count": 2})
    assert _container(manifest)["resources"]["limits"]["nvidia.com/gpu"] == 2


def test_scratch_and_shared_memory_volumes() -> None:
    manifest, _ = _render()
    volumes = {volume["name"]: volume for volume in _pod(manifest)["volumes"]}
    mounts = {mount["mountPath"]: mount["name"] for mount in _container(manifest)["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory"}
    scratch_dir = _env(manifest)["ETT_SCRATCH_DIR"]["value"]
    assert volumes[mounts[scratch_dir]]["emptyDir"] == {}  # the node's disk, not memory

    manifest, _ = _render(
        run_variables={"job_id": JOB_ID, "shm_size_limit": "64Gi", "scratch_size_limit": "1Ti"}
    )
    volumes = {volume["name"]: volume for volume in _pod(manifest)["volumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert volumes[mounts[scratch_dir]]["emptyDir"] == {"sizeLimit": "1Ti"}


def test_the_node_s_environment() -> None:
    manifest, flow_run = _render(
        run_variables={"job_id": JOB_ID, "env": {"ETT_TRAIN__STEPS": "100"}},
        deployment_variables={"image": IMAGE, "env": {"ETT_STORAGE__ROOT": "s3://ml-ett/runs"}},
    )
    env = _env(manifest)
    assert env["ETT_ADVERTISE_ADDRESS"] == {
        "name": "ETT_ADVERTISE_ADDRESS",
        "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
    }
    assert env["ETT_JOB_ID"]["value"] == JOB_ID
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert env[key] == {
            "name": key,
            "valueFrom": {"secretKeyRef": {"name": "ett-s3-credentials", "key": key}},
        }
    endpoint = env["AWS_ENDPOINT_URL_S3"]["valueFrom"]["secretKeyRef"]
    assert endpoint["key"] == "AWS_ENDPOINT_URL_S3" and endpoint["optional"] is True
    # what Prefect adds: the run to execute, and how
    assert env["PREFECT__FLOW_RUN_ID"]["value"] == str(flow_run.id)
    assert env["PREFECT__FLOW_NAME"]["value"] == "train-node"
    assert _container(manifest)["args"] == ["prefect", "flow-run", "execute"]
    assert _container(manifest)["image"] == IMAGE
    # the deployment's and the run's env both arrive, beside the template's default
    assert env["ETT_STORAGE__ROOT"]["value"] == "s3://ml-ett/runs"
    assert env["ETT_TRAIN__STEPS"]["value"] == "100"
    # backoffLimit 0 would otherwise make prefect-kubernetes set `reschedule`: a SIGTERM
    # would put the same node run back in the queue behind the orchestrator's back
    assert env["PREFECT_FLOW_RUN_EXECUTE_SIGTERM_BEHAVIOR"]["value"] == "relinquish"
    labels = manifest["spec"]["template"]["metadata"]["labels"]
    assert labels["prefect.io/flow-run-id"] == str(flow_run.id)


def test_no_credential_value_anywhere_in_the_manifest(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SAMPLE_CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    manifest, _ = _render()
    text = json.dumps(manifest)
    for value in SAMPLE_CREDENTIALS.values():
        assert value not in text
    # the same search finds a credential passed as a literal (which the server refuses, below)
    secret = SAMPLE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"]
    leaked, _ = _render(run_variables={"job_id": JOB_ID, "env": {"AWS_SECRET_ACCESS_KEY": secret}})
    assert secret in json.dumps(leaked)


# --- the job variables the Prefect server accepts --------------------------------------------


def test_the_server_accepts_a_node_run_s_job_variables() -> None:
    _server_check({"image": IMAGE, "job_id": JOB_ID})
    _server_check({"image": IMAGE, "job_id": "a" * 63, "env": {"ETT_TRAIN__STEPS": "5"}})


@pytest.mark.parametrize(
    ("variables", "reason"),
    [
        ({"image": IMAGE}, "'job_id' is a required property"),
        ({"job_id": JOB_ID}, "'image' is a required property"),
        ({"image": IMAGE, "job_id": "a" * 64}, "does not match"),  # label values: 63 at most
        ({"image": IMAGE, "job_id": "job-"}, "does not match"),  # ... ending alphanumeric
        ({"image": IMAGE, "job_id": JOB_ID, "gpu_count": -1}, "less than the minimum"),
        (
            {"image": IMAGE, "job_id": JOB_ID, "env": {"AWS_SECRET_ACCESS_KEY": "x"}},
            "should not be valid",
        ),
    ],
)
def test_the_server_refuses_bad_job_variables(variables: dict[str, Any], reason: str) -> None:
    with pytest.raises(JobVariablesError, match=reason):
        _server_check(variables)


# --- production code does not import the Kubernetes packages --------------------------------


def test_no_production_module_imports_the_kubernetes_packages() -> None:
    """prefect-kubernetes takes most of a second to import; only the Kubernetes worker needs it."""
    banned = ("prefect_kubernetes", "kubernetes_validate", "kubernetes_asyncio", "kopf")
    offenders = []
    for package in ("flows", "tasks", "trainer", "publish", "infra"):
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = [node.module or ""]
                else:
                    continue
                offenders += [
                    f"{path.relative_to(REPO)}: {name}"
                    for name in names
                    if name.split(".")[0] in banned
                ]
    assert offenders == []
