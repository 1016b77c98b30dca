"""The training driver: one attempt of a job on one rank, read top to bottom.

``main``: parse the config, build the parts (trainer/init_stages.py), train, close. Every
failure the attempt cannot train past ends in one place, ``EXIT_CODES``: the orchestrator
classifies the attempt from the exit code alone (infra/exit_codes.py), and learns the rest
from the ledger and the progress rank 0 reports on its control channel (infra/control.py).
Runs under torchrun (``python -m trainer.launch``) or alone, and never imports Prefect.

``train``: the loop. Each step boundary the ranks agree, without stopping, on a preemption
(SIGTERM) and on a checkpoint rank 0's clock asked for (trainer/consensus.py); the
checkpointer decides what to save and when (trainer/checkpoint/checkpointer.py); an
exception in a step is recovered in process (trainer/restart.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from infra import log_lines, storage
from infra.accounting.ledger import Ledger, next_attempt, recover_orphaned_spools
from infra.accounting.ledger_format import Mark, Span
from infra.checkpoint_manifest import CheckpointError
from infra.config_sources import ConfigError
from infra.control import ENV_ATTEMPT, ENV_STANDBY, JobState, Phase, RankControl
from infra.exit_codes import ExitCode
from infra.job_layout import JobLayout
from infra.lease import JobLocked, trainer_lease
from infra.processes import die_with_parent
from infra.settings import ConsensusMode, EvalMode, JobConfig, load_config, load_resolved
from trainer import gc_policy
from trainer.checkpoint.interval import FailureHistory
from trainer.consensus import StepConsensus
from trainer.data.batch import Batch
from trainer.data.decode import DataError
from trainer.flops import record_model_flops
from trainer.holdout_metrics import evaluate
from trainer.init_stages import Components, Initializer, StandbyReleased
from trainer.model import batch_to_kjts
from trainer.restart import InProcessRestart

log = logging.getLogger("trainer")

# What the attempt exits with when one of these ends it, and how the log line starts.
EXIT_CODES: dict[type[Exception], tuple[ExitCode, str]] = {
    StandbyReleased: (ExitCode.SUCCESS, "not promoted"),  # the job needed no standby
    ConfigError: (ExitCode.USAGE, "bad config"),
    JobLocked: (ExitCode.JOB_LOCKED, "job locked"),  # another live job holds this job id
    CheckpointError: (ExitCode.CHECKPOINT_INCOMPATIBLE, "cannot resume"),  # no relaunch helps
    DataError: (ExitCode.BAD_DATA, "bad data"),
    storage.StorageError: (ExitCode.STORAGE_UNAVAILABLE, "storage unavailable"),  # retries spent
}


def exit_code_of(exc: Exception) -> ExitCode:
    """The exit code ``EXIT_CODES`` gives ``exc`` (its nearest class there), said in the log."""
    code, what = next(EXIT_CODES[t] for t in type(exc).__mro__ if t in EXIT_CODES)
    (log.info if code == ExitCode.SUCCESS else log.error)("%s: %s", what, exc)
    return code


@dataclass
class Preemption:
    """SIGTERM sets the flag; the ranks agree to stop at a step boundary (trainer/consensus.py)."""

    requested: bool = False
    at: float | None = None

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested, self.at = True, time.time()


@dataclass
class LoopStats:
    """Running numbers for progress lines and the final summary."""

    examples: int = 0
    loss_sum: float = 0.0
    loss_count: int = 0
    since: float = field(default_factory=time.perf_counter)
    last_eval: dict[str, float] = field(default_factory=dict)

    def add(self, loss: float, rows: int) -> None:
        self.examples += rows
        self.loss_sum += loss
        self.loss_count += 1

    def take(self) -> tuple[float, float]:
        """Mean loss and examples/s since the last call."""
        elapsed = max(time.perf_counter() - self.since, 1e-9)
        out = (self.loss_sum / max(self.loss_count, 1), self.examples / elapsed)
        self.examples, self.loss_sum, self.loss_count = 0, 0.0, 0
        self.since = time.perf_counter()
        return out


def main(argv: list[str] | None = None) -> int:
    """A rank's process: parse, build, train, close. It never outlives its launcher, and
    its exit code is what the orchestrator learns of how it ended."""
    die_with_parent()
    gc_policy.pause()  # until init is done (trainer/gc_policy.py)
    try:
        control = RankControl.from_env(int(os.environ.get("LOCAL_RANK", "0")))
    except FileNotFoundError as exc:  # the orchestrator ended this attempt before it started
        log.warning("not started: the control channel is gone (%s)", exc.filename)
        return ExitCode.SUCCESS if os.environ.get(ENV_STANDBY) == "1" else ExitCode.PREEMPTED
    code: int = ExitCode.CRASH  # anything not in EXIT_CODES: the exception goes on up
    ledger: Ledger | None = None
    try:
        config = parse(argv)
        with attempt(config, control) as (ledger, preemption):
            parts = Initializer(config, ledger, control).run()
            gc_policy.settle()
            code = train(config, parts, ledger, preemption, control)
    except tuple(EXIT_CODES) as exc:
        code = exit_code_of(exc)
    finally:
        code = close(code, ledger, control)
    return code


def parse(argv: list[str] | None) -> JobConfig:
    """The command line and the job config; logging set up for this rank."""
    parser = argparse.ArgumentParser(prog="python -m trainer", description=__doc__)
    parser.add_argument("--config", help="job config (YAML/TOML); embedded defaults if omitted")
    args = parser.parse_args(argv)
    log_lines.configure_rank()  # levels the orchestrator keeps; library noise at DEBUG
    # The launcher resolved the config (parameters > ETT_* > file): it is final here.
    return load_resolved(args.config) if args.config else load_config()


@contextlib.contextmanager
def attempt(config: JobConfig, control: RankControl | None) -> Iterator[tuple[Ledger, Preemption]]:
    """What the attempt holds open on this rank: the job's lease, its ledger, the SIGTERM
    flag and the orchestrator's lifeline; the ledger is stored and the process group
    destroyed on the way out, whatever ended the attempt."""
    storage.configure(config.storage)
    rank = int(os.environ.get("RANK", "0"))
    # One job id, one job (infra/lease.py); without an orchestrator, rank 0's number for all.
    with trainer_lease(config.layout, rank, attempt_number(config.layout, rank)) as number:
        recover_orphaned_spools(config.layout)  # ledger events of killed attempts on this node
        ledger = Ledger(config.layout, attempt=number, rank=rank)
        ledger.mark(Mark.ATTEMPT_START, pid=os.getpid(), standby=bool(control and control.standby))
        preemption = Preemption()
        preemption.install()
        if control is not None:  # the orchestrator died: stop as if preempted (checkpoint, exit)
            control.start(on_lost=lambda: os.kill(os.getpid(), signal.SIGTERM))
            if rank == 0:
                control.report(Phase.INIT)
        try:
            yield ledger, preemption
        finally:
            ledger.close()
            if dist.is_initialized():
                dist.destroy_process_group()


def close(code: int, ledger: Ledger | None, control: RankControl | None) -> int:
    """The exit code, told to the orchestrator: a job that trained but whose accounting is
    not stored is not a success."""
    if ledger is not None and not ledger.close() and code == ExitCode.SUCCESS:
        log.error(
            "the ETT ledger %s was not stored; exiting %d", ledger.url, ExitCode.LEDGER_NOT_SAVED
        )
        code = ExitCode.LEDGER_NOT_SAVED
    if control is not None:
        control.record_exit(code)
    return code


def attempt_number(layout: JobLayout, rank: int) -> int:
    """This rank's attempt number: ETT_ATTEMPT from the orchestrator, else one past this
    rank's previous trainer ledgers. Only rank 0's count is the launch's (rank 0 is in every
    launch; rank 1 of a job that ran on 1 rank in between counts one launch fewer): the
    other ranks take rank 0's from its lease (``trainer_lease``)."""
    if ENV_ATTEMPT in os.environ:
        return int(os.environ[ENV_ATTEMPT])
    return next_attempt(layout, role="trainer", rank=rank)


