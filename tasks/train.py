"""Prefect tasks that run a training job as a sequence of attempts.

One attempt = the trainer under torchrun (tasks/launch.py), its output streamed to the Prefect
logger, its end classified, and the orchestrator's share of the ETT ledger written:

- ``scheduling``: the flow run's expected start -> the flow function started (first attempt
  of a flow run only);
- ``launcher_init``: the attempt was spawned -> the trainer's ``attempt_start`` mark;
- ``failure`` (mark, at the moment the death is observed): cause crash|sigkill|preempted|hang,
  the last step the attempt made, its exit code.

The loop (``run_attempts``) relaunches after a failure; the trainer resumes from the newest
committed checkpoint by itself. Prefect task retries are not used: every relaunch is a new
attempt number with its own ledger files and its own accounting.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import Failed, State

from infra import processes, storage
from infra.exit_codes import ExitCode
from infra.ledger import Event, Ledger, ledger_url, read_events
from infra.settings import JobConfig, dump_config, load_config
from tasks.attempt_output import OutputLevels
from tasks.launch import run_attempt
from tasks.logs import logger

REPO_ROOT = Path(__file__).resolve().parents[1]

# What became of an attempt.
SUCCESS, PREEMPTED, CRASH, SIGKILL, HANG = "success", "preempted", "crash", "sigkill", "hang"
BAD_CONFIG, INCOMPATIBLE = "bad_config", "incompatible"
FATAL = frozenset({BAD_CONFIG, INCOMPATIBLE})  # relaunching cannot help

_STEP = re.compile(r"\bstep (\d+)/(\d+)\b")
# torchrun's summary of a failed worker: "failed (exitcode: 83)" / "exitcode  : -9 (pid: 7)".
_WORKER_EXIT = re.compile(r"exitcode\s*:\s*(-?\d+)")
_ATTEMPT_FILE = re.compile(r"-attempt(\d+)-rank\d+\.jsonl$")


# -- classification -----------------------------------------------------------------------
def classify(exit_code: int, worker_codes: Sequence[int] = (), hung: bool = False) -> str:
    """The outcome of an attempt from the launcher's exit code and, under torchrun (which
    exits 1 whenever a worker fails), the workers' exit codes read from its summary."""
    if hung:
        return HANG
    if exit_code == 0:
        return SUCCESS
    codes = [exit_code] if exit_code < 0 or not worker_codes else list(worker_codes)
    if any(c in (-signal.SIGKILL, 128 + signal.SIGKILL) for c in codes):
        return SIGKILL  # a lost worker (OOM killer, node failure): the others die with it
    root = codes[0]  # torchrun names the first failure first
    if root == ExitCode.PREEMPTED:
        return PREEMPTED
    if root == ExitCode.USAGE:
        return BAD_CONFIG
    if root == ExitCode.CHECKPOINT_INCOMPATIBLE:
        return INCOMPATIBLE
    return CRASH


def ledger_cause(outcome: str) -> str:
    """The ledger's failure vocabulary: crash|sigkill|preempted|hang."""
    return outcome if outcome in (PREEMPTED, SIGKILL, HANG) else CRASH


@dataclass(frozen=True)
class AttemptReport:
    attempt: int
    outcome: str
    exit_code: int  # the failing worker's code when torchrun named it, else the launcher's
    launcher_exit_code: int
    started: float
    ended: float
    last_step: int | None = None
    total_steps: int | None = None
    reached_trainer_s: float | None = None  # spawn -> attempt_start (launcher_init)

    @property
    def failed(self) -> bool:
        return self.outcome != SUCCESS

    @property
    def fatal(self) -> bool:
        return self.outcome in FATAL

    def describe(self) -> str:
        where = f" at step {self.last_step}" if self.last_step is not None else " before step 1"
        return f"attempt {self.attempt}: {self.outcome}{where} (exit code {self.exit_code})"


class AttemptFailed(RuntimeError):
    """Raised by the attempt task so the Prefect UI shows the attempt failed; carries the report."""

    def __init__(self, report: AttemptReport) -> None:
        super().__init__(report.describe())
        self.report = report


