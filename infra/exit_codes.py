"""Exit codes and attempt outcomes: the contract between the trainer, the CLI and the
orchestrator that classifies attempts (docs/exit-codes.md).

Distinct codes let the orchestrator tell a preemption (resume at once, not a failure of the
code) from a crash (a failure: counted, backed off when it repeats) and from a failure that
no relaunch can fix (bad config or data, an incompatible checkpoint, a job id in use),
without parsing logs. Every process of the product exits with one of ``ExitCode``.
"""

from __future__ import annotations

import signal
from enum import IntEnum, StrEnum


class ExitCode(IntEnum):
    """Process exit codes of the trainer, the publisher and the ``ett`` CLI."""

    SUCCESS = 0
    CRASH = 1  # an unexpected exception (Python's own code for one)
    USAGE = 2  # a bad config, a bad flag or argument (argparse's code, too)
    REFUSED = 3  # publishing: the candidate failed the validation gate
    PREEMPTED = 83  # SIGTERM honoured: a checkpoint was saved at the step boundary
    CHECKPOINT_INCOMPATIBLE = 84  # the checkpoint to resume from does not fit this job
    ANCHOR_NOT_SAVED = 85  # trained to the end, but the final (anchor) checkpoint failed
    EMERGENCY_SAVE_FAILED = 86  # SIGTERM, and the checkpoint within the budget failed
    STORAGE_UNAVAILABLE = 87  # storage kept failing (retries spent): relaunch later
    BAD_DATA = 88  # the training data is unusable (too many bad rows, unreadable files)
    JOB_LOCKED = 89  # another live job holds this job id
    LEDGER_NOT_SAVED = 90  # trained, but the job's ETT ledger could not be stored


class Outcome(StrEnum):
    """What became of an attempt, from the trainer's exit code to the ETT report and the
    MLflow run's ``ett.outcome`` tag; also the ``cause`` of a ledger ``failure`` mark."""

    SUCCESS = "success"
    PREEMPTED = "preempted"  # SIGTERM honoured (exit 83)
    CANCELLED = "cancelled"  # the job was stopped from outside (a flow run cancelled, Ctrl-C)
    CRASH = "crash"  # an exception, or any other non-zero exit
    SIGKILL = "sigkill"  # a lost worker: the OOM killer, a node failure
    HANG = "hang"  # no progress for the hang timeout: killed by the orchestrator
    STORAGE = "storage"  # storage unavailable; retried like a crash
    BAD_CONFIG = "bad_config"
    BAD_DATA = "bad_data"
    INCOMPATIBLE = "incompatible"
    JOB_LOCKED = "job_locked"
    # Read from a ledger only, never from an exit code (infra/accounting/ett.py):
    STOPPED = "stopped"  # ended its shutdown without finishing the job: a planned restart
    UNFINISHED = "unfinished"  # still running, or its end was never recorded
    UNOBSERVED = "unobserved"  # it died, and nothing recorded how (no failure mark)

    @property
    def fatal(self) -> bool:
        """A relaunch cannot fix it: the job stops."""
        return self in _FATAL

    @property
    def failed(self) -> bool:
        """It ended badly: the job goes on with another attempt, or stops."""
        return self not in (Outcome.SUCCESS, Outcome.STOPPED, Outcome.UNFINISHED)

    @property
    def counts_as_failure(self) -> bool:
        """Counts towards ``max_failures`` (preemptions are the platform's, a cancellation
        the user's: neither is the job's)."""
        return self.failed and self not in (Outcome.PREEMPTED, Outcome.CANCELLED)


_FATAL = frozenset({Outcome.BAD_CONFIG, Outcome.BAD_DATA, Outcome.INCOMPATIBLE, Outcome.JOB_LOCKED})

_BY_CODE: dict[int, Outcome] = {
    ExitCode.SUCCESS: Outcome.SUCCESS,
    ExitCode.PREEMPTED: Outcome.PREEMPTED,
    ExitCode.USAGE: Outcome.BAD_CONFIG,
    ExitCode.CHECKPOINT_INCOMPATIBLE: Outcome.INCOMPATIBLE,
    ExitCode.STORAGE_UNAVAILABLE: Outcome.STORAGE,
    ExitCode.BAD_DATA: Outcome.BAD_DATA,
    ExitCode.JOB_LOCKED: Outcome.JOB_LOCKED,
}

_KILLED = frozenset({-signal.SIGKILL, 128 + signal.SIGKILL})


def outcome_of(code: int) -> Outcome:
    """The outcome of one process's exit code (negative: killed by that signal)."""
    if code in _KILLED:
        return Outcome.SIGKILL
    return _BY_CODE.get(code, Outcome.CRASH)


def name_of(code: int) -> str:
    """``PREEMPTED (83)``-style text for logs; unknown codes and signals are named too."""
    if code < 0 or code > 128:  # -9 from Popen, 137 from a shell or a launcher
        number = -code if code < 0 else code - 128
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        return f"killed by {name}" + (f" ({code})" if code > 0 else "")
    try:
        return f"{ExitCode(code).name} ({code})"
    except ValueError:
        return f"exit code {code}"
