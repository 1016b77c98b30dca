"""The headline: the same job with the same failures, without and with what this product does.

Both runs go through the ``train`` flow (flows/train_flow.py), one after the other, on the
same data (the demo click log), seed and step count, with the same failures at the same steps:
a crash at 24% of the steps, a SIGKILL of the rank at 50% and a preemption (SIGTERM) at 76%.
Both use the same retry policy and ``--backoff-s``, so the difference is the mechanisms.

- **baseline** (what a team gets without this product):
  synchronous checkpoints every ``BASELINE_EVERY_STEPS`` = 100 steps and no in-memory tier;
  a cold compile in every attempt (no compile cache); init stages one after another; a new
  torchrun per failure (no warm standby, no in-process restart) whose ranks are fresh
  interpreters; evaluation in the training loop; the anchor published inside the job
  (benchmarks/coupled_trainer.py).
- **optimized**: the defaults (async staged checkpoints at the advisor's interval and
  in-memory copies at their own, the shared compile cache, parallel init, forked ranks, warm
  standby, in-process restart, the side evaluator, publishing as its own flow run after the
  job). The compile cache is warmed by a
  short job under the same storage root first, as every job after the first one finds it.
- **no_memory_tier**: the same defaults with ``checkpoint.memory_tier: false`` (durable
  checkpoints only: the product before its in-memory tier), warmed the same way. Run it
  beside ``optimized`` to measure what the tier does:
  ``--only no_memory_tier,optimized`` (with ``--pool``: both from the pool).

A failure strikes the attempt that reaches its step: in the baseline each failure ends an
attempt (attempts 0, 1, 2); in the optimized runs the crash is recovered inside attempt 0,
so the SIGKILL also lands in attempt 0 and the preemption in attempt 1.

    .venv/bin/python benchmarks/bench_ett.py [--steps 5000] [--only optimized,...] [--pool]
        [--repeats N]

``--repeats N``: the variants N times, their order reversed each time (A B, B A, A B): a
job's wall time follows the machine's step time, which drifts over a run more than some
differences between variants, so one pair cannot show them. The table then adds every job,
the medians, and each later variant's wall time over the first's in the same repeat.

``--pool``: the optimized jobs' launchers are claimed from a warm agent pool (``ett pool``,
tasks/agent_pool.py) instead of fresh interpreters: its first attempt starts from an agent
that imported everything before the job existed (the standbys claim one when it has parked).

Writes benchmarks/results/ett.json, ett.md and ett.png (the wall time of each run by
bucket; ``--only`` adds the variants' names to the file names), and prints the table. With
the baseline and optimized runs, it then feeds their ledgers to ``ett simulate``: the
simulator's replay of each run beside what was measured (its validation) and the projection
of both to 16,384 GPUs, in benchmarks/results/simulate/.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from infra.job_layout import JobLayout

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from infra.accounting.ett import report_for_job  # noqa: E402
from infra.accounting.records import BUCKETS, Bucket, EttReport  # noqa: E402
from infra.settings import dump_config, load_config  # noqa: E402

VARIANTS = ("baseline", "no_memory_tier", "optimized")
OPTIMIZED = ("no_memory_tier", "optimized")  # the product's defaults, and without one of them
BASELINE_EVERY_STEPS = 100
SCHEDULE = (("crash", 0.24), ("sigkill", 0.50), ("sigterm", 0.76))  # kind, share of steps
# The attempt each failure lands in, per variant (see the module docstring).
ATTEMPTS = {"baseline": (0, 1, 2), "no_memory_tier": (0, 0, 1), "optimized": (0, 0, 1)}
OUT = ROOT / "benchmarks" / "results"


def job_id(variant: str, repeat: int = 0) -> str:
    """``ett-VARIANT``; a later repeat is a new job under the same storage root."""
    return f"ett-{variant}" + (f"-r{repeat}" if repeat else "")


def job_url(work: Path, variant: str, repeat: int = 0) -> str:
    return f"file://{work}/{variant}/store/jobs/{job_id(variant, repeat)}"


def faults(variant: str, steps: int) -> list[dict[str, Any]]:
    return [
        {"kind": kind, "step": round(share * steps), "attempt": attempt}
        for (kind, share), attempt in zip(SCHEDULE, ATTEMPTS[variant], strict=True)
    ]


def overrides(variant: str, work: Path, steps: int, repeat: int = 0) -> dict[str, Any]:
    common = {
        "job_id": job_id(variant, repeat),
        "storage": {"root": f"file://{work}/{variant}/store"},
        "data": {"url": f"file://{work}/data"},
        "train": {"steps": steps},
        "tracking": {"mlflow_uri": f"sqlite:///{work}/mlflow.db", "experiment": "bench-ett"},
    }
    if variant == "optimized":
        return common
    if variant == "no_memory_tier":  # the defaults before the in-memory tier: durable only
        return {**common, "checkpoint": {"memory_tier": False}}
    return {
        **common,
        "train": {
            "steps": steps,
            "compile_cache": False,  # every attempt compiles cold
            "parallel_init": False,
            "eval": "inline",
        },
        "checkpoint": {
            "mode": "sync",
            "every_steps": BASELINE_EVERY_STEPS,
            "memory_tier": False,  # durable checkpoints only
        },
        "recovery": {"standby": False, "in_process_restart": False},
    }


@contextlib.contextmanager
def launched_as(variant: str) -> Iterator[None]:
    """The baseline's ranks are fresh interpreters running the coupled trainer."""
    from tasks.attempt import LaunchSpec

    if variant in OPTIMIZED:
        yield
        return
    seams = {
        "program": (str(ROOT / "benchmarks" / "coupled_trainer.py"),),
        "launcher": ("-m", "trainer.launch", "--start-method=spawn"),
    }
    original = LaunchSpec.of
    LaunchSpec.of = staticmethod(lambda config, path, **kw: original(config, path, **seams, **kw))
    try:
        yield
    finally:
        LaunchSpec.of = original  # type: ignore[method-assign]


