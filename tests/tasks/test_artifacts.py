"""What the Prefect UI shows of a publish and how its runs are named, without a server: the
gate table's rows, the stable artifact keys, the run-name spelling shared with MLflow and
the train flow run in the anchor event. The server-side view (artifacts read back, links
both ways) is tests/flows/test_deployments.py's."""

from __future__ import annotations

from typing import Any

import pytest

from flows import run_names
from infra.naming import attempt_run_name, publish_run_name
from tasks.artifacts import GATE_KEYS, gate_rows, gate_summary, link_markdown
from tasks.events import Anchor, anchor_payload, flow_run_related
from tasks.report import artifact_key, run_scope, stable_key


def _gate(**changes: Any) -> dict[str, Any]:
    gate = {
        "candidate_auc": 0.781234,
        "candidate_logloss": 0.456789,
        "champion_version": "2",
        "champion_auc": 0.776543,
        "champion_logloss": 0.46,
        "margin": 0.001,
        "parity_max_abs_diff": 3.14159e-7,
        "parity_tolerance": 1e-5,
        "promoted": True,
        "reason": "AUC 0.7812 >= champion v2's 0.7765 - margin 0.001",
    }
    return {**gate, **changes}


def _by_check(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {row["check"]: row for row in rows}


def test_the_gate_table_sets_the_candidate_against_the_champion_with_the_decision() -> None:
    gate = _gate()
    assert set(gate) == set(GATE_KEYS)  # the contract of PublishResult.gate
    rows = _by_check(gate_rows(gate))
    assert list(rows) == ["AUC", "log-loss", "parity (max abs diff)", "decision"]
    assert rows["AUC"] == {
        "check": "AUC",
        "candidate": 0.7812,
        "champion": 0.7765,
        "margin or tolerance": 0.001,
        "result": "at least champion - margin",
    }
    assert (rows["log-loss"]["candidate"], rows["log-loss"]["champion"]) == (0.4568, 0.46)
    parity = rows["parity (max abs diff)"]
    assert (parity["candidate"], parity["margin or tolerance"]) == (3.14e-7, 1e-5)
    assert parity["result"] == "within tolerance"
    decision = rows["decision"]
    assert (decision["candidate"], decision["champion"]) == ("promoted to champion", "v2")
    assert decision["result"] == gate["reason"]
    assert gate_summary(gate, "ranker", "3") == (
        "ranker version 3 promoted to champion: AUC 0.7812 vs 0.7765 (v2)"
    )


def test_a_kept_candidate_and_a_first_version_say_why() -> None:
    kept = _by_check(gate_rows(_gate(promoted=False, reason="AUC below the champion's")))
    assert kept["AUC"]["result"] == "below champion - margin"
    assert kept["decision"]["candidate"] == "kept as candidate"
    assert kept["decision"]["result"] == "AUC below the champion's"
    first = _gate(champion_version=None, champion_auc=None, champion_logloss=None)
    rows = _by_check(gate_rows(first))
    assert rows["AUC"]["result"] == "no champion to compare with"
    assert rows["AUC"]["champion"] is None and rows["decision"]["champion"] == "none"
    assert gate_summary(first, "ranker", "1").endswith("AUC 0.7812 (no champion scored)")
    unscored = _by_check(gate_rows(_gate(champion_auc=None, promoted=False)))
    assert unscored["AUC"]["result"] == "champion not re-scored"
    off = _by_check(gate_rows(_gate(parity_max_abs_diff=2e-5)))
    assert off["parity (max abs diff)"]["result"] == "exceeds tolerance"


def test_an_anchor_published_before_has_a_table_that_says_so() -> None:
    (row,) = gate_rows(None)
    assert row["check"] == "decision" and row["result"].startswith("already published")
    assert "no new gate decision" in gate_summary(None, "ranker", "2")
    earlier = _by_check(gate_rows(_gate(), already_published=True))  # the decision it had
    assert earlier["decision"]["result"].startswith("already published")
    assert earlier["decision"]["result"].endswith(_gate()["reason"])
    assert "no new gate decision" in gate_summary(_gate(), "ranker", "2", already_published=True)


def test_artifact_keys_name_the_deployment_not_the_job() -> None:
    assert run_scope() == "train"  # outside a flow run: the train flow's
    assert stable_key("ett-buckets") == "ett-buckets-train"
    assert stable_key("mlflow-model", "publish") == "mlflow-model-publish"
    assert stable_key("gate", "My Publish_2") == "gate-my-publish-2"  # a key's alphabet
    assert artifact_key("publish-run", "retrain") == "publish-run-retrain"


def test_one_spelling_of_attempts_and_steps_in_both_uis(monkeypatch: pytest.MonkeyPatch) -> None:
    assert attempt_run_name("job-1", 0) == "job-1-attempt-0"
    assert publish_run_name("job-1", 600) == "publish-job-1-step-600"
    parameters = {"job_id": "job-1", "step": "600"}  # as the trigger templates them
    monkeypatch.setattr(run_names, "_parameters", lambda: parameters)
    assert run_names.publish_run_name() == publish_run_name("job-1", 600)


def test_the_anchor_event_names_the_train_flow_run() -> None:
    anchor = Anchor(uri="s3://b/jobs/j/checkpoints/step-8", step=8, committed_at=0.0)
    payload = anchor_payload(anchor, "j", "mlflow-run", "1b4e28ba-2fa1-11d2-883f-0016d3cca427")
    assert payload["train_flow_run_id"] == "1b4e28ba-2fa1-11d2-883f-0016d3cca427"
    assert flow_run_related("1b4e28ba-2fa1-11d2-883f-0016d3cca427", "flow-run") == [
        {
            "prefect.resource.id": "prefect.flow-run.1b4e28ba-2fa1-11d2-883f-0016d3cca427",
            "prefect.resource.role": "flow-run",
        }
    ]
    assert flow_run_related(None, "flow-run") == []  # a publish by hand names none
    assert link_markdown("http://ui/runs/flow-run/x", "train run t") == (
        "[train run t](http://ui/runs/flow-run/x)"
    )