# -- one attempt ----------------------------------------------------------------------------
@dataclass
class _Watcher:
    """Reads the attempt's output: logs it, tracks steps and torchrun's worker exit codes."""

    log: Any
    on_step: Callable[[int, int], None] | None = None
    last_step: int | None = None
    total_steps: int | None = None
    worker_codes: list[int] = field(default_factory=list)
    levels: OutputLevels = field(default_factory=OutputLevels)  # torchrun's traceback: DEBUG

    def __call__(self, line: str) -> None:
        text = line.rstrip()
        if not text:
            return
        for level, held in self.levels.feed(text):
            self.log.log(level, "%s", held)
        m = _STEP.search(text)
        if m:
            self.last_step, self.total_steps = int(m.group(1)), int(m.group(2))
            if self.on_step is not None:
                try:
                    self.on_step(self.last_step, self.total_steps)
                except Exception as exc:  # noqa: BLE001 - progress display must not kill a job
                    self.log.debug("progress callback failed: %s", exc)
        elif "exitcode" in text:
            w = _WORKER_EXIT.search(text)
            if w and (not self.worker_codes or self.worker_codes[-1] != int(w.group(1))):
                self.worker_codes.append(int(w.group(1)))

    def is_progress(self, line: str) -> bool:
        """A step line; before the first one any output counts (startup is alive)."""
        return bool(_STEP.search(line)) or self.last_step is None


def _children_running(command: list[str]) -> list[int]:
    """Process-group leaders started by this process with exactly ``command`` (Linux)."""
    me, found = os.getpid(), []
    want = "\0".join(command)
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace").rstrip("\0")
        except (OSError, IndexError):
            continue
        pid = int(proc.name)
        if int(stat[1]) == me and int(stat[2]) == pid and cmdline == want:
            found.append(pid)
    return found


def stop_orphaned_attempt(command: list[str], grace_s: float = 25.0) -> list[int]:
    """The attempt runs in its own process group, so it outlives an interrupted launcher.
    When the flow is cancelled, preempt it (SIGTERM: the trainer checkpoints and exits 83)
    and SIGKILL what is left after ``grace_s`` (Prefect's workers wait ~30 s)."""
    pids = _children_running(command)
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pid in pids:
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                continue
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.2)
        if not any(_alive(p) for p in pids):
            break
    return pids