def run_variant(
    variant: str, work: Path, args: argparse.Namespace, repeat: int = 0
) -> dict[str, Any]:
    import flows.train_flow as train_module

    path = work / f"{job_id(variant, repeat)}.yaml"
    dump_config(load_config(**overrides(variant, work, args.steps, repeat)), path)
    with launched_as(variant):
        t0 = time.monotonic()
        run_overrides = {
            "faults": faults(variant, args.steps),
            "recovery": {"backoff_s": args.backoff_s},
        }
        result = train_module.train_flow(config=str(path), overrides=run_overrides)
        flow_s = time.monotonic() - t0
    report = report_for_job(JobLayout.at(result["job_url"]))
    row = summarize(variant, report)
    row["repeat"] = repeat
    row["flow_s"] = round(flow_s, 1)
    row["attempts"] = result["attempts"]
    if variant in OPTIMIZED and result["anchor"]:
        from flows.publish_flow import publish_flow

        t0 = time.monotonic()
        publish_flow(  # this process is the worker: its MLflow is the job's
            uri=result["anchor"]["uri"],
            step=result["anchor"]["step"],
            job_id=result["job_id"],
            mlflow_run_id=result["mlflow_run_id"],
            settings={"tracking_uri": load_config(str(path)).tracking.mlflow_uri},
        )
        row["publish_after_job_s"] = round(time.monotonic() - t0, 1)
    return row


