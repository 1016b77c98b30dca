"""The publish gate without servers or a trained model: which candidate becomes champion,
which validation fails, and which checkpoint is refused before anything is downloaded.

tests/publish/test_publish.py runs the whole pipeline against a real MLflow server (slow); its
promotion test uses a margin no AUC can meet, so it cannot tell a better candidate from a
worse one. Here the comparison itself is pinned, at its boundaries (AUCs that are exact in
binary, so ``champion - margin`` is computed without rounding).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST

from infra.checkpoint_manifest import MANIFEST, Manifest
from infra.job_layout import step_dir_name
from publish import gate, registry, validate
from publish.gate import GateDecision
from publish.pipeline import publish
from publish.registry import ChampionScore, should_promote
from publish.settings import PublishError, make_settings

CHAMPION = ChampionScore(version="3", auc=0.75)
BELOW = math.nextafter  # the float just below x: nextafter(x, 0)


@pytest.mark.parametrize(
    ("auc", "margin", "promoted"),
    [
        # margin 0: promoted when not worse
        (0.875, 0.0, True),  # better
        (0.75, 0.0, True),  # equal: not worse
        (BELOW(0.75, 0), 0.0, False),  # worse by the least a float can be
        (0.625, 0.0, False),  # worse
        # margin 0.125: up to 0.125 worse is tolerated
        (0.625, 0.125, True),  # exactly at the boundary
        (BELOW(0.625, 0), 0.125, False),  # just past it
        (0.875, 0.125, True),
        # margin -0.125: must improve by at least 0.125
        (0.875, -0.125, True),  # exactly at the boundary
        (BELOW(0.875, 0), -0.125, False),
        (0.75, -0.125, False),  # equal is not enough
        (math.nan, 0.0, False),  # a candidate without an AUC never wins
    ],
)
def test_promotion_compares_the_candidate_with_the_champion_and_margin(
    auc: float, margin: float, promoted: bool
) -> None:
    assert should_promote(auc, CHAMPION, margin) is promoted


def test_without_a_champion_the_candidate_is_promoted_and_an_unscorable_one_stays() -> None:
    """The first version becomes champion whatever its AUC. A champion that could not be
    re-scored (another schema, missing artifacts) or scored NaN stays: nothing shows the
    candidate is not worse."""
    assert should_promote(0.5, ChampionScore(None, None), 0.0) is True
    assert should_promote(0.5, ChampionScore(None, None), -0.5) is True
    unscorable = ChampionScore("3", None, "OSError: artifacts missing")
    assert should_promote(1.0, unscorable, 0.0) is False
    assert should_promote(1.0, ChampionScore("3", math.nan), 1.0) is False


class _Registry:
    """The part of MlflowClient that score_champion uses."""

    def __init__(self, champion: str | None) -> None:
        self.champion = champion

    def get_model_version_by_alias(self, name: str, alias: str) -> SimpleNamespace:
        assert alias == registry.CHAMPION
        if self.champion is None:
            raise MlflowException("no alias", error_code=RESOURCE_DOES_NOT_EXIST)
        return SimpleNamespace(version=self.champion)


def test_the_champion_is_re_scored_by_its_alias_and_a_failure_is_reported() -> None:
    asked: list[str] = []

    def scorer(uri: str) -> tuple[float, float]:
        asked.append(uri)
        return 0.625, 0.5

    assert registry.score_champion(_Registry(None), "ranker", scorer) == ChampionScore(None, None)
    assert asked == []
    scored = registry.score_champion(_Registry("7"), "ranker", scorer)
    assert scored == ChampionScore("7", 0.625, logloss=0.5)
    assert asked == ["models:/ranker@champion"]

    def broken(uri: str) -> tuple[float, float]:
        raise ValueError("schema mismatch\nand a traceback's worth of detail")

    score = registry.score_champion(_Registry("7"), "ranker", broken)
    assert score == ChampionScore("7", None, "ValueError: schema mismatch")
    assert should_promote(0.99, score, 0.0) is False


GOOD = validate.Validation(
    rows=1000,
    auc=0.75,
    logloss=0.5,
    mean_prediction=0.25,
    observed_ctr=0.25,
    parity_max_abs_diff=0.0,
    nonfinite_predictions=0,
)
SETTINGS = make_settings({"calibration_ratio": 2.0, "parity_tolerance": 1e-5, "min_auc": 0.5})


@pytest.mark.parametrize(
    ("change", "failed"),
    [
        ({}, []),
        ({"parity_max_abs_diff": 1e-5}, []),  # at the tolerance
        ({"parity_max_abs_diff": 2e-5}, ["exported model disagrees"]),
        ({"mean_prediction": 0.5}, []),  # ratio 2.0: the upper bound
        ({"mean_prediction": 0.125}, []),  # ratio 0.5: the lower bound
        ({"mean_prediction": math.nextafter(0.5, 1)}, ["miscalibrated"]),
        ({"mean_prediction": BELOW(0.125, 0)}, ["miscalibrated"]),
        ({"auc": 0.5}, []),  # at the floor
        ({"auc": BELOW(0.5, 0)}, ["below the floor"]),
        ({"auc": math.nan}, ["below the floor", "undefined"]),
        ({"observed_ctr": 0.0, "mean_prediction": 0.0}, ["single class"]),
        ({"nonfinite_predictions": 3, "parity_max_abs_diff": 1.0}, ["NaN or infinite"]),
    ],
)
def test_validation_fails_each_check_past_its_bound_only(change: dict, failed: list[str]) -> None:
    got = validate.failures(replace(GOOD, **change), SETTINGS)
    assert len(got) == len(failed), got
    for message, phrase in zip(got, failed, strict=True):
        assert phrase in message


def test_metrics_are_logged_under_the_publish_names_rounded_as_shown() -> None:
    assert GOOD.metrics() == {
        "publish/holdout_rows": 1000.0,
        "publish/holdout_auc": 0.75,
        "publish/holdout_logloss": 0.5,
        "publish/mean_prediction": 0.25,
        "publish/observed_ctr": 0.25,
        "publish/parity_max_abs_diff": 0.0,
        "publish/nonfinite_predictions": 0.0,
    }
    noisy = replace(GOOD, auc=0.781234567, logloss=0.4567891, parity_max_abs_diff=1.23456e-7)
    shown = noisy.metrics()
    assert shown["publish/holdout_auc"] == 0.78123 and shown["publish/holdout_logloss"] == 0.45679
    assert shown["publish/parity_max_abs_diff"] == 1.23e-7


@pytest.mark.parametrize(
    ("auc", "champion", "margin", "line"),
    [
        (0.5, ChampionScore(None, None), 0.0, "promoted to champion: first version"),
        (
            0.781,
            ChampionScore("3", 0.776),
            0.0,
            "promoted to champion: AUC 0.7810 vs 0.7760 (champion v3)",
        ),
        (
            0.770,
            ChampionScore("3", 0.776),
            0.002,
            "kept as candidate: AUC 0.7700 vs 0.7760 (champion v3), below the margin 0.002",
        ),
        (
            0.775,
            ChampionScore("3", 0.776),
            0.0,
            "kept as candidate: AUC 0.7750 vs 0.7760 (champion v3), below the champion",
        ),
        (
            0.780,
            ChampionScore("3", 0.776),
            -0.005,
            "kept as candidate: AUC 0.7800 vs 0.7760 (champion v3), short of the required "
            "gain 0.005",
        ),
        (
            0.9,
            ChampionScore("3", None, "OSError: artifacts missing"),
            0.0,
            "kept as candidate: AUC 0.9000; champion v3 could not be re-scored: OSError: "
            "artifacts missing",
        ),
    ],
)
def test_the_decision_line_says_promoted_or_kept_and_why(
    auc: float, champion: ChampionScore, margin: float, line: str
) -> None:
    """The first line of a version's description (and the gate record's ``reason``)."""
    promoted = should_promote(auc, champion, margin)
    assert line.startswith("promoted") is promoted
    assert gate.reason(auc, champion.version, champion.auc, margin, promoted, champion.error) == (
        line
    )


def test_the_gate_record_round_trips_through_its_json() -> None:
    decision = GateDecision(
        candidate_auc=0.781,
        candidate_logloss=0.45,
        champion_version="3",
        champion_auc=0.776,
        champion_logloss=0.46,
        margin=0.002,
        parity_max_abs_diff=1e-7,
        parity_tolerance=1e-5,
        promoted=True,
        reason="promoted to champion: AUC 0.7810 vs 0.7760 (champion v3)",
    )
    assert list(decision.to_dict()) == [
        "candidate_auc",
        "candidate_logloss",
        "champion_version",
        "champion_auc",
        "champion_logloss",
        "margin",
        "parity_max_abs_diff",
        "parity_tolerance",
        "promoted",
        "reason",
    ]
    assert GateDecision.from_json(decision.to_json()) == decision


def test_a_version_carries_at_most_five_tags() -> None:
    """Anything else about the anchor belongs on its LoggedModel: refused before MLflow."""
    assert len(registry.VERSION_TAGS) == 5
    with pytest.raises(ValueError, match="anchor_uri"):
        registry.register(
            None,  # type: ignore[arg-type]  # refused before the registry is asked
            "ranker",
            "key",
            "m-1",
            {"job_id": "j", "step": "20", "anchor_uri": "s3://b/x"},
            True,
            "promoted to champion: first version",
        )


def _committed(root: Path, step: int, anchor: bool) -> str:
    """A manifest only: enough for publish to read what the checkpoint claims to be."""
    folder = root / "jobs" / "pub2" / "checkpoints" / step_dir_name(step)
    folder.mkdir(parents=True)
    manifest = Manifest(step=step, world_size=2, config_hash="h", files={}, anchor=anchor)
    (folder / MANIFEST).write_text(replace(manifest, job_id="pub2").to_json())
    return f"file://{folder}"


def test_step_job_and_anchor_must_match_the_manifest(tmp_path: Path) -> None:
    """Refused from the manifest alone: nothing downloaded, no MLflow contacted."""
    anchor, step10 = _committed(tmp_path, 20, anchor=True), _committed(tmp_path, 10, anchor=False)
    with pytest.raises(PublishError, match="holds step 20, but step 7 was requested"):
        publish(anchor, step=7)
    with pytest.raises(PublishError, match="belongs to job 'pub2'"):
        publish(anchor, job_id="other")
    with pytest.raises(PublishError, match="not an anchor"):
        publish(step10)
    with pytest.raises(PublishError, match="is not a committed checkpoint"):
        publish(f"file://{tmp_path}/jobs/pub2/checkpoints/{step_dir_name(30)}")
