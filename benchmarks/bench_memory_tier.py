"""Redone steps with and without the in-memory tier, side by side.

Workload: the demo model and data (embedded defaults), ``--nproc`` ranks, ``--steps`` steps,
two failures of attempt 0: a crash at ``--crash-at`` (recovered in process) and a SIGKILL of
rank 0 at ``--kill-at`` (the warm standby is promoted), run by the orchestrator's attempt
loop with backoff 0. Variants: ``memory`` is the default product (``checkpoint.memory_tier:
true``), ``durable`` the same job with the tier off; they alternate per repeat and share one
storage root, so every job but a first, short one loads a warm compile cache.

From each job's ETT report: the redone steps' time (``wasted_training``, and by the tier of
the restore that went back over them), the steps redone, ETT%, checkpoint blocking (durable
and in-memory), the copies taken and each tier's last interval.

    .venv/bin/python benchmarks/bench_memory_tier.py [--repeats 2] [--steps 1000]

Prints a markdown table and writes docs/results/memory-tier.json.
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

from benchmarks.save import save_run  # noqa: E402
from infra.accounting.ett import report_for_job  # noqa: E402
from infra.settings import JobConfig, load_config  # noqa: E402
from tasks.orchestrator import run  # noqa: E402

VARIANTS = ("durable", "memory")


def job_config(work: Path, variant: str, rep: int, args: argparse.Namespace) -> JobConfig:
    faults = [
        {"kind": "crash", "step": args.crash_at},
        {"kind": "sigkill", "step": args.kill_at},
    ]
    return load_config(
        job_id=f"memtier-{variant}-{rep}",
        storage={"root": f"file://{work}/store"},
        data={"url": f"file://{work}/data"},
        train={"steps": args.steps, "eval": "off"},
        checkpoint={"memory_tier": variant == "memory"},
        launch={"nproc": args.nproc},
        recovery={"max_failures": 3, "backoff_s": 0},
        faults=faults if rep >= 0 else [],
    )


def one(variant: str, rep: int, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    config = job_config(work, variant, rep, args)
    started = time.perf_counter()
    outcome = run(config, env={"OMP_NUM_THREADS": "1"}).outcome
    wall = time.perf_counter() - started
    if not outcome.succeeded:
        raise RuntimeError(f"{config.job_id}: {outcome.message}")
    r = report_for_job(config.layout)
    return {
        "variant": variant,
        "repeat": rep,
        "outcomes": [str(a.outcome) for a in outcome.attempts],
        "resumes": [(res.how, res.tier, res.step) for res in r.resumes],
        "redone_s": round(r.buckets["wasted_training"], 3),
        "redone_by_tier_s": {k: round(v, 3) for k, v in r.redone_by_tier.items()},
        "redone_steps": r.num_step_executions - r.num_steps,
        "ett_pct": round(r.ett_pct, 2),
        "checkpoint_blocking_s": round(r.checkpoint_blocking_total_s, 3),
        "memory_blocking_s": round(r.memory_blocking_total_s, 3),
        "memory_copies": r.memory_copies,
        "checkpoints_committed": r.num_checkpoints_committed,
        "durable_interval_s": r.checkpoint_interval_s,
        "memory_interval_s": r.memory_interval_s,
        "step_median_s": r.step_time_median_s,
        "job_wall_s": round(wall, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--crash-at", type=int, default=400)
    parser.add_argument("--kill-at", type=int, default=700)
    parser.add_argument("--work-dir")
    parser.add_argument("--out", default=str(ROOT / "docs" / "results" / "memory-tier.json"))
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-memtier-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    base = load_config(data={"url": f"file://{work}/data"})
    if not (work / "data" / "_meta.json").exists():
        from trainer.data.synthetic import generate

        generate(base.data, base.data.url)
    # A first job fills the shared compile cache, as the first job of a storage root does.
    one("durable", -1, work, argparse.Namespace(**{**vars(args), "steps": 20}))
    rows = []
    started = time.time()
    for rep in range(args.repeats):
        for variant in VARIANTS if rep % 2 == 0 else VARIANTS[::-1]:
            rows.append(one(variant, rep, work, args))
            print(f"# {rows[-1]}", flush=True)

    def med(variant: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["variant"] == variant)

    keys = (
        "redone_s",
        "redone_steps",
        "ett_pct",
        "checkpoint_blocking_s",
        "memory_blocking_s",
        "memory_copies",
        "job_wall_s",
    )
    summary = {v: {k: round(med(v, k), 3) for k in keys} for v in VARIANTS}
    print(
        f"\nMedian of {args.repeats} ({args.nproc} rank(s), demo model, {args.steps} steps, "
        f"crash at {args.crash_at}, SIGKILL at {args.kill_at})\n"
    )
    print("| | " + " | ".join(VARIANTS) + " |\n|---|" + "---:|" * len(VARIANTS))
    for key in keys:
        print(f"| {key} | " + " | ".join(str(summary[v][key]) for v in VARIANTS) + " |")
    save_run("memory-tier", args, summary, rows, started, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