def summarize(variant: str, r: EttReport) -> dict[str, Any]:
    lost = r.wall_s - r.buckets[Bucket.EFFECTIVE_TRAINING]
    return {
        "variant": variant,
        "ett_pct": round(r.ett_pct, 2),
        "idleness_pct": round(r.idleness_pct, 2),
        "failure_pct": round(r.failure_pct, 2),
        "wall_s": round(r.wall_s, 2),
        "lost_s": round(lost, 2),
        "buckets_s": {b: round(r.buckets[b], 3) for b in BUCKETS},
        "buckets_pct": {b: round(v, 2) for b, v in r.bucket_pct().items()},
        "time_to_start_s": r.time_to_start_s,
        "time_to_recover_s": [
            {"cause": f.cause, "in_process": f.in_process, "seconds": round(f.time_to_recover_s, 3)}
            for f in r.failures
        ],
        "checkpoint_blocking_s": round(r.checkpoint_blocking_total_s, 3),
        "checkpoints_committed": r.num_checkpoints_committed,
        "checkpoint_interval_s": r.checkpoint_interval_s,
        "unsaved_training_s": round(r.observed_unsaved_s, 3),
        "shutdown_s": round(r.buckets[Bucket.SHUTDOWN], 3),
        "step_time_median_s": r.step_time_median_s,
        "steps": r.num_steps,
        "step_executions": r.num_step_executions,
    }


def prewarm(work: Path, variant: str) -> None:
    """A short job under the variant's storage root fills its shared compile cache."""
    from flows.train_flow import train_flow

    cfg = load_config(**overrides(variant, work, 30))
    cfg = cfg.model_copy(update={"job_id": None})  # a new job each time: one run reuses no other
    path = work / "prewarm.yaml"
    dump_config(cfg, path)
    train_flow(config=str(path))


@contextlib.contextmanager
def agent_pool(work: Path, enabled: bool) -> Iterator[None]:
    """With ``enabled``: ``ett pool`` runs (one agent parked before the job starts) and this
    process, which runs the flow, has ``ETT_LAUNCH__AGENT_POOL`` pointing at it."""
    if not enabled:
        yield
        return
    from infra.agent_protocol import ENV_POOL
    from infra.processes import repo_pythonpath
    from tests.factories import PoolProcess

    env = {**os.environ, "PYTHONPATH": repo_pythonpath(os.environ.get("PYTHONPATH"))}
    env = {k: v for k, v in env.items() if k != ENV_POOL}
    pool = PoolProcess(work, env, refill_delay_s=None)  # as a user starts it
    os.environ[ENV_POOL] = pool.socket
    try:
        pool.wait_for("parked after")
        yield
    finally:
        os.environ.pop(ENV_POOL, None)
        if pool.stop() != 0:
            raise RuntimeError(f"ett pool failed:\n{pool.text()}")


