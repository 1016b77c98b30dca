"""Scale-out projection: a measured job's ETT% at 1 to 16,384 GPUs.

The measured job (one small run, its ledger) gives the costs per event: step time, blocking
per checkpoint, upload time, startup, restart per failure, shutdown, eval/other overhead
(``JobModel.from_report``). ``ScalingLaws`` (infra/whatif/scaling.py) says how each changes with the
number of GPUs N. At each N the checkpoint interval is the advisor's (Young's, raised to the
upload time) for that N's MTBF, and the ETT% is the mean of seeded Monte Carlo replays of the
whole job under exponential failures (``infra/whatif/simulate.py``): the same replay that
``validate`` checks against the measured run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from infra.whatif.advisor import DAY_S, Advice, optimal_interval
from infra.whatif.scaling import MAX_GPUS, TABLE_GPUS, ScalingLaws
from infra.whatif.simulate import MonteCarloResult, monte_carlo
from infra.whatif.simulated_job import JobModel


def scaled(model: JobModel, laws: ScalingLaws, gpus: int, work_s: float) -> tuple[JobModel, Advice]:
    """The measured job at ``gpus`` GPUs doing ``work_s`` of training, at the advisor's interval."""
    if model.blocking_s <= 0:
        raise ValueError("the job recorded no checkpoint blocking: the advisor needs C > 0")
    advice = optimal_interval(
        model.blocking_s, laws.mtbf_s(gpus), model.step_time_s, model.upload_s or None
    )
    extra = laws.rendezvous_extra_s(gpus)
    at_scale = model.with_changes(
        work_s=work_s,
        interval_s=advice.interval_s,
        startup_s=model.startup_s + extra,
        restart_s=model.restart_s + extra,
        restart_by_cause={},
    )
    return at_scale, advice


@dataclass(frozen=True)
class JobAtScale:
    """One job at one N: its interval, restart cost and Monte Carlo ETT%."""

    interval_s: float
    restart_s: float
    ett: MonteCarloResult


@dataclass(frozen=True)
class ProjectionRow:
    gpus: int
    nodes: int
    failures_per_day: float
    mtbf_s: float
    jobs: dict[str, JobAtScale]


@dataclass(frozen=True)
class Projection:
    """ETT% of each job at each N, with the scenario and the assumptions that produced it."""

    laws: ScalingLaws
    work_s: float
    runs: int
    seed: int
    rows: tuple[ProjectionRow, ...]

    @property
    def labels(self) -> list[str]:
        return list(self.rows[0].jobs) if self.rows else []

    def at(self, gpus: int) -> ProjectionRow:
        return next(r for r in self.rows if r.gpus == gpus)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["assumptions"] = self.laws.describe()
        return out


def gpu_grid(max_gpus: int = MAX_GPUS) -> list[int]:
    """Powers of two from 1 to ``max_gpus``, plus the table's sizes: the plot's x axis."""
    grid = {2**k for k in range(int(math.log2(max_gpus)) + 1)} | set(TABLE_GPUS)
    return sorted(g for g in grid if g <= max_gpus)


def project(
    models: Mapping[str, JobModel],
    laws: ScalingLaws,
    work_s: float,
    gpus: Iterable[int] = TABLE_GPUS,
    runs: int = 300,
    seed: int = 0,
) -> Projection:
    """Each job at each N. The same seed at every N and for every job: the draws are common
    random numbers, scaled by each N's MTBF, so differences come from N and the job."""
    if work_s <= 0:
        raise ValueError(f"the job length must be > 0, got {work_s / DAY_S:g} days")
    if not models:
        raise ValueError("no job to project")
    if runs < 1:
        raise ValueError(f"need at least one Monte Carlo run per point, got {runs}")
    for label, model in models.items():
        if not model.restart_by_cause:
            raise ValueError(
                f"{label}: the job recovered from no failure, so its restart cost is unknown "
                "(measure a run with at least one injected failure)"
            )
    rows = []
    for n in sorted(set(gpus)):
        if n < 1:
            raise ValueError(f"GPU counts must be >= 1, got {n}")
        mtbf = laws.mtbf_s(n)
        jobs = {}
        for label, model in models.items():
            at_scale, advice = scaled(model, laws, n, work_s)
            mc = monte_carlo(at_scale, mtbf, runs=runs, seed=seed)
            jobs[label] = JobAtScale(advice.interval_s, at_scale.restart_s, mc)
        rows.append(ProjectionRow(n, laws.nodes(n), laws.failures_per_day(n), mtbf, jobs))
    return Projection(
        laws=laws,
        work_s=work_s,
        runs=runs,
        seed=seed,
        rows=tuple(rows),
    )
