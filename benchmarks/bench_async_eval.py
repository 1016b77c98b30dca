"""Holdout evaluation in the training loop vs in the async evaluator beside it, one run.

The demo model and holdout (50k rows), 1 rank, eager, a checkpoint every ``--every`` steps,
trained twice one after the other on the same data:

- in-loop: the trainer evaluates every ``--every`` steps (training stops meanwhile);
- async: the trainer does not evaluate; ``python -m trainer.checkpoint_evaluator`` runs beside it
and
  evaluates the same steps from their checkpoints (the trainer's config has
  ``eval_every: 0``, the evaluator's copy the real interval).

    .venv/bin/python benchmarks/bench_async_eval.py [--steps 160] [--every 20]

Prints a markdown table: training wall time (first step start to last step end) of each,
their ratio, the median step time beside an async evaluation vs without one (what the
evaluator takes from training), and the evaluator's peak memory. Writes
benchmarks/results/async_eval.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from infra.accounting.ledger_format import Span  # noqa: E402
from infra.accounting.ledger_read import read_events  # noqa: E402
from infra.settings import JobConfig, dump_config, load_config  # noqa: E402
from tests.factories import run_trainer, write_dataset  # noqa: E402


def make_config(tmp: Path, job_id: str, steps: int, eval_every: int, ckpt_every: int) -> JobConfig:
    return load_config(
        job_id=job_id,
        storage={"root": f"file://{tmp}/store"},
        data={"url": f"file://{tmp}/data", "generator": {"rows": 40_000}},
        train={"steps": steps, "eval_every": eval_every, "log_every": 50, "compile": False},
        checkpoint={"mode": "async_staged", "every_steps": ckpt_every, "keep_latest_k": 3},
    )


def train_wall(config: JobConfig) -> tuple[float, list]:
    steps = [e for e in read_events(config.layout) if e.name == Span.TRAIN_STEP]
    return max(e.end for e in steps) - min(e.start for e in steps), steps


def peak_rss_mb(pid: int, stop: threading.Event, out: list[float]) -> None:
    """VmHWM of a running process, read until it exits."""
    while not stop.is_set():
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    out.append(int(line.split()[1]) / 1024)
        except OSError:
            return
        stop.wait(0.5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--every", type=int, default=20)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-async-eval-"))

    in_loop = make_config(tmp, "in-loop", args.steps, args.every, args.every)
    write_dataset(in_loop)
    result = run_trainer(in_loop, tmp, timeout=3600)
    if result.returncode:
        raise SystemExit(f"in-loop run failed:\n{result.stdout[-3000:]}")
    wall_loop, _ = train_wall(in_loop)
    evals_loop = [e.duration for e in read_events(in_loop.layout) if e.name == Span.EVAL]

    trainer_cfg = make_config(tmp, "async", args.steps, 0, args.every)
    evaluator_cfg = make_config(tmp, "async", args.steps, args.every, args.every)
    path = tmp / "async-evaluator.yaml"
    dump_config(evaluator_cfg, path)
    log = tmp / "evaluator.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainer.checkpoint_evaluator", "--config", str(path)],
            stdin=subprocess.PIPE,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
        )
    rss: list[float] = []
    stop = threading.Event()
    watcher = threading.Thread(target=peak_rss_mb, args=(proc.pid, stop, rss), daemon=True)
    watcher.start()
    try:
        while b"evaluating " not in log.read_bytes():  # ready before the trainer starts
            if proc.poll() is not None:
                raise SystemExit(f"evaluator exited:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        result = run_trainer(trainer_cfg, tmp, timeout=3600)
        if result.returncode:
            raise SystemExit(f"async run failed:\n{result.stdout[-3000:]}")
        code = proc.wait(timeout=1800)
        if code:
            raise SystemExit(f"evaluator exited {code}:\n{log.read_text()[-3000:]}")
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wall_async, steps = train_wall(trainer_cfg)
    evals = [e for e in read_events(trainer_cfg.layout) if e.name == Span.ASYNC_EVAL]

    def beside(s) -> bool:
        return any(s.start < e.end and e.start < s.end for e in evals)

    warm = [s for s in steps if s.step > 5]  # the first steps warm caches up
    with_eval = [s.duration for s in warm if beside(s)]
    without = [s.duration for s in warm if not beside(s)]
    out = {
        "steps": args.steps,
        "eval_every": args.every,
        "train_wall_in_loop_s": wall_loop,
        "train_wall_async_s": wall_async,
        "in_loop_eval_median_s": statistics.median(evals_loop),
        "async_eval_median_s": statistics.median(e.duration for e in evals),
        "async_evals": [e.step for e in evals],
        "step_median_beside_eval_s": statistics.median(with_eval) if with_eval else None,
        "step_median_alone_s": statistics.median(without) if without else None,
        "steps_beside_eval": len(with_eval),
        "steps_alone": len(without),
        "evaluator_peak_rss_mb": max(rss, default=None),
        "cpus": os.cpu_count(),
    }
    (ROOT / "benchmarks" / "results").mkdir(exist_ok=True)
    (ROOT / "benchmarks" / "results" / "async_eval.json").write_text(json.dumps(out, indent=2))
    step_ratio = (
        f"{out['step_median_beside_eval_s'] / out['step_median_alone_s']:.2f}x"
        if with_eval and without
        else "n/a"
    )
    print(f"| {args.steps} steps, eval every {args.every} | in-loop | async |")
    print("|---|---|---|")
    print(f"| training wall time | {wall_loop:.1f} s | {wall_async:.1f} s |")
    print(f"| async / in-loop wall time | | {wall_async / wall_loop:.2f}x |")
    print(
        f"| one evaluation (median) | {out['in_loop_eval_median_s']:.2f} s (training stopped) "
        f"| {out['async_eval_median_s']:.2f} s (beside training) |"
    )
    print(f"| step time beside an evaluation / without | | {step_ratio} |")
    print(f"| evaluator peak memory | | {out['evaluator_peak_rss_mb']:.0f} MB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
