"""The publish pipeline: load -> export -> validate -> register, each a ledger span.

    pub = Publication.start(uri, step=..., job_id=..., mlflow_run_id=...)
    if pub.result is None:           # not published yet
        pub.load(); pub.export(); pub.validate(); pub.register()
    pub.close()

``publish()`` runs exactly that; the Prefect flow (flows/publish_flow.py) runs each stage as
a task. Spans go to the job's ledger in files of their own (role "publish", one attempt
number per publish run; infra/accounting/ett.py leaves them out of the job's wall time), so the ETT
report shows the work that moved off the training job. A refused stage (a bad checkpoint, a
failed validation) records its span with the error, ends the publish run FAILED and raises
PublishError; nothing is registered before every validation passed. Any other error (MLflow
or storage unavailable) propagates as itself, for the flow to retry.

Where to publish is the worker's business, never the checkpoint's: the MLflow server and the
storage endpoint and credentials come from this process's settings (``PublishSettings``,
``ETT_*`` and ``AWS_*``/``MLFLOW_*`` environment). A checkpoint's ``config.yaml`` only says
what the model is (its data schema and model config) and names (experiment, registered model),
so a checkpoint cannot send the worker's MLflow token or S3 credentials to another host.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import mlflow
from mlflow import MlflowClient
from mlflow.entities import Metric

from infra import storage
from infra.accounting.ledger import Ledger, next_attempt
from infra.accounting.ledger_format import Span
from infra.config_sources import ConfigError
from infra.settings import JobConfig, load_config
from infra.tracking import logged_models
from infra.tracking import metrics as names
from publish import export as export_mod
from publish import gate, registry, validate
from publish.gate import GATE_TAG, GateDecision
from publish.load import AnchorRef, LoadedAnchor, check_expected, load, read_config, resolve
from publish.settings import PublishError, PublishSettings, make_settings

log = logging.getLogger(__name__)

ROLE = "publish"


@dataclass
class PublishResult:
    registered_model: str
    version: str
    anchor_uri: str
    step: int
    job_id: str
    anchor_key: str
    already_published: bool
    promoted: bool
    aliases: list[str]
    model_uri: str  # models:/NAME/VERSION
    publish_run_id: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    champion_auc: float | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    model_id: str | None = None  # the anchor's LoggedModel (of the training run)
    # publish.gate.GateDecision.to_dict(); None when the anchor was published already and
    # its model holds no decision (published before the gate was recorded)
    gate: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Publication:
    """One publish of one checkpoint; stages run in order, each at most once."""

    def __init__(
        self,
        ref: AnchorRef,
        config: JobConfig,
        job_id: str | None,
        mlflow_run_id: str | None,
        settings: PublishSettings,
    ) -> None:
        self.ref = ref
        self.config = config
        self.job_id = job_id or ref.manifest.job_id or config.job_id
        self.training_run_id = mlflow_run_id or None
        self.settings = settings
        self.workdir = tempfile.mkdtemp(prefix="ett-publish-")
        self.client: MlflowClient | None = None
        self.loaded: LoadedAnchor | None = None
        self.holdout: validate.Holdout | None = None
        self.exported: export_mod.Exported | None = None
        self.validation: validate.Validation | None = None
        self.result: PublishResult | None = None
        self.seconds: dict[str, float] = {}
        # a checkpoint kept outside a job folder: the ledger of the job it names
        named = config.model_copy(update={"job_id": self.job_id or "publish"})
        self.layout = ref.layout or named.layout
        self.ledger: Ledger | None = None  # opened by the first stage that runs

    # -- set-up ---------------------------------------------------------------------------
    @classmethod
    def start(
        cls,
        uri: str,
        step: int | None = None,
        job_id: str | None = None,
        mlflow_run_id: str | None = None,
        settings: PublishSettings | dict[str, Any] | None = None,
    ) -> Publication:
        """Read the manifest and the (checksum-verified) job config, check the caller's
        expectations and look the anchor up in the registry, all before any weights are
        downloaded: when it is published already, ``result`` is set and no stage runs."""
        if not isinstance(settings, PublishSettings):
            settings = make_settings(settings)
        worker = worker_config()
        storage.configure(worker.storage)  # the worker's endpoint and credentials, for good
        ref = resolve(uri)
        check_expected(ref, step, job_id, settings.require_anchor)
        config = read_config(ref)
        pub = cls(ref, config, job_id, mlflow_run_id, settings)
        try:
            client = pub._connect(settings.tracking_uri or worker.tracking.mlflow_uri)
            if pub.training_run_id:
                export_mod.check_training_run(client, pub.training_run_id)
            else:
                pub.training_run_id = export_mod.find_training_run(client, config, pub.job_id)
            pub._find_published(pub.registered_model)
        except BaseException:
            pub.close()
            raise
        return pub

    def _open_ledger(self) -> Ledger:
        """The publisher's own ledger file in the job's ledger folder. Each publish run gets
        the next free attempt number: on object storage a ledger file is re-uploaded whole,
        so reusing attempt 0 would erase an earlier publish run's spans."""
        if self.ledger is None:
            attempt = next_attempt(self.layout, role=ROLE, rank=0)
            self.ledger = Ledger(self.layout, attempt=attempt, rank=0, role=ROLE)
        return self.ledger

    def _connect(self, tracking_uri: str) -> MlflowClient:
        if self.client is None:
            self.client = export_mod.connect(tracking_uri)
        return self.client

    def _find_published(self, name: str) -> bool:
        assert self.client is not None
        found = registry.published_version(self.client, name, self.ref.key)
        if found is not None:
            log.info("%s is already published as %s version %s", self.ref.uri, name, found.version)
            # A version from a search carries no aliases: read it whole, so the result says
            # "aliases: candidate", not "none".
            version = self.client.get_model_version(name, found.version)
            self.result = self._result_from(version, name, already=True)
        return self.result is not None

    @property
    def registered_model(self) -> str:
        return self.settings.registered_model or self.config.tracking.registered_model

    @contextlib.contextmanager
    def _stage(self, name: Span) -> Iterator[dict[str, Any]]:
        attrs: dict[str, Any] = {"uri": self.ref.uri, "anchor_step": self.ref.step}
        start = time.time()
        try:
            yield attrs
            attrs["ok"] = True
        except BaseException as exc:
            attrs.update(ok=False, error=str(exc)[:500])
            self._fail(exc)
            raise
        finally:
            end = time.time()
            self.seconds[name] = round(end - start, 4)
            self._open_ledger().record_span(name, start, end, step=self.ref.step, **attrs)

    def _fail(self, exc: BaseException) -> None:
        """End the publish run FAILED (a retried stage that then succeeds ends it FINISHED);
        a refusal also says why, in the tag ``ett.publish_error``."""
        if self.client is not None and self.exported is not None:
            with contextlib.suppress(Exception):  # MLflow may be what failed
                run_id = self.exported.publish_run_id
                if isinstance(exc, PublishError):
                    self.client.set_tag(run_id, "ett.publish_error", str(exc)[:5000])
                self.client.set_terminated(run_id, "FAILED")

    # -- stages ---------------------------------------------------------------------------
    def load(self) -> None:
        """publish_load: verify + load the checkpoint, read the holdout rows."""
        with self._stage(Span.PUBLISH_LOAD) as attrs:
            self.loaded = load(self.ref, self.config, self.workdir)
            self.holdout = validate.load_holdout(self.config, self.settings)
            attrs.update(world_size=self.ref.manifest.world_size, rows=self.holdout.rows)

    def export(self) -> None:
        """publish_export: open the publish run, log the pyfunc model into the anchor's
        LoggedModel (the training run's; made here when nobody logged it)."""
        assert self.loaded is not None and self.holdout is not None and self.client is not None
        with self._stage(Span.PUBLISH_EXPORT) as attrs:
            run_id, experiment_id = export_mod.open_publish_run(
                self.client, self.loaded.config, self.ref, self.training_run_id, self.holdout.rows
            )
            model = export_mod.checkpoint_model(
                self.client, self.ref, self.job_id, experiment_id, self.training_run_id, run_id
            )
            self.exported = export_mod.export(
                self.client,
                self.loaded,
                self.holdout.frame,
                run_id,
                f"{self.workdir}/export",
                model,
            )
            attrs.update(model_uri=self.exported.model_uri, publish_run_id=run_id)

    def validate(self) -> None:
        """publish_validate: parity with the trainer's eval, sanity checks, AUC/log-loss."""
        assert self.loaded and self.holdout and self.exported and self.client
        with self._stage(Span.PUBLISH_VALIDATE) as attrs:
            v = validate.evaluate(self.loaded.model, self.holdout, self.exported.model_uri)
            self.validation = v
            attrs.update(v.metrics())
            # On the LoggedModel, with the rows they were measured on: the model's page in
            # MLflow shows them (and the publish run does too).
            mlflow.log_metrics(
                {k: val for k, val in v.metrics().items() if _finite(val)},
                run_id=self.exported.publish_run_id,
                model_id=self.exported.model_id,
                dataset=self.holdout.dataset(),
            )
            failed = validate.failures(v, self.settings)
            if failed:
                raise PublishError(
                    f"validation of {self.ref.uri} failed, nothing registered: " + "; ".join(failed)
                )

    def register(self) -> PublishResult:
        """publish_register: new version, alias candidate, champion if not worse."""
        assert self.loaded and self.holdout and self.exported and self.validation and self.client
        with self._stage(Span.PUBLISH_REGISTER) as attrs:
            name = self.registered_model
            holdout = self.holdout
            champ = registry.score_champion(
                self.client,
                name,
                lambda uri: validate.auc_and_logloss_of(
                    validate.pyfunc_predictions(uri, holdout.frame), holdout.labels
                ),
            )
            decision = self._decide(champ)
            self._record_on_model(decision)
            version, created = registry.register(
                self.client,
                name,
                self.ref.key,
                self.exported.model_id,
                {registry.JOB_TAG: self.job_id, registry.STEP_TAG: str(self.ref.step)},
                decision.promoted,
                self._version_description(decision),
            )
            self.client.set_terminated(self.exported.publish_run_id, "FINISHED")
            self.result = self._result_from(version, name, already=not created)
            self.result.champion_auc = champ.auc
            self.result.publish_run_id = self.exported.publish_run_id
            self.result.gate = decision.to_dict()
            attrs.update(version=version.version, promoted=self.result.promoted)
        self.result.seconds = dict(self.seconds)
        return self.result

    def _decide(self, champ: registry.ChampionScore) -> GateDecision:
        v = self.validation
        assert v is not None
        margin = self.settings.champion_margin
        promote = registry.should_promote(v.auc, champ, margin)
        return GateDecision(
            candidate_auc=v.auc,
            candidate_logloss=v.logloss,
            champion_version=champ.version,
            champion_auc=champ.auc,
            champion_logloss=champ.logloss,
            margin=margin,
            parity_max_abs_diff=v.parity_max_abs_diff,
            parity_tolerance=self.settings.parity_tolerance,
            promoted=promote,
            reason=gate.reason(v.auc, champ.version, champ.auc, margin, promote, champ.error),
        )

    def _record_on_model(self, decision: GateDecision) -> None:
        """The decision on the LoggedModel (tag ``ett.gate``), its publish run among its
        params (params are write-once: a completed, interrupted publish keeps the first),
        and the champion's numbers on the publish run."""
        assert self.client is not None and self.exported is not None
        model_id, run_id = self.exported.model_id, self.exported.publish_run_id
        self.client.set_logged_model_tags(model_id, {GATE_TAG: decision.to_json()})
        params = self.client.get_logged_model(model_id).params
        if logged_models.PUBLISH_RUN_PARAM not in params:
            self.client.log_model_params(model_id, {logged_models.PUBLISH_RUN_PARAM: run_id})
        champion = {
            "champion_auc": decision.champion_auc,
            "champion_logloss": decision.champion_logloss,
        }
        shown = {
            f"{names.PUBLISH}{k}": names.score(v)
            for k, v in champion.items()
            if v is not None and _finite(v)
        }
        if shown:
            self.client.log_batch(
                run_id, metrics=[Metric(k, v, _now_ms(), 0) for k, v in shown.items()]
            )

    def _version_description(self, decision: GateDecision) -> str:
        v = self.validation
        assert v is not None
        training = f"training run `{self.training_run_id}`" if self.training_run_id else "no run"
        return (
            f"{decision.reason}\n\n"
            f"Job `{self.job_id}`, step {self.ref.step} ({training}); anchor `{self.ref.uri}`. "
            f"Gate on the first {v.rows} holdout rows (dataset `holdout[:{v.rows}]`, the rows "
            f"every champion is re-scored on): AUC {v.auc:.4f}, log-loss {v.logloss:.4f}; the "
            f"exported model matches the trainer's forward pass to {v.parity_max_abs_diff:.2g} "
            f"(tolerance {self.settings.parity_tolerance:g}). The training run's "
            f"`{names.EVAL_AUC}` is on {self.config.train.eval_rows} rows of the same split."
        )

    def _result_from(self, version: Any, name: str, already: bool) -> PublishResult:
        tags = version.tags or {}
        metrics: dict[str, float] = {}
        model_id = registry.model_id_of(version)
        publish_run_id: str | None = None
        decision: dict[str, Any] | None = None
        if self.validation is not None:
            metrics = self.validation.metrics()
        elif self.client is not None and model_id:
            logged = self.client.get_logged_model(model_id)
            metrics = {
                m.key: m.value for m in logged.metrics or [] if m.key.startswith(names.PUBLISH)
            }
            publish_run_id = logged.params.get(logged_models.PUBLISH_RUN_PARAM)
            if GATE_TAG in logged.tags:
                decision = GateDecision.from_json(logged.tags[GATE_TAG]).to_dict()
        return PublishResult(
            registered_model=name,
            version=str(version.version),
            anchor_uri=self.ref.uri,
            step=self.ref.step,
            job_id=self.job_id,
            anchor_key=self.ref.key,
            already_published=already,
            promoted=tags.get(registry.PROMOTED_TAG) == "true",
            aliases=sorted(version.aliases or []),
            model_uri=f"models:/{name}/{version.version}",
            publish_run_id=publish_run_id or tags.get(logged_models.PUBLISH_RUN_PARAM),
            metrics=metrics,
            seconds=dict(self.seconds),
            model_id=model_id,
            gate=decision,
        )

    def close(self) -> None:
        if self.ledger is not None:
            self.ledger.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _finite(value: float) -> bool:
    return value == value and abs(value) != float("inf")


