"""The training driver: init stages, the loop, evaluation and shutdown, each a ledger span.

Runs under torchrun (any number of processes) or alone, and never imports Prefect: the
orchestrator launches it as ``python -m trainer --config FILE`` and reads its exit code
(infra/exit_codes.py) and its ledger.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from infra import storage
from infra.exit_codes import ExitCode
from infra.ledger import Ledger, ledger_url
from infra.library_logs import quiet_library_dumps
from infra.settings import CheckpointMode, ConfigError, JobConfig, load_config, load_resolved
from trainer.checkpoint.checkpointer import Checkpointer
from trainer.checkpoint.manifest import CheckpointError
from trainer.checkpoint.state import app_state
from trainer.data.batch import Batch
from trainer.distributed import DistEnv
from trainer.evaluation import evaluate
from trainer.init_stages import initialize
from trainer.model import batch_to_kjts

log = logging.getLogger("trainer")


@dataclass
class Preemption:
    """SIGTERM sets the flag; the loop acts on it at the next step boundary."""

    requested: bool = False
    at: float | None = None

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested, self.at = True, time.time()

    def agreed(self, env: DistEnv) -> bool:
        """True on every rank once any rank was told to stop, so all stop at the same step."""
        if env.world_size == 1:
            return self.requested
        flag = torch.tensor([int(self.requested)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


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


def next_attempt(job_url: str, rank: int) -> int:
    """The attempt number: ETT_ATTEMPT from the orchestrator, else one past this rank's
    previous trainer ledgers (each rank counts its own files, so all ranks agree)."""
    if "ETT_ATTEMPT" in os.environ:
        return int(os.environ["ETT_ATTEMPT"])
    pattern = storage.join(ledger_url(job_url), f"trainer-attempt*-rank{rank:03d}.jsonl")
    return len(storage.glob(pattern))


def train_step(model: torch.nn.Module, optimizer: Any, batch: Batch, device: torch.device) -> float:
    """One forward/backward/update; sparse tables are updated inside backward (fused)."""
    batch = batch.to(device, non_blocking=True)
    sparse, history = batch_to_kjts(batch)
    logits = model(batch.dense, sparse, history)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def run(config: JobConfig) -> int:
    """Train one attempt of the job; returns the process exit code."""
    storage.configure(config.storage)
    rank = int(os.environ.get("RANK", "0"))
    attempt = next_attempt(config.job_url, rank)
    ledger = Ledger(config.job_url, attempt=attempt, rank=rank)
    ledger.mark("attempt_start", pid=os.getpid())
    preemption = Preemption()
    preemption.install()
    try:
        return _train(config, ledger, preemption)
    except CheckpointError as exc:  # corrupt or incompatible: relaunching cannot help
        log.error("cannot resume: %s", exc)
        return ExitCode.CHECKPOINT_INCOMPATIBLE
    finally:
        ledger.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def should_checkpoint(config: JobConfig, step: int, last_save: float, now: float) -> bool:
    """Interval in steps, in seconds, or both (whichever comes first)."""
    ckpt = config.checkpoint
    if (
        ckpt.mode == CheckpointMode.OFF or step >= config.train.steps
    ):  # the last step gets the anchor
        return False
    by_steps = ckpt.every_steps is not None and step % ckpt.every_steps == 0
    by_time = ckpt.every_seconds is not None and now - last_save >= ckpt.every_seconds
    return by_steps or by_time


def _train(config: JobConfig, ledger: Ledger, preemption: Preemption) -> int:
    parts = initialize(config, ledger)
    env, model, optimizer, loader = parts.env, parts.model, parts.optimizer, parts.loader
    checkpointer, holdout, faults = parts.checkpointer, parts.holdout, parts.faults
    batches, pending = parts.batches, parts.first_batch
    start_step = parts.start_step

    def snapshot() -> tuple[dict[str, Any], dict[str, Any]]:
        """What a checkpoint holds: tensors for DCP, and this rank's data position."""
        return app_state(model, optimizer, env.rank), {"loader": loader.state_dict()}

    stats = LoopStats()
    step = start_step
    last_save = time.time()
    try:
        while step < config.train.steps:
            if preemption.agreed(env):
                _save_on_preemption(config, checkpointer, step, snapshot)
                return ExitCode.PREEMPTED
            checkpointer.wait_until_staged()
            step += 1
            faults.at_step(step)
            with ledger.span("train_step", step=step) as attrs:
                batch = pending if pending is not None else next(batches)
                pending = None
                loss = train_step(model, optimizer, batch, env.device)
                attrs["loss"] = round(loss, 6)
            stats.add(loss, len(batch))
            if step % config.train.log_every == 0 and env.is_main:
                mean_loss, rate = stats.take()
                log.info(
                    "step %d/%d loss %.4f %.0f examples/s",
                    step,
                    config.train.steps,
                    mean_loss,
                    rate * env.world_size,
                )
            if config.train.eval_every and step % config.train.eval_every == 0:
                with ledger.span("eval", step=step) as attrs:
                    stats.last_eval = evaluate(model, holdout, env.device)
                    attrs.update(stats.last_eval)
                if env.is_main:
                    log.info("step %d holdout %s", step, _fmt(stats.last_eval))
            if should_checkpoint(config, step, last_save, time.time()):
                checkpointer.save(step, snapshot)
                last_save = time.time()

        with ledger.span("shutdown", step=step):
            if not stats.last_eval or config.train.steps % max(config.train.eval_every, 1):
                stats.last_eval = evaluate(model, holdout, env.device)
            if (
                config.checkpoint.mode != CheckpointMode.OFF and step > start_step
            ):  # else: anchored already
                checkpointer.save(step, snapshot, anchor=True)
            checkpointer.close()
            anchor_failed = step in checkpointer.failed_steps
            if env.is_main:
                log.info("final holdout %s (loader %s)", _fmt(stats.last_eval), loader.stats)
                summary = {"step": step, **stats.last_eval, **loader.stats}
                metrics_url = storage.join(config.job_url, "final_metrics.json")
                try:
                    storage.write_text(metrics_url, json.dumps(summary, indent=2))
                except OSError as exc:  # a summary: never worth failing the job over
                    log.error("could not write %s: %s", metrics_url, exc)
            dist.barrier()
    finally:
        checkpointer.close()
    if anchor_failed:  # the model of this job is not saved: let the orchestrator retry
        log.error(
            "the anchor checkpoint at step %d did not commit; exiting %d so the attempt "
            "is retried from the newest committed checkpoint",
            step,
            ExitCode.ANCHOR_NOT_SAVED,
        )
        return ExitCode.ANCHOR_NOT_SAVED
    ledger.mark("job_end", step=step)
    return ExitCode.SUCCESS