def failure_history(control: RankControl | None) -> FailureHistory:
    """The job's failures so far and when it started, as the orchestrator wrote them in the
    attempt's control folder (after a promotion: as of the promotion); none without one."""
    state = control.job_state() if control is not None else JobState()
    return FailureHistory(state.failures, state.started_at)


def progress_reporter(
    control: RankControl | None, is_main: bool
) -> Callable[[Phase, int, int, int], None]:
    """Rank 0's progress record for the orchestrator; a no-op anywhere else."""
    if control is None or not is_main:
        return lambda phase, step, total, restarts: None
    return control.report


def train_step(
    model: torch.nn.Module,
    optimizer: Any,
    batch: Batch,
    device: torch.device,
    track: Callable[..., None] | None = None,
    before_update: Callable[[], object] | None = None,
) -> float:
    """One forward/backward/update; sparse tables are updated inside backward (fused).
    ``track`` is told the step's KeyedJaggedTensors: the rows the update touches;
    ``before_update`` is called between forward and backward, the last moment the state is
    still the previous step's (a checkpoint's copy of it may run until then)."""
    batch = batch.to(device, non_blocking=True)
    sparse, history = batch_to_kjts(batch)
    if track is not None:
        track(sparse, history)
    logits = model(batch.dense, sparse, history)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
    if before_update is not None:
        before_update()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def train(
    config: JobConfig,
    parts: Components,
    ledger: Ledger,
    preemption: Preemption,
    control: RankControl | None,
) -> int:
    """The loop, then the anchor checkpoint; returns the exit code."""
    env, model, optimizer, loader = parts.env, parts.model, parts.optimizer, parts.loader
    checkpointer, faults = parts.checkpointer, parts.faults
    batches, pending = parts.batches, parts.first_batch
    total, every_eval = config.train.steps, config.train.eval_every
    eval_inline = config.train.eval == EvalMode.INLINE and every_eval > 0
    checkpointer.start(parts.start_step, failure_history(control))
    restarter = InProcessRestart(config, env, ledger, checkpointer)
    blocking = config.train.step_consensus == ConsensusMode.BLOCKING
    consensus = StepConsensus(env.world_size, parts.control_group, blocking)
    report = progress_reporter(control, env.is_main)
    model_flops = record_model_flops(ledger, config, env.device, env.world_size)
    stats = LoopStats()
    step = finished = parts.start_step  # finished: the last step that ran to its end
    try:
        while step < total:
            agreed = consensus.exchange(
                preemption.requested,
                checkpointer.due_by_clock(step),
                checkpointer.copy_due_by_clock(step),
            )
            checkpointer.maybe_save(step, agreed)
            if agreed.preempt:  # every rank stops here and saves, within the budget
                saved = checkpointer.emergency_save(step)
                return ExitCode.PREEMPTED if saved else ExitCode.EMERGENCY_SAVE_FAILED
            step += 1
            try:
                faults.at_step(step)
                with ledger.span(Span.TRAIN_STEP, step=step) as attrs:
                    batch = pending if pending is not None else next(batches)
                    pending = None
                    loss = train_step(
                        model,
                        optimizer,
                        batch,
                        env.device,
                        checkpointer.track,
                        checkpointer.wait_until_staged,  # the copy of the state, if any
                    )
                    attrs["loss"] = round(loss, 6)
                    attrs["rows_digest"] = batch.row_digest()  # the ranks' sum: the global batch's
                    attrs["flops"] = model_flops.of_batch(batch.history_offsets)
            except (DataError, StandbyReleased):
                raise
            except Exception as exc:  # noqa: BLE001 - recovered in place, or re-raised
                step = finished = restarter.recover(exc, step)
                batches, pending = iter(loader), None
                report(Phase.TRAINING, step, total, restarter.restarts)  # counted by the next
                continue
            finished = step
            checkpointer.step_done()
            stats.add(loss, len(batch))
            report(Phase.TRAINING, step, total, restarter.restarts)
            if step % config.train.log_every == 0 and env.is_main:
                mean_loss, rate = stats.take()
                log.info(
                    "step %d/%d loss %.4f %.0f examples/s",
                    step,
                    total,
                    mean_loss,
                    rate * env.world_size,
                )
            if eval_inline and step % every_eval == 0:  # else the side evaluator, if any
                _evaluate(parts, ledger, stats, step)
        return _shutdown(config, parts, ledger, stats, step)
    finally:
        checkpointer.close()
        if control is None:  # no orchestrator: nobody relaunches this job, nor cleans up
            checkpointer.drop_memory_tier()
        report(Phase.DONE, finished, total, restarter.restarts)  # never the step that failed


