"""Recovery: Time to Recover per failure kind, warm standby vs cold relaunch, side by side.

Workload: the demo model and data (embedded defaults), ``--nproc`` ranks, ``--steps`` steps,
one failure at ``--at`` of attempt 0, run by the orchestrator's attempt loop (tasks/orchestrator.py,
the code of the ``train`` flow and ``ett train``) with backoff 0. Every job shares one storage
root, so every attempt but the very first loads a warm compile cache. Kinds:

- ``crash``: an exception in a step, on every rank;
- ``sigkill_rank``: SIGKILL of one rank (a lost worker);
- ``sigkill_attempt``: SIGKILL of the whole attempt (agent and ranks) from outside;
- ``preemption``: SIGTERM: the ranks checkpoint at the step boundary and exit 83;
- ``hang``: rank 0 stops stepping; killed after ``--hang-timeout`` (plus the kill's grace:
  ``--budget``, the preemption budget, + 5 s).

Modes: ``standby`` is the default product (warm standby promoted on a failure, a crash
recovered in process); ``cold`` relaunches a new torchrun per failure (no standby, no
in-process restart). Kinds and modes are interleaved per repeat; medians over ``--repeats``.

Time to Recover comes from the job's ETT report (infra/accounting/ett.py): from the failed attempt's
last event (or the in-process restart mark) to the first step of the training that follows.

    .venv/bin/python benchmarks/bench_recovery.py [--repeats 3] [--kinds crash,preemption]

Prints a markdown table and writes benchmarks/results/recovery.json.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.save import save_run  # noqa: E402
from infra import processes  # noqa: E402
from infra.accounting.ett import report_for_job  # noqa: E402
from infra.control import Phase, Progress  # noqa: E402
from infra.settings import JobConfig, load_config  # noqa: E402
from tasks.orchestrator import JobObserver, run  # noqa: E402
from tests import procs  # noqa: E402
from tests.procs import MARKER  # noqa: E402

KINDS = ("crash", "sigkill_rank", "sigkill_attempt", "preemption", "hang")
MODES = ("standby", "cold")
FAULT = {"crash": "crash", "sigkill_rank": "sigkill", "preemption": "sigterm", "hang": "hang"}


def job_config(work: Path, kind: str, mode: str, rep: int, args: argparse.Namespace) -> JobConfig:
    faults = [{"kind": FAULT[kind], "step": args.at}] if kind in FAULT else []
    cold = mode == "cold"
    return load_config(
        job_id=f"recovery-{kind}-{mode}-{rep}",
        storage={"root": f"file://{work}/store"},
        data={"url": f"file://{work}/data"},
        train={"steps": args.steps, "eval": "off"},
        checkpoint={"preemption_budget_s": args.budget},
        launch={"nproc": args.nproc},
        recovery={
            "standby": not cold,
            "in_process_restart": not cold,
            "max_failures": 2,
            "backoff_s": 0,
            "hang_timeout_s": args.hang_timeout,
            "startup_timeout_s": 600.0,
        },
        faults=faults,
    )


class KillAttemptAt(JobObserver):
    """Once attempt 0 reaches ``step``, SIGKILL all of it from outside."""

    def __init__(self, step: int, marker: str) -> None:
        self.step, self.marker = step, marker
        self.fired: list[int] = []

    def progress(self, progress: Progress) -> None:
        if self.fired or progress.phase != Phase.TRAINING or progress.step < self.step:
            return
        self.fired.append(progress.step)
        agents = procs.launchers(procs.carrying(**{MARKER: self.marker, "ETT_ATTEMPT": "0"}))
        for agent in agents:
            for pid in [agent, *processes.descendants(agent)]:
                os.kill(pid, signal.SIGKILL)


def one_failure(
    config: JobConfig, observer: JobObserver | None = None, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run a job that fails once and recovers; its row's measured columns (Time to Recover
    from the job's ETT report)."""
    started = time.perf_counter()
    outcome = run(config, observer, env=env).outcome
    wall = time.perf_counter() - started
    if not outcome.succeeded:
        raise RuntimeError(f"{config.job_id}: {outcome.message}")
    report = report_for_job(config.layout)
    if len(report.failures) != 1:
        raise RuntimeError(
            f"{config.job_id}: {len(report.failures)} failures, not 1 (the fault missed its step?)"
        )
    (failure,) = report.failures
    return {
        "outcomes": [str(a.outcome) for a in outcome.attempts],
        "in_process": failure.in_process,
        "time_to_recover_s": round(failure.time_to_recover_s, 3),
        "redone_steps": report.num_step_executions - report.num_steps,
        "ett_pct": round(report.ett_pct, 2),
        "job_wall_s": round(wall, 1),
    }


def one(kind: str, mode: str, rep: int, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    config = job_config(work, kind, mode, rep, args)
    marker = f"{work}/{config.job_id}"
    observer = KillAttemptAt(args.at, marker) if kind == "sigkill_attempt" else None
    measured = one_failure(config, observer, env={MARKER: marker})
    return {"kind": kind, "mode": mode, "repeat": rep, **measured}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--at", type=int, default=300, help="the failing step of attempt 0")
    parser.add_argument("--hang-timeout", type=float, default=10.0)
    parser.add_argument(
        "--budget", type=float, default=1.0, help="preemption budget (the kill's grace: + 5 s)"
    )
    parser.add_argument("--work-dir")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "recovery.json"))
    args = parser.parse_args()
    kinds, modes = args.kinds.split(","), args.modes.split(",")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-recovery-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    base = load_config(data={"url": f"file://{work}/data"})
    if not (work / "data" / "_meta.json").exists():
        from trainer.data.synthetic import generate

        generate(base.data, base.data.url)
    # A first job fills the shared compile cache, as the first job of a storage root does.
    one("preemption", "cold", -1, work, argparse.Namespace(**{**vars(args), "steps": 20, "at": 10}))
    rows = []
    started = time.time()
    for rep in range(args.repeats):
        for kind in kinds:
            for mode in modes:
                rows.append(one(kind, mode, rep, work, args))
                print(f"# {rows[-1]}", flush=True)

    def med(kind: str, mode: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["kind"] == kind and r["mode"] == mode)

    summary = {
        kind: {mode: med(kind, mode, "time_to_recover_s") for mode in modes} for kind in kinds
    }
    print(
        f"\nTime to Recover, median of {args.repeats} ({args.nproc} ranks, demo model, "
        f"failure at step {args.at} of {args.steps}, hang timeout {args.hang_timeout:g} s)\n"
    )
    print("| failure | standby (s) | cold relaunch (s) | cold / standby |")
    print("|---|---:|---:|---:|")
    for kind in kinds:
        s, c = summary[kind].get("standby"), summary[kind].get("cold")
        ratio = f"{c / s:.1f}x" if s and c else "-"
        print(
            f"| {kind} | {s if s is not None else '-'} | {c if c is not None else '-'} | {ratio} |"
        )
    save_run("recovery", args, summary, rows, started, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
