"""The publish gate's decision, as one record: what the candidate scored, what the champion
scored on the same rows, the margin and parity bounds, promoted or not, and why.

``reason`` is the first line of the model version's description ("promoted to champion: AUC
0.7810 vs 0.7760 (champion v3)"); the whole record is ``PublishResult.gate`` (the Prefect
publish flow renders it as a table) and the LoggedModel's tag ``ett.gate`` (JSON), from which a
publish of an anchor published already rebuilds it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any

GATE_TAG = "ett.gate"  # on the LoggedModel: the decision as JSON


@dataclass(frozen=True)
class GateDecision:
    candidate_auc: float
    candidate_logloss: float
    champion_version: str | None  # None: there was no champion
    champion_auc: float | None  # None: no champion, or it could not be re-scored
    champion_logloss: float | None
    margin: float  # promoted when candidate_auc >= champion_auc - margin
    parity_max_abs_diff: float
    parity_tolerance: float
    promoted: bool
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> GateDecision:
        return cls(**json.loads(text))


def _f(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.4f}"


def reason(
    candidate_auc: float,
    champion_version: str | None,
    champion_auc: float | None,
    margin: float,
    promoted: bool,
    champion_error: str | None = None,
) -> str:
    """The decision in one line, as the version description's first line."""
    if champion_version is None:
        return "promoted to champion: first version"
    versus = f"AUC {_f(candidate_auc)} vs {_f(champion_auc)} (champion v{champion_version})"
    if promoted:
        return f"promoted to champion: {versus}"
    if champion_auc is None or not math.isfinite(champion_auc):
        why = f": {champion_error}" if champion_error else ""
        return (
            f"kept as candidate: AUC {_f(candidate_auc)}; champion v{champion_version} could "
            f"not be re-scored{why}"
        )
    if not math.isfinite(candidate_auc):
        return f"kept as candidate: {versus}, the candidate has no AUC"
    if margin > 0:
        return f"kept as candidate: {versus}, below the margin {margin:g}"
    if margin < 0:
        return f"kept as candidate: {versus}, short of the required gain {-margin:g}"
    return f"kept as candidate: {versus}, below the champion"
