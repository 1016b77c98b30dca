"""Warm Time to Start: a fresh launcher against a parked agent from ``ett pool``, side by side.

The demo model and data, one rank, a warm compile cache (a first job under the same storage
root fills it, as every job after the first finds it). Then ``--repeat`` pairs of short
``ett train`` jobs alternate: **cold** (a fresh ``python -m trainer.launch``, what every job
does without a pool) and **pooled** (``ETT_LAUNCH__AGENT_POOL`` set: the launcher is a parked agent
that imported torch, TorchRec, the trainer and the compiler before the job existed). Before
every job the pool has an agent parked again and nothing else runs, so the pool's refill
never overlaps the start being measured.

Each job's Time to Start comes from its ledger (infra/accounting/ett.py: the job's first event to
its first step), with the spans it is made of: ``launcher_init`` (spawn or claim -> the trainer
runs), the compile cache load and the compile warm-up.

    .venv/bin/python benchmarks/bench_pool.py [--repeat 3] [--steps 40] [--work-dir W]

Prints a markdown table and writes benchmarks/results/pool.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from infra.job_layout import JobLayout

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.save import run_record, save_json  # noqa: E402
from infra.accounting.ett import report_for_job  # noqa: E402
from infra.accounting.ledger_format import Span  # noqa: E402
from infra.accounting.ledger_read import read_events  # noqa: E402
from infra.agent_protocol import ENV_POOL  # noqa: E402
from infra.processes import repo_pythonpath  # noqa: E402
from infra.settings import dump_config, load_config  # noqa: E402
from tests.factories import PoolProcess  # noqa: E402

ETT = Path(sys.executable).with_name("ett")
MODES = ("cold", "pooled")


def job_config(work: Path, job_id: str, steps: int) -> Path:
    config = load_config(
        job_id=job_id,
        storage={"root": f"file://{work}/store"},
        data={"url": f"file://{work}/data"},
        train={"steps": steps, "eval": "off"},
        tracking={"mlflow_uri": f"sqlite:///{work}/mlflow.db", "experiment": "bench-pool"},
    )
    path = work / f"{job_id}.yaml"
    dump_config(config, path)
    return path


def train(work: Path, job_id: str, steps: int, env: dict[str, str]) -> dict[str, Any]:
    """One ``ett train`` job; its Time to Start and the spans it is made of."""
    path = job_config(work, job_id, steps)
    proc = subprocess.run(
        [str(ETT), "train", "--config", str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"job {job_id} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    url = f"file://{work}/store/jobs/{job_id}"
    events = read_events(JobLayout.at(url))

    def span(name: str, stage: str | None = None) -> float | None:
        found = [
            e.end - e.start
            for e in events
            if e.name == name
            and e.attempt == 0
            and (stage is None or e.attrs.get("stage") == stage)
        ]
        return round(found[0], 2) if found else None

    launch = next(e for e in events if e.name == Span.LAUNCHER_INIT and e.attempt == 0)
    return {
        "job_id": job_id,
        "time_to_start_s": round(report_for_job(JobLayout.at(url)).time_to_start_s, 2),
        "launcher_init_s": span(Span.LAUNCHER_INIT),
        "pooled": bool(launch.attrs.get("pooled")),
        "compile_cache_load_s": span(Span.PRE_TRAIN, "compile_cache_load"),
        "compile_s": span(Span.COMPILE),
    }


def median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r[key] is not None]
    return round(statistics.median(values), 2) if values else None


def markdown(rows: list[dict[str, Any]], ratios: list[float]) -> str:
    lines = [
        "| launcher | Time to Start (s), median | range | launcher_init (s) | "
        "compile cache load (s) | compile warm-up (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        tts = [r["time_to_start_s"] for r in mine]
        lines.append(
            f"| {mode} | **{median(mine, 'time_to_start_s')}** | {min(tts)}-{max(tts)} | "
            f"{median(mine, 'launcher_init_s')} | {median(mine, 'compile_cache_load_s')} | "
            f"{median(mine, 'compile_s')} |"
        )
    lines.append("")
    lines.append(
        f"pooled / cold Time to Start, per pair: {', '.join(f'{r:.2f}x' for r in ratios)} "
        f"(median {statistics.median(ratios):.2f}x)"
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="cold/pooled pairs")
    parser.add_argument("--steps", type=int, default=40, help="steps per job")
    parser.add_argument("--work-dir", help="keep data and jobs here (default: a temp dir)")
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-pool-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": repo_pythonpath(os.environ.get("PYTHONPATH"))}
    env.pop(ENV_POOL, None)
    data = load_config(data={"url": f"file://{work}/data"}).data
    if not (work / "data" / "_meta.json").exists():
        from trainer.data.synthetic import generate

        generate(data, data.url)
    started = time.time()
    run_id = int(started)
    print("warming the compile cache (a first job compiles cold)...", flush=True)
    train(work, f"prewarm-{run_id}", 20, env)
    pool = PoolProcess(work, env)
    rows: list[dict[str, Any]] = []
    try:
        claims = 0
        for i in range(args.repeat):
            for mode in MODES:
                pool.wait_for("parked after", count=claims + 1)
                job_env = {**env, ENV_POOL: pool.socket} if mode == "pooled" else env
                row = {
                    "mode": mode,
                    "pair": i,
                    **train(work, f"{mode}-{run_id}-{i}", args.steps, job_env),
                }
                if row["pooled"] != (mode == "pooled"):
                    raise RuntimeError(f"{row['job_id']}: pooled={row['pooled']} in {mode} mode")
                claims += mode == "pooled"
                rows.append(row)
                print(f"{mode} {i}: Time to Start {row['time_to_start_s']} s", flush=True)
    finally:
        code = pool.stop()
    if code != 0:
        raise RuntimeError(f"ett pool exited {code}:\n{pool.text()}")
    by_pair = {(r["pair"], r["mode"]): r["time_to_start_s"] for r in rows}
    ratios = [by_pair[(i, "pooled")] / by_pair[(i, "cold")] for i in range(args.repeat)]
    table = markdown(rows, ratios)
    medians = {m: median([r for r in rows if r["mode"] == m], "time_to_start_s") for m in MODES}
    save_json(
        {
            "benchmark": "pool",
            "steps": args.steps,
            "repeat": args.repeat,
            "rows": rows,
            "median_s": medians,
            "pooled_over_cold": [round(r, 3) for r in ratios],
            **run_record(started),
        },
        ROOT / "benchmarks" / "results" / "pool.json",
    )
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
