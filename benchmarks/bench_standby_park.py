"""Where a warm standby parks: what ``recovery.standby_park: host`` adds to Time to Recover.

A standby parked on the ``device`` has built, sharded and warmed up its model before the
failure; one parked on the ``host`` (the default on a GPU host, where a second model in
device memory is not affordable) does that after its promotion: DistributedModelParallel
onto the device (``train_module_creation``) and, with the compiled step, the compile warm-up
from the loaded cache. On a CPU ``host`` is forced to run that same code path.

Workload: the demo model and data (embedded defaults), ``--nproc`` ranks, run by the
orchestrator's attempt loop (tasks/orchestrator.py) with backoff 0. Attempt 0 is SIGKILLed
whole from outside (a lost host: bench_recovery's ``sigkill_attempt``) at its first step at
or after ``--at`` once its standby has parked, so every row measures a parked standby.
Every job shares one storage root: after a first job fills it, every compiled attempt loads
a warm compile cache. Parks and compile modes alternate within each repeat; medians over
``--repeats``.

Time to Recover comes from the job's ETT report (benchmarks/bench_recovery.py's
``one_failure``): from the failed attempt's last event to the promoted attempt's first step.
Each row also has the promoted attempt's init stages after its promotion.

    .venv/bin/python benchmarks/bench_standby_park.py [--repeats 3] [--compile eager,compiled]

Prints a markdown table and writes docs/results/standby-park.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_recovery import KillAttemptAt, one_failure  # noqa: E402
from benchmarks.save import save_run  # noqa: E402
from infra import storage  # noqa: E402
from infra.accounting.ett import report_for_job  # noqa: E402
from infra.accounting.ledger_format import Mark, file_name  # noqa: E402
from infra.control import Progress  # noqa: E402
from infra.settings import JobConfig, StandbyPark, load_config  # noqa: E402
from tests.procs import MARKER  # noqa: E402

PARKS = (StandbyPark.DEVICE, StandbyPark.HOST)
COMPILE = {"eager": False, "compiled": True}


class KillAttemptOnceParked(KillAttemptAt):
    """``KillAttemptAt``, held back until the standby (attempt 1) has parked: the row then
    measures a standby that was ready, whatever the machine's speed."""

    def __init__(self, step: int, marker: str, config: JobConfig) -> None:
        super().__init__(step, marker)
        folder = storage.local_path(config.layout.url) or ""
        self.ready_file = Path(folder, "ledger", file_name(1, 0, "trainer"))

    def parked(self) -> bool:
        try:
            return f'"name":"{Mark.STANDBY_READY}"' in self.ready_file.read_text(errors="replace")
        except OSError:
            return False

    def progress(self, progress: Progress) -> None:
        if progress.step >= self.step and not self.fired and not self.parked():
            return
        super().progress(progress)


def job_config(
    work: Path, park: StandbyPark, mode: str, rep: int, args: argparse.Namespace
) -> JobConfig:
    return load_config(
        job_id=f"park-{park}-{mode}-{rep}",
        storage={"root": f"file://{work}/store"},
        data={"url": f"file://{work}/data"},
        train={"steps": args.steps, "eval": "off", "compile": COMPILE[mode]},
        launch={"nproc": args.nproc},
        recovery={
            "standby": True,
            "standby_park": park,
            "max_failures": 2,
            "backoff_s": 0,
            "startup_timeout_s": 600.0,
        },
    )


def one(
    park: StandbyPark, mode: str, rep: int, work: Path, args: argparse.Namespace
) -> dict[str, Any]:
    config = job_config(work, park, mode, rep, args)
    marker = f"{work}/{config.job_id}"
    observer = KillAttemptOnceParked(args.at, marker, config)
    measured = one_failure(config, observer, env={MARKER: marker})
    report = report_for_job(config.layout)
    [standby] = report.standbys
    [init] = [i for i in report.init if i.attempt == standby.attempt]
    return {
        "park": str(park),
        "compile": mode,
        "repeat": rep,
        **measured,
        "killed_at_step": observer.fired[0] if observer.fired else None,
        "standby_prewarm_s": round(standby.prewarm_s, 3),
        "standby_parked_s": round(standby.parked_s, 3),
        # The promoted attempt's init stages after its promotion (seconds, summed per name).
        "after_promotion": {k: round(v, 3) for k, v in sorted(init.stages.items())},
        "after_promotion_critical_path": list(init.critical_path),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compile", default=",".join(COMPILE), help="eager,compiled")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--steps", type=int, default=220)
    parser.add_argument("--at", type=int, default=150, help="attempt 0 is killed from here on")
    parser.add_argument("--work-dir")
    parser.add_argument("--out", default=str(ROOT / "docs" / "results" / "standby-park.json"))
    args = parser.parse_args()
    modes = args.compile.split(",")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-standby-park-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    base = load_config(data={"url": f"file://{work}/data"})
    if not (work / "data" / "_meta.json").exists():
        from trainer.data.synthetic import generate

        generate(base.data, base.data.url)
    if "compiled" in modes:  # a first job fills the shared compile cache
        one(StandbyPark.DEVICE, "compiled", -1, work, args)
    rows = []
    started = time.time()
    for rep in range(args.repeats):
        for mode in modes:
            for park in PARKS if rep % 2 == 0 else PARKS[::-1]:
                rows.append(one(park, mode, rep, work, args))
                print(f"# {rows[-1]}", flush=True)

    def med(park: str, mode: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["park"] == park and r["compile"] == mode)

    summary = {
        mode: {str(park): med(park, mode, "time_to_recover_s") for park in PARKS} for mode in modes
    }
    print(
        f"\nTime to Recover after a lost attempt, promoted standby, median of {args.repeats} "
        f"({args.nproc} rank(s), demo model, CPU)\n"
    )
    print("| step | standby_park: device (s) | standby_park: host (s) | host - device (s) |")
    print("|---|---:|---:|---:|")
    for mode in modes:
        dev, host = summary[mode]["device"], summary[mode]["host"]
        print(f"| {mode} | {dev:.3f} | {host:.3f} | {host - dev:+.3f} |")
    save_run("standby_park", args, summary, rows, started, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