def _alive(pgid: int) -> bool:
    """Whether anything is left of the process group (its exited leader is reaped first)."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pgid, os.WNOHANG)
    return processes.group_alive(pgid)


def _attempt_events(job_url: str, attempt: int) -> list[Event]:
    try:
        return [e for e in read_events(job_url) if e.attempt == attempt and e.rank == 0]
    except OSError as exc:
        logger().warning("could not read the ledger of %s: %s", job_url, exc)
        return []


def launch_attempt(
    job_url: str,
    command: list[str],
    attempt: int,
    hang_timeout_s: float | None = None,
    env: dict[str, str] | None = None,
    on_step: Callable[[int, int], None] | None = None,
    scheduling: tuple[float, float] | None = None,
) -> AttemptReport:
    """Run one attempt to its end, write its orchestration spans, classify its exit."""
    log = logger()
    ledger = Ledger(job_url, attempt=attempt, rank=0, role="orchestrator")
    try:
        if scheduling is not None and scheduling[1] >= scheduling[0]:
            ledger.record_span("scheduling", *scheduling)
        watcher = _Watcher(log, on_step)
        pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
        attempt_env = {"PYTHONPATH": pythonpath, **(env or {}), "ETT_ATTEMPT": str(attempt)}
        log.info("attempt %d: %s", attempt, " ".join(command))
        try:
            result = run_attempt(
                command,
                env=attempt_env,
                on_line=watcher,
                progress_timeout_s=hang_timeout_s,
                is_progress=watcher.is_progress,
            )
        except BaseException as exc:  # cancelled (Prefect's TerminationSignal), interrupted
            stopped = stop_orphaned_attempt(command)
            cancelled = not isinstance(exc, Exception)
            ledger.mark(
                "failure",
                step=watcher.last_step,
                cause=ledger_cause(PREEMPTED if cancelled else CRASH),
                exit_code=None,
                outcome="cancelled" if cancelled else "launch_error",
                error=repr(exc)[:300],
                stopped_pids=stopped,
            )
            raise
        for level, held in watcher.levels.flush():
            log.log(level, "%s", held)
        outcome = classify(result.exit_code, watcher.worker_codes, result.hung)
        events = _attempt_events(job_url, attempt)
        starts = [
            e.start for e in events if e.name == "attempt_start" and e.start >= result.started
        ]
        reached = min(starts) if starts else None
        # The trainer never marked its start: the launcher was still initialising when it died.
        ledger.record_span(
            "launcher_init",
            result.started,
            reached if reached is not None else result.ended,
            reached_trainer=reached is not None,
        )
        steps = [e.step for e in events if e.name == "train_step" and e.step is not None]
        last_step = max(steps, default=watcher.last_step)
        code = watcher.worker_codes[0] if watcher.worker_codes else result.exit_code
        report = AttemptReport(
            attempt=attempt,
            outcome=outcome,
            exit_code=code,
            launcher_exit_code=result.exit_code,
            started=result.started,
            ended=result.ended,
            last_step=last_step,
            total_steps=watcher.total_steps,
            reached_trainer_s=None if reached is None else reached - result.started,
        )
        if report.failed:
            ledger.mark(
                "failure",
                step=last_step,
                t=result.ended,
                cause=ledger_cause(outcome),
                exit_code=code,
                outcome=outcome,
            )
        return report
    finally:
        ledger.close()


@task(name="train-attempt", task_run_name="attempt-{attempt}", cache_policy=NO_CACHE)
def attempt_task(
    job_url: str,
    command: list[str],
    attempt: int,
    hang_timeout_s: float | None = None,
    env: dict[str, str] | None = None,
    on_step: Callable[[int, int], None] | None = None,
    scheduling: tuple[float, float] | None = None,
) -> AttemptReport | State:
    """One attempt as a Prefect task: Completed on success, Failed (holding AttemptFailed)
    otherwise. The Failed state is returned, not raised: a failed attempt is an outcome the
    flow handles, and a raised one would print our own raise as a traceback in the log."""
    report = launch_attempt(job_url, command, attempt, hang_timeout_s, env, on_step, scheduling)
    if report.failed:
        return Failed(message=report.describe(), data=AttemptFailed(report))
    return report


# -- the loop -----------------------------------------------------------------------------
@dataclass(frozen=True)
class RetryPolicy:
    """How many failures a job survives and how long it waits before relaunching.

    Preemptions are not failures of the job: they relaunch at once and do not count towards
    ``max_failures`` (``max_preemptions`` only stops an endless preemption loop)."""

    max_failures: int = 3
    backoff_s: float = 10.0
    backoff_max_s: float = 300.0
    max_preemptions: int = 20

    def delay_s(self, outcome: str, failures: int) -> float:
        if outcome == PREEMPTED or self.backoff_s <= 0:
            return 0.0
        return min(self.backoff_s * 2 ** max(failures - 1, 0), self.backoff_max_s)


@dataclass(frozen=True)
class JobOutcome:
    succeeded: bool
    message: str
    attempts: tuple[AttemptReport, ...]

    @property
    def failures(self) -> int:
        return sum(1 for a in self.attempts if a.failed and a.outcome != PREEMPTED)

    @property
    def preemptions(self) -> int:
        return sum(1 for a in self.attempts if a.outcome == PREEMPTED)

    def to_dict(self) -> dict[str, Any]:
        return {
            "succeeded": self.succeeded,
            "message": self.message,
            "attempts": [asdict(a) for a in self.attempts],
        }


def run_attempts(
    launch: Callable[[int], AttemptReport],
    first_attempt: int = 0,
    policy: RetryPolicy = RetryPolicy(),  # noqa: B008 - frozen
    sleep: Callable[[float], None] = time.sleep,
    on_attempt: Callable[[AttemptReport], None] | None = None,
) -> JobOutcome:
    """Launch attempts until one succeeds, one fails fatally, or the policy gives up."""
    log = logger()
    reports: list[AttemptReport] = []
    failures = preemptions = 0
    attempt = first_attempt
    while True:
        report = launch(attempt)
        reports.append(report)
        if on_attempt is not None:
            on_attempt(report)
        if report.outcome == SUCCESS:
            return JobOutcome(
                True,
                f"succeeded on attempt {attempt} after {failures} "
                f"failure(s) and {preemptions} preemption(s)",
                tuple(reports),
            )
        if report.fatal:
            return JobOutcome(
                False,
                f"{report.describe()}: not retried, a relaunch cannot "
                "fix a bad config or an incompatible checkpoint",
                tuple(reports),
            )
        if report.outcome == PREEMPTED:
            preemptions += 1
            if preemptions > policy.max_preemptions:
                return JobOutcome(
                    False,
                    f"preempted {preemptions} times, more than "
                    f"max_preemptions={policy.max_preemptions}",
                    tuple(reports),
                )
        else:
            failures += 1
            if failures > policy.max_failures:
                return JobOutcome(
                    False,
                    f"{failures} failures exceed max_failures="
                    f"{policy.max_failures}; last {report.describe()}",
                    tuple(reports),
                )
        delay = policy.delay_s(report.outcome, failures)
        log.warning(
            "%s; relaunching from the latest committed checkpoint in %.1f s (failures %d/%d)",
            report.describe(),
            delay,
            failures,
            policy.max_failures,
        )
        if delay > 0:
            sleep(delay)
        attempt += 1


def next_attempt(job_url: str) -> int:
    """One past the highest attempt in the job's ledger (0 for a new job), so a job that is
    run again continues its numbering and its ETT report covers every attempt."""
    numbers = [
        int(m.group(1))
        for url in storage.glob(storage.join(ledger_url(job_url), "*.jsonl"))
        if (m := _ATTEMPT_FILE.search(url))
    ]
    return max(numbers) + 1 if numbers else 0


# -- job preparation ------------------------------------------------------------------------
@task(name="prepare-job", cache_policy=NO_CACHE, timeout_seconds=300)
def prepare_job(
    config: str | None,
    overrides: dict[str, Any] | None = None,
    faults: list[dict[str, Any]] | None = None,
) -> tuple[JobConfig, str]:
    """Load and validate the job config (file + overrides + ETT_* env), add the injected
    faults, and write the effective config for the trainer's ranks; returns (config, path)."""
    extra = dict(overrides or {})
    if faults is not None:
        extra["faults"] = list(faults)
    job = load_config(config, **extra)
    storage.configure(job.storage)
    folder = tempfile.mkdtemp(prefix=f"ett-{job.job_id}-")
    path = os.path.join(folder, "job.yaml")
    dump_config(job, path)
    return job, path


