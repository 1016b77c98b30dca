"""Shutdown time of a training job: publishing inside the job (coupled) vs from its anchor.

Both modes train the same tiny job under torchrun (--nproc ranks, CPU/gloo) to --steps,
ending with an anchor checkpoint:

- coupled (the baseline, lives only in the benchmarks): torchrun runs
  benchmarks/coupled_trainer.py on every rank (it imports the publisher at start-up); after
  training, rank 0 publishes the anchor in the same process before the job ends (torchrun
  waits for it, so every rank's allocation is held meanwhile);
- decoupled (the product): the job ends at the anchor; ``python -m publish`` then runs as a
  separate CPU process (what the Prefect ``publish`` flow runs on a CPU worker).

Shutdown = last train_step end (rank 0's ledger, infra/accounting/ledger_read.py) -> job end
(the torchrun process exited, timed by this script). Publish time = the publisher's ledger spans
(publish_load/export/validate/register) and, decoupled, the publisher process's wall time (with its
imports). Modes alternate per repeat; each mode registers into its own registered model, so repeats
after the first re-score a champion in both modes alike. MLflow: a SQLite store in the work dir (or
--tracking-uri, e.g. the local stack's server).

    .venv/bin/python benchmarks/bench_publish.py [--nproc 2 --steps 40 --repeats 2]

Prints a markdown table and writes benchmarks/results/publish.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.save import save_json  # noqa: E402
from infra.accounting.ledger_format import PUBLISH_SPANS, Mark, Span  # noqa: E402
from infra.accounting.ledger_read import read_events  # noqa: E402
from infra.job_layout import JobLayout  # noqa: E402
from infra.settings import JobConfig, dump_config, load_config  # noqa: E402
from tasks.attempt import LaunchSpec  # noqa: E402

COUPLED = str(ROOT / "benchmarks" / "coupled_trainer.py")

MODES = ("coupled", "decoupled")
# Default validation bounds (the 40-step job lands within them: AUC ~0.69, mean prediction
# ~0.27 vs CTR ~0.32); 4096 holdout rows for parity, metrics and the champion re-score.
PUBLISH_ENV = {"ETT_PUBLISH_HOLDOUT_ROWS": "4096"}


def job_config(work: Path, job_id: str, args: argparse.Namespace, tracking_uri: str) -> JobConfig:
    return load_config(
        job_id=job_id,
        storage={"root": f"file://{work}/store"},
        data={
            "url": f"file://{work}/data",
            "batch_size": 256,
            "eval_batch_size": 1024,
            "generator": {"rows": 40_000, "holdout_rows": 8192, "shards": 4},
        },
        train={"steps": args.steps, "eval_every": 0, "eval_rows": 4096, "log_every": 10},
        checkpoint={"mode": "async_staged", "every_steps": max(args.steps // 2, 1)},
        tracking={"mlflow_uri": tracking_uri, "experiment": "bench-publish"},
    )


def last_step_end(job_url: str) -> float:

    ends = [
        e.end
        for e in read_events(JobLayout.at(job_url))
        if e.name == Span.TRAIN_STEP and e.rank == 0
    ]
    if not ends:
        raise RuntimeError(f"no train_step in the ledger of {job_url}")
    return max(ends)


def trainer_end(job_url: str) -> float:
    """When rank 0's trainer finished (its job_end mark): what follows is in-job publishing
    (coupled) or just process exit (decoupled)."""

    marks = [
        e.end for e in read_events(JobLayout.at(job_url)) if e.name == Mark.JOB_END and e.rank == 0
    ]
    if not marks:
        raise RuntimeError(f"no job_end mark in the ledger of {job_url}")
    return max(marks)


def publish_spans(job_url: str) -> dict[str, float]:

    spans = [e for e in read_events(JobLayout.at(job_url)) if e.name in PUBLISH_SPANS]
    out = {e.name: round(e.duration, 3) for e in spans}
    out["total"] = round(sum(e.duration for e in spans), 3)
    return out


def anchor_url(job_url: str) -> str:

    marks = [e for e in read_events(JobLayout.at(job_url)) if e.name == Mark.ANCHOR_COMMITTED]
    if not marks:
        raise RuntimeError(f"{job_url} committed no anchor")
    return str(marks[-1].attrs["url"])


def run_timed(cmd: list[str], env: dict[str, str], log_path: Path) -> tuple[int, float, float]:
    """Run to completion; (exit code, start, end) in Unix seconds, output to a log file."""
    with open(log_path, "w") as log:
        start = time.time()
        code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        return code, start, time.time()


def run_mode(mode: str, work: Path, rep: int, args: argparse.Namespace, tracking: str) -> dict:
    job_id = f"bench-{mode}-{rep}"
    config = job_config(work, job_id, args, tracking)
    cfg_path = work / f"{job_id}.yaml"
    dump_config(config, cfg_path)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        **PUBLISH_ENV,
        "ETT_PUBLISH_REGISTERED_MODEL": f"bench-ranker-{mode}",
    }
    program = [COUPLED] if mode == "coupled" else ["-m", "trainer"]
    cmd = LaunchSpec(str(cfg_path), nproc=args.nproc, program=tuple(program)).command()
    code, start, end = run_timed(cmd, env, work / f"{job_id}.log")
    if code != 0:
        raise RuntimeError(f"{mode} job failed ({code}); see {work / f'{job_id}.log'}")
    row: dict[str, Any] = {"mode": mode, "repeat": rep, "job_wall_s": round(end - start, 3)}
    row["shutdown_s"] = round(end - last_step_end(config.layout.url), 3)
    row["after_trainer_end_s"] = round(end - trainer_end(config.layout.url), 3)
    if mode == "decoupled":
        uri = anchor_url(config.layout.url)
        cmd = [sys.executable, "-m", "publish", "--uri", uri, "--job-id", job_id]
        pcode, pstart, pend = run_timed(cmd, env, work / f"{job_id}-publish.log")
        if pcode != 0:
            raise RuntimeError(f"publish failed ({pcode}); see {work / f'{job_id}-publish.log'}")
        row["publisher_process_s"] = round(pend - pstart, 3)
    row["publish_spans_s"] = publish_spans(config.layout.url)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--tracking-uri", help="MLflow server (default: SQLite in the work dir)")
    p.add_argument("--work-dir", help="keep data, jobs and logs here (default: a temp dir)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "publish.json"))
    args = p.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-publish-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    tracking = args.tracking_uri or f"sqlite:///{work}/mlflow.db"
    print(f"work dir {work}; MLflow {tracking}", flush=True)
    from mlflow import MlflowClient

    from trainer.data.synthetic import generate

    generate(job_config(work, "data", args, tracking).data)
    client = MlflowClient(tracking)  # create the store (and its schema) before timing
    if client.get_experiment_by_name("bench-publish") is None:
        client.create_experiment("bench-publish", artifact_location=f"file://{work}/artifacts")

    rows = []
    for rep in range(args.repeats):
        for mode in MODES if rep % 2 == 0 else MODES[::-1]:
            row = run_mode(mode, work, rep, args, tracking)
            print(json.dumps(row), flush=True)
            rows.append(row)

    def med(mode: str, key: str, sub: str | None = None) -> float:
        vals = [r[key][sub] if sub else r[key] for r in rows if r["mode"] == mode]
        return round(statistics.median(vals), 3)

    summary = {
        mode: {
            "shutdown_s": med(mode, "shutdown_s"),
            "after_trainer_end_s": med(mode, "after_trainer_end_s"),
            "job_wall_s": med(mode, "job_wall_s"),
            "publish_spans_s": med(mode, "publish_spans_s", "total"),
        }
        for mode in MODES
    }
    summary["decoupled"]["publisher_process_s"] = med("decoupled", "publisher_process_s")
    saved = summary["coupled"]["shutdown_s"] - summary["decoupled"]["shutdown_s"]
    result = {
        "benchmark": "publish",
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "params": {
            "nproc": args.nproc,
            "steps": args.steps,
            "repeats": args.repeats,
            "tracking": "sqlite" if not args.tracking_uri else "server",
        },
        "summary": summary,
        "shutdown_saved_per_job_s": round(saved, 3),
        "rank_seconds_saved_per_job": round(saved * args.nproc, 3),
        "runs": rows,
    }
    c, d = summary["coupled"], summary["decoupled"]
    print(
        "\n| mode | shutdown: last step -> job end (s) | of which after trainer end (s) "
        "| job wall (s) | publish spans (s) | publisher process (s) |\n|---|---|---|---|---|---|"
    )
    print(
        f"| coupled (publish in job) | {c['shutdown_s']} | {c['after_trainer_end_s']} | "
        f"{c['job_wall_s']} | {c['publish_spans_s']} | (inside the job) |"
    )
    print(
        f"| decoupled (anchor, publish separately) | {d['shutdown_s']} | "
        f"{d['after_trainer_end_s']} | {d['job_wall_s']} | {d['publish_spans_s']} | "
        f"{d['publisher_process_s']} |"
    )
    print(f"\nshutdown saved per job: {saved:.2f} s ({saved * args.nproc:.1f} rank-seconds)")
    save_json(result, args.out)


if __name__ == "__main__":
    main()
