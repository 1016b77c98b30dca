"""Training throughput (examples/s) and MFU with 1 and 2 processes, variants side by side.

Each run trains the demo model on the same generated data under torchrun (gloo on CPU),
with checkpoints and evaluation off; step time comes from the ledger's train_step spans
(steady state: the first 10 steps are skipped), so start-up is not mixed in. MFU comes
from the same ledger (infra/accounting/mfu.py): "steady" divides the median step's model FLOPs (all
ranks) by the median step time and nproc x the device peak; "job" is the report's MFU over
all effective steps, and "ETT x MFU" the job's end-to-end efficiency. "Busiest rank FLOPs
/ mean" is the per-step work imbalance across ranks (median over steps; 1.0 is even), what
the rank balancing (data.balance_ranks) removes: it is exact, where step times on a shared
machine are not. On a CPU the peak is
a measured single-thread matmul peak (each rank runs one thread), cached per machine.

Variants (``--variants``) are named config overrides, run one after another for each
process count and alternated between repeats (ABBA), so drift hits them alike; a variant
that needs several ranks is skipped for one. ``--workload long_history`` uses long-tailed
histories (cut at 512, mean 48) and 256-row batches, where per-rank attention work varies
(``long_history_b64``: 64-row batches, more so).

    .venv/bin/python benchmarks/bench_throughput.py [--steps 150] [--nproc 1,2]
        [--variants default,unbalanced] [--workload demo|long_history|long_history_b64]
        [--repeats 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.save import save_json  # noqa: E402
from infra.accounting.ett import compute_report  # noqa: E402
from infra.accounting.ledger_format import Span  # noqa: E402
from infra.accounting.ledger_read import read_events  # noqa: E402
from infra.accounting.mfu import cpu_peak, mfu_report  # noqa: E402
from infra.settings import load_config  # noqa: E402
from tests.factories import run_trainer  # noqa: E402

WARMUP_STEPS = 10


@dataclass(frozen=True)
class Variant:
    """A named set of config overrides (merged per section over the workload's)."""

    name: str
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    min_nproc: int = 1  # skipped below this many processes (no effect there)


VARIANTS = {
    v.name: v
    for v in (
        Variant("default"),
        Variant("unbalanced", {"data": {"balance_ranks": False}}, min_nproc=2),
        # A blocking all-reduce of the stop/checkpoint flags every step, instead of the
        # deferred one read a step later (trainer/consensus.py).
        Variant("blocking_consensus", {"train": {"step_consensus": "blocking"}}, min_nproc=2),
    )
}
WORKLOADS: dict[str, dict[str, dict[str, Any]]] = {
    "demo": {},
    "long_history": {
        "data": {
            "max_history_len": 512,
            "batch_size": 256,
            "generator": {"rows": 200_000, "mean_history_len": 48.0},
        }
    },
    # The same histories in 64-row global batches (data.batch_size is the global batch since
    # issue 29: 32 rows a rank on 2 ranks): fewer rows per batch, more uneven work per rank.
    "long_history_b64": {
        "data": {
            "max_history_len": 512,
            "batch_size": 64,
            "generator": {"rows": 200_000, "mean_history_len": 48.0},
        }
    },
}


def _merge(*layers: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for layer in layers:
        for section, values in layer.items():
            out[section] = {**out.get(section, {}), **values}
    return out


def measure(
    tmp: Path, workload: dict, variant: Variant, nproc: int, steps: int, run: int
) -> dict[str, Any]:
    sections = _merge(
        workload,
        {"storage": {"root": f"file://{tmp}/store"}, "data": {"url": f"file://{tmp}/data"}},
        {"train": {"steps": steps, "eval_every": 0, "eval_rows": 1024, "log_every": 50}},
        {"checkpoint": {"mode": "off"}},
        variant.overrides,
    )
    config = load_config(job_id=f"throughput-{variant.name}-{nproc}-{run}", **sections)
    result = run_trainer(config, tmp, nproc=nproc, timeout=1800)
    if result.returncode:
        raise SystemExit(f"trainer failed ({variant.name}, {nproc} proc):\n{result.stdout[-3000:]}")
    events = read_events(config.layout)
    steady = [e for e in events if e.name == Span.TRAIN_STEP and (e.step or 0) > WARMUP_STEPS]
    rank0 = [e.duration for e in steady if e.rank == 0]
    step_s = statistics.median(rank0)
    per_step: dict[int, float] = {}
    per_rank: dict[int, list[float]] = {}
    for e in steady:
        per_step[e.step] = per_step.get(e.step, 0.0) + float(e.attrs.get("flops", 0))
        per_rank.setdefault(e.step, []).append(float(e.attrs.get("flops", 0)))
    # Work imbalance: the busiest rank's model FLOPs over the mean, per step (1.0: even).
    imbalance = statistics.median(max(f) / statistics.mean(f) for f in per_rank.values() if any(f))
    report = compute_report(events)
    job = mfu_report(events, report)
    peak = job.peak_flops if job else None
    steady_mfu = statistics.median(per_step.values()) / (nproc * peak * step_s) if peak else None
    by_rank = {
        r: statistics.median(e.duration for e in steady if e.rank == r) for r in range(nproc)
    }
    return {
        "variant": variant.name,
        "nproc": nproc,
        "run": run,
        "median_step_s": step_s,
        "median_step_s_by_rank": by_rank,
        "examples_per_s": config.data.batch_size / step_s,  # the global batch, all ranks
        "model_flops_per_step": statistics.median(per_step.values()),
        "flops_max_over_mean": imbalance,
        "mfu_steady_pct": None if steady_mfu is None else 100 * steady_mfu,
        "mfu_job_pct": job.mfu_pct if job else None,
        "ett_pct": report.ett_pct,
        "ett_x_mfu_pct": job.ett_x_mfu_pct if job else None,
        "peak_flops": peak,
        "peak_source": job.peak_source if job else None,
    }


def _pct(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--nproc", default="1,2")
    parser.add_argument("--variants", default="default", help=f"of {sorted(VARIANTS)}")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="demo")
    parser.add_argument("--repeats", type=int, default=1, help="alternating (ABBA) repeats")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/throughput.json")
    args = parser.parse_args()
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; known: {sorted(VARIANTS)}")
    variants = [VARIANTS[v] for v in args.variants.split(",")]
    workload = WORKLOADS[args.workload]
    from trainer.data.synthetic import generate

    cpu_peak(threads=1)  # measured once (cached) before the runs, never inside them
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        data = load_config(**_merge(workload, {"data": {"url": f"file://{tmp}/data"}})).data
        generate(data, data.url)
        for run in range(args.repeats):
            order = variants if run % 2 == 0 else variants[::-1]
            for n in (int(x) for x in args.nproc.split(",")):
                for variant in order:
                    if n >= variant.min_nproc:
                        rows.append(measure(tmp, workload, variant, n, args.steps, run))
    load = (load_before, os.getloadavg())

    groups: dict[tuple[int, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["nproc"], row["variant"]), []).append(row)
    summary = []
    for (nproc, name), runs in groups.items():
        med = lambda key, runs=runs: (  # noqa: E731
            None if runs[0][key] is None else statistics.median(r[key] for r in runs)
        )
        summary.append(
            {
                "nproc": nproc,
                "variant": name,
                **{
                    k: med(k)
                    for k in (
                        "median_step_s",
                        "flops_max_over_mean",
                        "examples_per_s",
                        "mfu_steady_pct",
                        "mfu_job_pct",
                        "ett_pct",
                        "ett_x_mfu_pct",
                    )
                },
            }
        )
    summary.sort(key=lambda s: (s["nproc"], args.variants.split(",").index(s["variant"])))
    base = summary[0]["examples_per_s"]
    print(
        f"workload {args.workload}, {args.steps} steps, {args.repeats} repeat(s), "
        f"load avg {load[0][0]:.1f} -> {load[1][0]:.1f}; peak {rows[0]['peak_source']}"
    )
    print(
        "| processes | variant | median step (s) | examples/s | vs first row "
        "| busiest rank FLOPs / mean | MFU steady % | MFU job % | ETT % | ETT x MFU % |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for s in summary:
        print(
            f"| {s['nproc']} | {s['variant']} | {s['median_step_s']:.4f} "
            f"| {s['examples_per_s']:.0f} | {s['examples_per_s'] / base:.2f}x "
            f"| {s['flops_max_over_mean']:.3f} | {_pct(s['mfu_steady_pct'])} "
            f"| {_pct(s['mfu_job_pct'])} "
            f"| {_pct(s['ett_pct'], 1)} | {_pct(s['ett_x_mfu_pct'])} |"
        )
    result = {"workload": args.workload, "summary": summary, "runs": rows, "loadavg": load}
    save_json(result, args.out)


if __name__ == "__main__":
    main()