@task(name="ensure-data", cache_policy=NO_CACHE, timeout_seconds=3600)
def ensure_data(config_path: str, data_url: str) -> bool:
    """Generate the synthetic data set with ``ett generate`` unless ``data_url`` holds one;
    returns whether it generated. (Flows never import the trainer: the CLI is a subprocess.)"""
    if storage.exists(storage.join(data_url, "_meta.json")):
        return False
    log = logger()
    log.info("no data set at %s: generating it", data_url)
    cmd = [sys.executable, "-m", "flows.cli", "generate", "--config", config_path]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    for line in (proc.stdout + proc.stderr).splitlines():
        log.info("%s", line)
    complete = storage.exists(storage.join(data_url, "_meta.json"))  # written last
    if proc.returncode != 0 and not complete:
        raise RuntimeError(f"`ett generate` failed with exit code {proc.returncode}")
    if proc.returncode != 0:
        log.warning(
            "`ett generate` exited %d after writing a complete data set at %s",
            proc.returncode,
            data_url,
        )
    return True


class ProgressThrottle:
    """Calls ``update(pct)`` at most every ``every_s`` seconds (and always at 100%)."""

    def __init__(self, update: Callable[[float], Any], every_s: float = 2.0) -> None:
        self.update, self.every_s = update, every_s
        self._last = 0.0
        self._lock = threading.Lock()

    def __call__(self, step: int, total: int) -> None:
        pct = 100.0 * step / max(total, 1)
        now = time.monotonic()
        with self._lock:
            if now - self._last < self.every_s and pct < 100.0:
                return
            self._last = now
        self.update(pct)