def _evaluate(parts: Components, ledger: Ledger, stats: LoopStats, step: int) -> None:
    env = parts.env
    with ledger.span(Span.EVAL, step=step) as attrs:
        stats.last_eval = evaluate(parts.model, parts.holdout, env.device, env.cpu_group)
        attrs.update(stats.last_eval)
    if env.is_main:
        log.info("step %d holdout %s", step, _fmt(stats.last_eval))


def _shutdown(
    config: JobConfig, parts: Components, ledger: Ledger, stats: LoopStats, step: int
) -> int:
    """The anchor checkpoint (and, in the loop's eval mode, the final evaluation)."""
    env, checkpointer = parts.env, parts.checkpointer
    with ledger.span(Span.SHUTDOWN, step=step):
        just_evaluated = stats.last_eval and step % max(config.train.eval_every, 1) == 0
        if config.train.eval == EvalMode.INLINE and not just_evaluated:
            stats.last_eval = evaluate(parts.model, parts.holdout, env.device, env.cpu_group)
        anchored = checkpointer.save_anchor(step)
        checkpointer.close()
        if env.is_main:
            log.info("final loader %s", parts.loader.stats)
            if stats.last_eval:
                log.info("final holdout %s", _fmt(stats.last_eval))
                _write_final_metrics(config, step, stats.last_eval, parts.loader.stats)
        dist.barrier(group=parts.control_group)
    if not anchored:  # the model of this job is not saved: let the orchestrator retry
        log.error(
            "the anchor checkpoint at step %d did not commit; exiting %d so the attempt is "
            "retried from the newest committed checkpoint",
            step,
            ExitCode.ANCHOR_NOT_SAVED,
        )
        return ExitCode.ANCHOR_NOT_SAVED
    ledger.mark(Mark.JOB_END, step=step)
    checkpointer.drop_memory_tier()  # the anchor is committed: no restore needs the copies
    return ExitCode.SUCCESS


def _write_final_metrics(
    config: JobConfig, step: int, metrics: dict[str, float], loader_stats: dict[str, int]
) -> None:
    summary = {"step": step, **metrics, "loader": loader_stats}
    url = config.layout.final_metrics
    try:
        storage.write_text(url, json.dumps(summary, indent=2))
    except OSError as exc:  # a summary: never worth failing the job over
        log.error("could not write %s: %s", url, exc)


def _fmt(metrics: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4f}" for k, v in metrics.items())