def schedule(variants: list[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, variant) in run order: each repeat reverses the previous one's order, so a
    drift of the machine's speed over the run does not always favour the same variant."""
    return [
        (repeat, variant)
        for repeat in range(repeats)
        for variant in (variants if repeat % 2 == 0 else variants[::-1])
    ]


REPEATED = ("ett_pct", "wall_s", "lost_s", "unsaved_training_s", "time_to_start_s")


def repeats_summary(rows: list[dict[str, Any]], variants: list[str]) -> dict[str, Any]:
    """Each variant's medians over the repeats, and each later variant's wall time over the
    first variant's in the same repeat (the pair ratio), per repeat and its median."""
    first = variants[0]
    medians = {
        v: {
            key: round(statistics.median(r[key] for r in rows if r["variant"] == v), 5)
            for key in (*REPEATED, "step_time_median_s")
        }
        for v in variants
    }
    walls = {(r["repeat"], r["variant"]): r["wall_s"] for r in rows}
    repeats = sorted({r["repeat"] for r in rows})
    ratios = {v: [round(walls[n, v] / walls[n, first], 4) for n in repeats] for v in variants[1:]}
    return {
        "medians": medians,
        "wall_ratio_to": first,
        "wall_ratios": ratios,
        "wall_ratio_median": {v: round(statistics.median(x), 4) for v, x in ratios.items()},
    }


def repeats_markdown(rows: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    lines = [
        "| repeat | variant | ETT% | wall (s) | lost (s) | redone (s) | Time to Start (s) "
        "| step median (ms) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['repeat']} | {r['variant']} | {r['ett_pct']:.1f} | {r['wall_s']:.1f} "
            f"| {r['lost_s']:.1f} | {r['unsaved_training_s']:.2f} | {r['time_to_start_s']:.1f} "
            f"| {r['step_time_median_s'] * 1e3:.1f} |"
        )
    for v, m in summary["medians"].items():
        lines.append(
            f"| median | {v} | {m['ett_pct']:.1f} | {m['wall_s']:.1f} | {m['lost_s']:.1f} "
            f"| {m['unsaved_training_s']:.2f} | {m['time_to_start_s']:.1f} "
            f"| {m['step_time_median_s'] * 1e3:.1f} |"
        )
    first = summary["wall_ratio_to"]
    for v, ratios in summary["wall_ratios"].items():
        each = ", ".join(f"{x:.3f}" for x in ratios)
        lines.append(
            f"\nWall time, {v} / {first}, per repeat: {each}; "
            f"median **{summary['wall_ratio_median'][v]:.3f}**"
        )
    return "\n".join(lines)


def markdown(rows: list[dict[str, Any]], ratio: float | None) -> str:
    by = {r["variant"]: r for r in rows}
    cols = [v for v in VARIANTS if v in by]
    lines = [
        "| | " + " | ".join(cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]

    def row(label: str, fn) -> None:  # noqa: ANN001
        lines.append(f"| {label} | " + " | ".join(fn(by[c]) for c in cols) + " |")

    row("**ETT%**", lambda r: f"**{r['ett_pct']:.1f}**")
    row("Idleness%", lambda r: f"{r['idleness_pct']:.1f}")
    row("Failure%", lambda r: f"{r['failure_pct']:.1f}")
    row("wall time (s)", lambda r: f"{r['wall_s']:.1f}")
    row("lost time (s)", lambda r: f"{r['lost_s']:.1f}")
    for b in BUCKETS:
        row(f"{b} (s)", lambda r, b=b: f"{r['buckets_s'][b]:.1f}")
    row("Time to Start (s)", lambda r: f"{r['time_to_start_s']:.1f}")
    row(
        "Time to Recover per failure (s)",
        lambda r: ", ".join(
            f"{f['cause']}{' (in process)' if f['in_process'] else ''} {f['seconds']:.1f}"
            for f in r["time_to_recover_s"]
        ),
    )
    row(
        "checkpoints / blocking (s)",
        lambda r: f"{r['checkpoints_committed']} / {r['checkpoint_blocking_s']:.1f}",
    )
    row("unsaved (redone) training (s)", lambda r: f"{r['unsaved_training_s']:.1f}")
    if ratio is not None:
        lines.append(f"\nLost time, baseline / optimized: **{ratio:.1f}x**")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from infra.accounting.report import COLORS

    fig, ax = plt.subplots(figsize=(10, 2.8))
    for i, r in enumerate(rows):
        left = 0.0
        for b in BUCKETS:
            width = r["buckets_s"][b]
            if width <= 0:
                continue
            label = (
                b
                if i == 0 or b not in {x for x in BUCKETS if rows[0]["buckets_s"][x] > 0}
                else None
            )
            ax.barh(i, width, left=left, color=COLORS[b], label=label)
            left += width
        ax.text(left + 2, i, f"ETT {r['ett_pct']:.1f}%", va="center")
    ax.set_yticks(range(len(rows)), [r["variant"] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("wall time (s)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=5, frameon=False)
    ax.set_title("Where the wall time of the same job went")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _variants(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown variant {', '.join(unknown) or repr(text)}: choose from {', '.join(VARIANTS)}"
        )
    return names


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--backoff-s", type=float, default=2.0)
    parser.add_argument(
        "--only",
        type=_variants,
        help=f"run these variants, comma-separated, in this order (of {', '.join(VARIANTS)})",
    )
    parser.add_argument(
        "--pool",
        action="store_true",
        help="the optimized job claims its launchers from `ett pool` (ETT_LAUNCH__AGENT_POOL)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the variants this many times, in alternating order (A B, B A, ...); the "
        "table adds each job's row, medians and each later variant's wall time over the "
        "first's, per repeat",
    )
    parser.add_argument("--work-dir", help="keep data and jobs here (default: a temp dir)")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument(
        "--report-only", action="store_true", help="only report the jobs in --work-dir again"
    )
    args = parser.parse_args()
    if args.report_only and not args.work_dir:
        parser.error("--report-only needs the --work-dir of the runs")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, not {args.repeats}")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-ett-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    data = load_config(data={"url": f"file://{work}/data"})
    if not (work / "data" / "_meta.json").exists():
        from trainer.data.synthetic import generate

        generate(data.data, data.data.url)
    variants = args.only or list(VARIANTS)
    rows = []
    started = time.time()
    for repeat, variant in schedule(variants, args.repeats):
        if args.report_only:  # the jobs ran already under --work-dir: tables again
            url = job_url(work, variant, repeat)
            rows.append({**summarize(variant, report_for_job(JobLayout.at(url))), "repeat": repeat})
            continue
        pooled = args.pool and variant in OPTIMIZED
        if variant in OPTIMIZED and repeat == 0:  # later repeats find the cache warm
            prewarm(work, variant)
        with agent_pool(work, enabled=pooled):
            rows.append(run_variant(variant, work, args, repeat))
        rows[-1]["agent_pool"] = pooled
        print(f"# {variant}, repeat {repeat}: ETT {rows[-1]['ett_pct']:.1f}%", flush=True)
    repeats = repeats_summary(rows, variants) if args.repeats > 1 else None
    rows_first = [r for r in rows if r["repeat"] == 0]
    by = {r["variant"]: r for r in rows_first}
    ratio = None
    if {"baseline", "optimized"} <= set(by) and by["optimized"]["lost_s"] > 0:
        ratio = by["baseline"]["lost_s"] / by["optimized"]["lost_s"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "ett",
        "steps": args.steps,
        "schedule": {v: faults(v, args.steps) for v in variants},
        "backoff_s": args.backoff_s,
        "baseline_checkpoint_every_steps": BASELINE_EVERY_STEPS,
        "lost_time_ratio": None if ratio is None else round(ratio, 2),
        "repeats": args.repeats,
        "rows": rows,
        "repeats_summary": repeats,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_avg": os.getloadavg(),
        },
        "started": started,
        "minutes": round((time.time() - started) / 60, 1),
    }
    suffix = ("-" + "-".join(variants) if args.only else "") + ("-pool" if args.pool else "")
    (out / f"ett{suffix}.json").write_text(json.dumps(result, indent=2))
    table = markdown(rows_first, ratio)
    if repeats is not None:
        table += "\n\n" + repeats_markdown(rows, repeats)
    (out / f"ett{suffix}.md").write_text(table + "\n")
    plot(rows_first, out / f"ett{suffix}.png")
    print(table)
    if {"baseline", "optimized"} <= set(by):
        simulate(work, out / "simulate")
    return 0


def simulate(work: Path, folder: Path) -> None:
    """``ett simulate --baseline ... --optimized ...`` on the two runs just measured."""
    from infra.whatif.scaling import ScalingLaws
    from infra.whatif.simulate_report import format_text, run_simulate, write_outputs

    jobs = {v: JobLayout.at(job_url(work, v)) for v in ("baseline", "optimized")}
    result = run_simulate(jobs, ScalingLaws(), days=30)
    print(format_text(result), end="")
    print(f"wrote {', '.join(str(p) for p in write_outputs(result, folder))}")


if __name__ == "__main__":
    sys.exit(main())
