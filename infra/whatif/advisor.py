"""Checkpoint interval advisor: Young's optimum tau* = sqrt(2 * C * MTBF).

Checkpointing every tau seconds of training costs C/tau of the time in blocking, and a failure
loses on average tau/2 of unsaved training, i.e. tau/(2 * MTBF) of the time: the sum is
smallest at tau* (for example C = 15 s and 3 failures a day give tau* ~ 930 s and ~3.2%
waste). With async checkpoints C is only the blocking (staging) part, and since at most one
upload is in flight the interval must also be at least the upload time, or the next save waits
for the previous one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from infra.accounting.records import EttReport

DAY_S = 86_400.0


@dataclass(frozen=True)
class Advice:
    """The recommended interval and what it should cost (fractions of wall time)."""

    interval_s: float
    interval_steps: int | None
    young_interval_s: float  # unconstrained tau*
    waste_fraction: float  # C/tau + tau/(2 MTBF) at the recommended interval
    blocking_s: float
    mtbf_s: float
    step_time_s: float | None
    upload_s: float | None
    bound_by_upload: bool
    current_interval_s: float | None = None
    current_waste_fraction: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """A few lines for the terminal: the advice, why, and what it saves."""
        steps = f" ({self.interval_steps} steps)" if self.interval_steps else ""
        block = self.blocking_s / self.interval_s
        lines = [
            f"checkpoint every {self.interval_s:.1f} s{steps}",
            f"Young: tau* = sqrt(2 x C {self.blocking_s:g} s x MTBF {self.mtbf_s:g} s) "
            f"= {self.young_interval_s:.1f} s",
            f"predicted waste {100 * self.waste_fraction:.2f}% (blocking {100 * block:.2f}% "
            f"+ unsaved {100 * (self.waste_fraction - block):.2f}%)",
        ]
        if self.bound_by_upload:
            lines.append(f"raised to the upload time {self.upload_s:g} s (one upload in flight)")
        if self.current_interval_s and self.current_waste_fraction is not None:
            lines.append(
                f"current interval {self.current_interval_s:.1f} s wastes "
                f"{100 * self.current_waste_fraction:.2f}%"
            )
        return "\n".join(lines)


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young's tau* = sqrt(2 C MTBF): the interval that minimises blocking plus lost work."""
    return math.sqrt(2.0 * cost_s * mtbf_s)


def waste_fraction(interval_s: float, blocking_s: float, mtbf_s: float) -> float:
    """Young's first-order waste: blocking share plus expected unsaved share."""
    return blocking_s / interval_s + interval_s / (2.0 * mtbf_s)


def optimal_interval(
    blocking_s: float,
    mtbf_s: float,
    step_time_s: float | None = None,
    upload_s: float | None = None,
) -> Advice:
    """Young's interval, raised to the upload time when async uploads would pile up.

    In steps (when the step time is known) the interval is rounded to the nearest step count
    that does not fall below the upload time.
    """
    if blocking_s <= 0 or mtbf_s <= 0:
        raise ValueError(f"need blocking_s > 0 and mtbf_s > 0, got {blocking_s}, {mtbf_s}")
    young = young_interval(blocking_s, mtbf_s)
    bound = upload_s is not None and upload_s > young
    interval = upload_s if bound and upload_s is not None else young
    steps = None
    if step_time_s:
        steps = max(1, round(interval / step_time_s))
        if upload_s is not None and steps * step_time_s < upload_s:
            steps = math.ceil(upload_s / step_time_s)
        interval = steps * step_time_s
    return Advice(
        interval_s=interval,
        interval_steps=steps,
        young_interval_s=young,
        waste_fraction=waste_fraction(interval, blocking_s, mtbf_s),
        blocking_s=blocking_s,
        mtbf_s=mtbf_s,
        step_time_s=step_time_s,
        upload_s=upload_s,
        bound_by_upload=bound,
    )


def advise_from_report(
    report: EttReport,
    failures_per_day: float | None = None,
    mtbf_s: float | None = None,
    blocking_s: float | None = None,
    upload_s: float | None = None,
) -> Advice:
    """Advice from an observed job: its blocking per checkpoint, step time and upload time
    (commit latency), and its failure rate (failures over wall time) unless one is given.

    A single job rarely sees enough failures for a good MTBF; pass the fleet's
    ``failures_per_day`` (or ``mtbf_s``) when known.
    """
    if mtbf_s is None and failures_per_day:
        mtbf_s = DAY_S / failures_per_day
    if mtbf_s is None:
        if report.num_failures == 0:
            raise ValueError("the job saw no failure: pass failures_per_day or mtbf_s")
        mtbf_s = report.wall_s / report.num_failures
    blocking = blocking_s if blocking_s is not None else report.checkpoint_blocking_mean_s
    if not blocking:
        raise ValueError("the job recorded no checkpoint_blocking span: pass blocking_s")
    upload = upload_s if upload_s is not None else report.commit_latency_s
    advice = optimal_interval(blocking, mtbf_s, report.step_time_median_s, upload)
    current = report.checkpoint_interval_s
    if not current:
        return advice
    return replace(
        advice,
        current_interval_s=current,
        current_waste_fraction=waste_fraction(current, blocking, mtbf_s),
    )
