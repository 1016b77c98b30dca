"""A whole training job from a validated config: attempts, standby and side evaluator.

The one entry point for running a job, shared by the ``train`` flow and ``ett train``: it
turns the config into the attempt runner's settings (tasks/attempts.py), starts the side
evaluator once the job trains (``train.eval: async``), and ends every process it started,
whatever happens. No Prefect here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from infra.control import Progress
from infra.settings import CheckpointMode, EvalMode, JobConfig
from tasks.attempts import (
    AttemptProcess,
    AttemptReport,
    JobOutcome,
    JobRunner,
    LaunchSpec,
    Log,
    RetryPolicy,
    Timeouts,
)
from tasks.side_evaluator import SideEvaluator

# Time the side evaluator gets, after training, to evaluate the anchor checkpoint.
EVAL_FINISH_TIMEOUT_S = 300.0
# SIGTERM -> SIGKILL: the trainer's emergency checkpoint gets its budget, plus this margin.
GRACE_MARGIN_S = 10.0


def timeouts_for(
    config: JobConfig, hang_timeout_s: float, startup_timeout_s: float | None = None
) -> Timeouts:
    """The watch timeouts; the kill grace is never below the preemption budget."""
    return Timeouts(
        hang_s=hang_timeout_s,
        startup_s=startup_timeout_s
        if startup_timeout_s is not None
        else max(hang_timeout_s, 300.0),
        grace_s=config.checkpoint.preemption_budget_s + GRACE_MARGIN_S,
    )


def run_job(
    config: JobConfig,
    spec: LaunchSpec,
    policy: RetryPolicy,
    timeouts: Timeouts,
    first_attempt: int,
    log: Log | None = None,
    run_attempt: Callable[[JobRunner, AttemptProcess], AttemptReport] | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    on_attempt: Callable[[AttemptReport], None] | None = None,
    scheduling: tuple[float, float] | None = None,
) -> JobOutcome:
    """Run the job to its outcome. ``run_attempt(runner, attempt)`` watches one attempt
    (default: ``runner.watch_attempt``; the flow wraps it in a Prefect task)."""
    log = log or logging.getLogger("ett.orchestrator")
    evaluator = SideEvaluator(spec.config_path, log)
    async_eval = (
        config.train.eval == EvalMode.ASYNC and config.checkpoint.mode != CheckpointMode.OFF
    )
    runner = JobRunner(
        job_url=config.job_url,
        spec=spec,
        policy=policy,
        timeouts=timeouts,
        standby=config.recovery.standby,
        first_attempt=first_attempt,
        log=log,
        on_progress=on_progress,
        on_attempt=on_attempt,
        on_settled=evaluator.start if async_eval else None,
        scheduling=scheduling,
    )
    watch = (lambda a: run_attempt(runner, a)) if run_attempt is not None else None
    try:
        outcome = runner.run(watch)
        if outcome.succeeded and async_eval:
            evaluator.finish(EVAL_FINISH_TIMEOUT_S)
        return outcome
    finally:
        evaluator.stop()
