"""Async evaluation (``train.eval: async``): a side process evaluates the job's committed
checkpoints on CPU while training goes on, instead of the loop stopping every rank.

    python -m trainer.checkpoint_evaluator --config FILE [--poll-s 0.5] [--once]

What it evaluates: committed checkpoints whose step is a multiple of ``train.eval_every``,
and the anchor (the final checkpoint), each at most once, in increasing step order, never
one older than the newest already evaluated (read back from its own ledger on start, so a
restarted evaluator does not repeat itself). It evaluates the holdout rows a 1-rank
trainer evaluates, with the trainer's metric function, in one unsharded CPU model that DCP
fills from the shards of however many ranks wrote the checkpoint.

What it writes: one ``async_eval`` span per evaluated checkpoint in the job's ledger (role
``evaluator``; the span covers load + evaluate), and ``final_metrics.json`` after the anchor.

Why it polls: a new checkpoint is a new ``manifest.json`` (written last, so a listed
checkpoint is complete). On local disk a poll is one directory listing and a few small file
reads, far below what one training step costs, and checkpoints arrive seconds apart at the
earliest, so a 0.5 s poll adds at most that to the metrics' latency. No portable change
notification covers both local disk and object storage; there a poll is one LIST plus a
small GET per kept checkpoint: raise ``--poll-s`` for such a job.

Retention may delete a checkpoint while it is read. The weights are loaded first (files
verified against the manifest, then deserialised) and only then evaluated from memory; a
checkpoint that vanished or fails verification is logged in one line and skipped.

It never outlives the job that started it: the orchestrator keeps its stdin open and closes
it (or dies, which closes it too) to stop it; EOF on stdin or SIGTERM ends it at once with
exit code 0, keeping whatever was fully written. It exits 0 by itself after the anchor.
It takes one torch thread at a lowered priority, so training keeps the machine's cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.api import CheckpointException

from infra import log_lines, storage
from infra.accounting.ledger import Ledger
from infra.accounting.ledger_format import Span, parse_lines
from infra.checkpoint_manifest import CheckpointError, CommittedCheckpoint, committed_checkpoints
from infra.config_sources import ConfigError
from infra.exit_codes import ExitCode
from infra.job_layout import JobLayout
from infra.settings import JobConfig, load_config
from trainer.checkpoint.compose import load_model
from trainer.data.batch import Batch
from trainer.data.decode import DataError
from trainer.data.sequential import holdout_batches
from trainer.holdout_metrics import evaluate
from trainer.unsharded import cpu_model

log = logging.getLogger("trainer.checkpoint_evaluator")

ROLE = "evaluator"
DEFAULT_NICE = 10
# What a checkpoint that vanished, is corrupt or half-deleted raises while it is read.
# DCP wraps a reader's error in CheckpointException, a BaseException.
_READ_ERRORS = (
    CheckpointError,
    CheckpointException,
    OSError,
    RuntimeError,
    ValueError,
    KeyError,
    EOFError,
)


def wanted(ckpt: CommittedCheckpoint, eval_every: int) -> bool:
    """An eval-step checkpoint, or the anchor."""
    return ckpt.manifest.anchor or (eval_every > 0 and ckpt.step % eval_every == 0)


def _identity(ckpt: CommittedCheckpoint) -> tuple[str, float]:
    """A checkpoint rewritten at the same URL (a retried anchor) is a new one."""
    return ckpt.url, ckpt.manifest.created


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


@dataclass(frozen=True)
class Evaluation:
    ckpt: CommittedCheckpoint
    metrics: dict[str, float]  # auc, logloss, rows
    start: float
    end: float

    @property
    def rows(self) -> int:
        return int(self.metrics["rows"])


class Lifeline:
    """Ends the process at once, with exit code 0, when stdin reaches EOF or on SIGTERM.

    The stdin reader and the signal handler only set an event; a separate thread does the
    exit, so it can wait for ``writing`` (held while a ledger line or final_metrics.json is
    written: what is written is whole) and then ``os._exit`` while the main thread is deep
    inside an evaluation.
    """

    def __init__(self, on_exit: Callable[[str], None]) -> None:
        self.stop = threading.Event()
        self.writing = threading.Lock()
        self._on_exit = on_exit
        self._reason = ""

    def start(self) -> None:
        signal.signal(signal.SIGTERM, lambda signum, frame: self.request("SIGTERM"))
        # A terminal is no lifeline (its hangup signal ends us), and a background job that
        # reads it would be stopped by SIGTTIN.
        if not os.isatty(0):
            threading.Thread(target=self._read_stdin, name="stdin-lifeline", daemon=True).start()
        threading.Thread(target=self._exit_when_told, name="evaluator-exit", daemon=True).start()

    def request(self, reason: str) -> None:
        if not self.stop.is_set():
            self._reason = reason
            self.stop.set()

    def _read_stdin(self) -> None:
        try:
            while os.read(0, 1 << 16):
                pass
        except OSError:  # no usable stdin: nobody can keep this process alive
            pass
        self.request("stdin closed")

    def _exit_when_told(self) -> None:
        self.stop.wait()
        with self.writing:
            try:
                self._on_exit(self._reason)
            finally:
                # os._exit skips the interpreter's flush: stdout to a file or pipe is block
                # buffered, and the last log lines (why it stopped) would be lost.
                for stream in (sys.stdout, sys.stderr):
                    with contextlib.suppress(Exception):
                        stream.flush()
                os._exit(ExitCode.SUCCESS)


class CheckpointEvaluator:
    """One CPU model and the holdout rows, loaded once; evaluates checkpoint after checkpoint."""

    def __init__(self, config: JobConfig, holdout: list[Batch], workdir: str) -> None:
        self.config = config
        self.holdout = holdout
        self.workdir = workdir
        # Reused: every load overwrites all of its weights (a failed load is never evaluated).
        self.model = cpu_model(config)
        self.model.eval()

    def evaluate(self, ckpt: CommittedCheckpoint) -> Evaluation | None:
        """Load, then evaluate; None (and one log line) when the checkpoint cannot be read."""
        start = time.time()
        if ckpt.manifest.config_hash != self.config.model_hash():
            log.warning(
                "skipping checkpoint %s (step %d): made for model %s, this job's is %s",
                ckpt.url,
                ckpt.step,
                ckpt.manifest.config_hash,
                self.config.model_hash(),
            )
            return None
        tmp = tempfile.mkdtemp(prefix="ckpt-", dir=self.workdir)
        try:
            load_model(ckpt, self.model, tmp)  # verified against the manifest before any load
        except _READ_ERRORS as exc:
            log.warning("skipping checkpoint %s (step %d): %s", ckpt.url, ckpt.step, _one_line(exc))
            return None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # a download; never the checkpoint itself
        metrics = evaluate(self.model, self.holdout, torch.device("cpu"))
        return Evaluation(ckpt, metrics, start, time.time())


def evaluated_before(ledger_url: str) -> int | None:
    """The newest step a previous evaluator of this job recorded (its own ledger file)."""
    try:
        text = storage.read_text(ledger_url)
    except FileNotFoundError:
        return None
    steps = [
        e.step
        for e in parse_lines(text, source=ledger_url)
        if e.name == Span.ASYNC_EVAL and e.step is not None
    ]
    return max(steps, default=None)


def record(ledger: Ledger, layout: JobLayout, done: Evaluation) -> None:
    """The span, and after the anchor the job's final metrics."""
    ckpt, metrics = done.ckpt, done.metrics
    ledger.record_span(
        Span.ASYNC_EVAL,
        done.start,
        done.end,
        step=ckpt.step,
        auc=metrics["auc"],
        logloss=metrics["logloss"],
        rows=done.rows,
        url=ckpt.url,
        anchor=ckpt.manifest.anchor,
    )
    if ckpt.manifest.anchor:
        summary = {
            "step": ckpt.step,
            "auc": metrics["auc"],
            "logloss": metrics["logloss"],
            "rows": done.rows,
        }
        url = layout.final_metrics
        try:
            storage.write_text(url, json.dumps(summary, indent=2))
        except OSError as exc:  # the span holds the same numbers
            log.error("could not write %s: %s", url, exc)