def _save_on_preemption(
    config: JobConfig,
    checkpointer: Checkpointer,
    step: int,
    snapshot: Callable[[], tuple[dict[str, Any], dict[str, Any]]],
) -> None:
    """Preempted: finish the in-flight upload if the budget allows, then save synchronously."""
    budget = config.checkpoint.preemption_budget_s
    log.warning("preempted: saving at step %d within %.0f s", step, budget)
    if config.checkpoint.mode == CheckpointMode.OFF:
        return
    try:
        checkpointer.wait_for_inflight(timeout_s=budget / 2)
    except TimeoutError:
        checkpointer.abandon_inflight()
    checkpointer.save(step, snapshot, blocking=True)


def _fmt(metrics: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4f}" for k, v in metrics.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer", description=__doc__)
    parser.add_argument(
        "--config", help="job config file (YAML/TOML); embedded defaults if omitted"
    )
    args = parser.parse_args(argv)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s [rank{rank}] %(name)s: %(message)s",
        stream=sys.stdout,
        force=True,  # an imported library may have configured logging already
    )
    quiet_library_dumps()  # TorchRec's planner report, FBGEMM's table dumps: DEBUG
    try:
        # The launcher resolved the config (parameters > ETT_* > file): it is final here.
        config = load_resolved(args.config) if args.config else load_config()
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return ExitCode.USAGE
    return run(config)