def _now_ms() -> int:
    return int(time.time() * 1000)


def worker_config() -> JobConfig:
    """This process's own settings (embedded defaults + ETT_* environment): where the
    worker's MLflow and storage are. PublishError when the environment is invalid."""
    try:
        return load_config()
    except ConfigError as exc:
        raise PublishError(f"the publishing worker's own settings are invalid: {exc}") from None


STAGES: tuple[tuple[str, Callable[[Publication], Any]], ...] = (
    ("load", Publication.load),
    ("export", Publication.export),
    ("validate", Publication.validate),
    ("register", Publication.register),
)


def publish(
    uri: str,
    step: int | None = None,
    job_id: str | None = None,
    mlflow_run_id: str | None = None,
    settings: PublishSettings | dict[str, Any] | None = None,
    on_stage: Callable[[str], None] | None = None,
) -> PublishResult:
    """Publish the checkpoint at ``uri``: one model version per anchor, however often called.
    ``on_stage(name)`` is called as each stage begins (a progress bar)."""
    pub = Publication.start(uri, step, job_id, mlflow_run_id, settings)
    try:
        if pub.result is None:
            for name, stage in STAGES:
                if on_stage is not None:
                    on_stage(name)
                stage(pub)
        assert pub.result is not None
        return pub.result
    finally:
        pub.close()