def run(
    config: JobConfig, poll_s: float = 0.5, once: bool = False, nice: int = DEFAULT_NICE
) -> int:
    """Evaluate until the anchor is evaluated (or, with ``once``, what is committed now)."""
    storage.configure(config.storage)
    torch.set_num_threads(1)
    os.nice(nice)
    ledger = Ledger(config.layout, attempt=0, rank=0, role=ROLE)
    workdir = tempfile.mkdtemp(prefix="ett-evaluator-")

    def on_exit(reason: str) -> None:
        log.info("evaluator stopping: %s", reason)
        ledger.close()
        shutil.rmtree(workdir, ignore_errors=True)

    lifeline = Lifeline(on_exit)
    lifeline.start()
    try:
        return _loop(config, ledger, lifeline, workdir, poll_s, once)
    finally:
        with lifeline.writing:
            ledger.close()
            shutil.rmtree(workdir, ignore_errors=True)


def _loop(
    config: JobConfig,
    ledger: Ledger,
    lifeline: Lifeline,
    workdir: str,
    poll_s: float,
    once: bool,
) -> int:
    layout, eval_every = config.layout, config.train.eval_every
    try:
        holdout = holdout_batches(
            config.data, 0, 1, config.train.eval_rows, config.data.eval_batch_size
        )
    except (DataError, OSError) as exc:
        log.error("cannot evaluate: %s", exc)
        return ExitCode.BAD_DATA
    evaluator = CheckpointEvaluator(config, holdout, workdir)
    newest = evaluated_before(ledger.url)
    skipped: set[tuple[str, float]] = set()
    log.info(
        "evaluating %s: eval_every=%d, %d holdout rows, newest evaluated step %s",
        layout.url,
        eval_every,
        sum(len(b) for b in holdout),
        newest,
    )
    while not lifeline.stop.is_set():
        try:
            committed = committed_checkpoints(layout)
        except OSError as exc:  # storage hiccup: the next poll retries
            log.warning("cannot list checkpoints of %s: %s", layout.url, _one_line(exc))
            committed = []
        todo = sorted(
            (
                c
                for c in committed
                if wanted(c, eval_every)
                and (newest is None or c.step > newest)
                and _identity(c) not in skipped
            ),
            key=lambda c: c.step,
        )
        latest = committed[0] if committed else None
        if latest and latest.manifest.anchor and newest is not None and latest.step <= newest:
            # A previous evaluator of this job got to its end.
            log.info("the anchor (step %d) was evaluated already", latest.step)
            return ExitCode.SUCCESS
        for ckpt in todo:
            if lifeline.stop.is_set():
                break
            done = evaluator.evaluate(ckpt)
            if done is None:
                skipped.add(_identity(ckpt))
                continue
            with lifeline.writing:
                if lifeline.stop.is_set():  # told to stop: finish nothing new
                    break
                record(ledger, layout, done)
            newest = ckpt.step
            log.info(
                "step %d holdout auc=%.4f logloss=%.4f (async)",
                ckpt.step,
                done.metrics["auc"],
                done.metrics["logloss"],
            )
            if ckpt.manifest.anchor:
                return ExitCode.SUCCESS
        if once:
            return ExitCode.SUCCESS
        lifeline.stop.wait(poll_s)
    return ExitCode.SUCCESS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.checkpoint_evaluator",
        description="Evaluate a job's committed checkpoints on CPU beside its training.",
    )
    parser.add_argument(
        "--config", help="job config file (YAML/TOML); embedded defaults if omitted"
    )
    parser.add_argument(
        "--poll-s",
        type=float,
        default=0.5,
        help="seconds between looks for new checkpoints (default 0.5)",
    )
    parser.add_argument(
        "--once",
        action="store_true",
        help="evaluate what is committed now, then exit (default: until the anchor)",
    )
    parser.add_argument(
        "--nice",
        type=int,
        default=DEFAULT_NICE,
        help=f"priority decrease, so training keeps the cores (default {DEFAULT_NICE})",
    )
    args = parser.parse_args(argv)
    # Tagged by the orchestrator's pump ("[evaluator] "); rank 0 shows the job's noise once.
    log_lines.configure("", first_of_job=False)
    if args.poll_s <= 0 or args.nice < 0:
        print(
            f"--poll-s must be positive and --nice not negative, got {args.poll_s} and {args.nice}",
            file=sys.stderr,
        )
        return ExitCode.USAGE
    try:
        config = load_config(args.config)
    except ConfigError as exc:  # one line, however many fields are wrong
        head, *fields = str(exc).strip().splitlines()
        print(" ".join([head, "; ".join(f.strip() for f in fields)]).strip(), file=sys.stderr)
        return ExitCode.USAGE
    return run(config, poll_s=args.poll_s, once=args.once, nice=args.nice)


if __name__ == "__main__":
    sys.exit(main())
