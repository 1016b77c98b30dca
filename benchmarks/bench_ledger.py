"""Ledger overhead per training step: the demo model's real step, bare vs instrumented.

The trainer of the demo config (DLRM on TorchRec, batch 1024, one process, gloo on CPU, torch's
default threads) is built in this process; 64 of its batches are held in memory so disk reads
do not add noise. Steps then alternate between bare and wrapped in
``ledger.span(Span.TRAIN_STEP)`` (written and flushed to a local file per step, as in training),
in ABBA order at the level of single steps, so drift (thermal, other load) cancels.
Reported, all from the same run:

- the paired overhead: median over adjacent step pairs of (instrumented / bare - 1), with a
  bootstrap 95% interval;
- the in-situ cost: time spent inside the ledger around each instrumented step (span entry +
  exit, measured directly), as a share of the median bare step — the steadier number;
- the cost of one event in a tight loop, where caches are hot (a lower bound).

``--events-only`` skips the model and compares, side by side in one run, the cost of one
event on the training thread for a ledger on local disk and one on object storage
(``--object-url``, default ``memory://bench``: spooled locally, uploaded by a background thread
every ``--sync-every-s``): median, p99 and worst event, where an upload made on the writing
thread would show.

    .venv/bin/python benchmarks/bench_ledger.py [--pairs 1500 --batch 1024]
    .venv/bin/python benchmarks/bench_ledger.py --events-only [--object-url s3://bucket/x]

Prints a markdown table and writes benchmarks/results/ledger.json. Target: < 1% per step.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from infra.job_layout import JobLayout

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.save import save_json  # noqa: E402
from infra.accounting.ledger import Ledger  # noqa: E402
from infra.accounting.ledger_format import Span  # noqa: E402
from infra.settings import load_config  # noqa: E402
from trainer.data.synthetic import generate  # noqa: E402
from trainer.init_stages import Initializer  # noqa: E402
from trainer.train import train_step  # noqa: E402


def trainer_step(tmp: Path, batch: int, rows: int, threads: int) -> Callable[[], None]:
    """One real training step of the demo model per call, cycling over cached batches."""
    if threads:
        torch.set_num_threads(threads)
    config = load_config(
        job_id="bench-ledger",
        storage={"root": f"file://{tmp}/store"},
        data={
            "url": f"file://{tmp}/data",
            "batch_size": batch,
            "generator": {"rows": rows, "holdout_rows": 2048, "shards": 2},
        },
        train={"eval_rows": 1024, "compile": False},
        checkpoint={"mode": "off"},
    )
    generate(config.data, config.data.url)
    with Ledger(JobLayout.at(str(tmp / "init"))) as init_ledger:
        parts = Initializer(config, init_ledger, None).run()
    cached = [parts.first_batch] if parts.first_batch is not None else []
    cached += list(itertools.islice(parts.batches, 63))
    batches = itertools.cycle(cached)
    model, optimizer, device = parts.model, parts.optimizer, parts.env.device

    def step() -> None:
        train_step(model, optimizer, next(batches), device)

    return step


def _bootstrap_ci(ratios: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval (in %) of the median paired ratio: is the overhead noise?"""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(n))
    return 100.0 * (meds[int(0.025 * n)] - 1.0), 100.0 * (meds[int(0.975 * n)] - 1.0)


def timed_step(step: Callable[[], None], ledger: Ledger | None, index: int) -> tuple[float, float]:
    """(step wall seconds, seconds spent inside the ledger) for one step."""
    t0 = time.perf_counter()
    if ledger is None:
        step()
        return time.perf_counter() - t0, 0.0
    with ledger.span(Span.TRAIN_STEP, step=index) as attrs:
        t1 = time.perf_counter()
        step()
        t2 = time.perf_counter()
        attrs["loss"] = 0.5  # the trainer records the loss with each step
    t3 = time.perf_counter()
    return t3 - t0, (t1 - t0) + (t3 - t2)


def event_cost_us(ledger: Ledger, n: int) -> float:
    """Cost of one train_step span in a tight loop (hot caches), in microseconds."""
    t0 = time.perf_counter()
    for i in range(n):
        with ledger.span(Span.TRAIN_STEP, step=i) as attrs:
            attrs["loss"] = 0.5
    return (time.perf_counter() - t0) / n * 1e6


def event_latencies_us(ledger: Ledger, n: int) -> list[float]:
    """Each train_step span's time on the writing thread, in microseconds."""
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        with ledger.span(Span.TRAIN_STEP, step=i) as attrs:
            attrs["loss"] = 0.5
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def events_only(args: argparse.Namespace) -> dict[str, object]:
    """Local disk vs object storage, interleaved in rounds so drift hits both alike."""
    rounds, per_round = 10, max(args.events // 10, 1)
    with tempfile.TemporaryDirectory(prefix="bench-ledger-") as tmp:
        ledgers = {
            "local": Ledger(JobLayout.at(str(Path(tmp) / "job"))),
            "object": Ledger(
                JobLayout.at(f"{args.object_url}/bench-ledger-{os.getpid()}-{time.time_ns()}"),
                sync_every_s=args.sync_every_s,
            ),
        }
        times: dict[str, list[float]] = {k: [] for k in ledgers}
        for _ in range(rounds):
            for kind, ledger in ledgers.items():
                times[kind] += event_latencies_us(ledger, per_round)
        for ledger in ledgers.values():
            ledger.close()
    out: dict[str, object] = {}
    for kind, ts in times.items():
        ts.sort()
        out[kind] = {
            "median_us": statistics.median(ts),
            "p99_us": ts[int(0.99 * len(ts))],
            "max_us": ts[-1],
            "events": len(ts),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=1500, help="bare/instrumented step pairs")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--batch", type=int, default=1024, help="the demo config's batch size")
    p.add_argument("--rows", type=int, default=80_000, help="generated rows (64+ batches)")
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch intra-op threads (0: torch's default, as the trainer runs)",
    )
    p.add_argument("--events", type=int, default=20_000, help="events for the tight loop")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ledger.json"))
    p.add_argument("--events-only", action="store_true", help="local vs object storage only")
    p.add_argument("--object-url", default="memory://bench", help="object storage (--events-only)")
    p.add_argument("--sync-every-s", type=float, default=0.1, help="upload interval there")
    args = p.parse_args()
    if args.events_only:
        result = events_only(args)
        print("| ledger | median / p99 / worst event on the writing thread | events |")
        print("|---|---|---|")
        for kind, r in result.items():
            assert isinstance(r, dict)
            print(
                f"| {kind} | {r['median_us']:.1f} / {r['p99_us']:.1f} / {r['max_us']:.0f} us "
                f"| {r['events']} |"
            )
        print(f"(sync every {args.sync_every_s} s, load avg {os.getloadavg()[0]:.1f})")
        return

    bare: list[float] = []
    instrumented: list[float] = []
    inside: list[float] = []
    ratios: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-ledger-") as tmp:
        step = trainer_step(Path(tmp), args.batch, args.rows, args.threads)
        ledger = Ledger(JobLayout.at(str(Path(tmp) / "job")))
        for i in range(args.warmup):
            timed_step(step, ledger if i % 2 else None, i)
        for pair in range(args.pairs):
            first_bare = pair % 4 in (0, 3)  # B I, I B, I B, B I, ...
            times = {}
            for use_ledger in (False, True) if first_bare else (True, False):
                wall, in_ledger = timed_step(step, ledger if use_ledger else None, pair)
                times[use_ledger] = wall
                if use_ledger:
                    instrumented.append(wall)
                    inside.append(in_ledger)
                else:
                    bare.append(wall)
            ratios.append(times[True] / times[False])
        span_us = event_cost_us(ledger, args.events)
        ledger.close()
    bare_ms, instr_ms = statistics.median(bare) * 1e3, statistics.median(instrumented) * 1e3
    inside_us = statistics.median(inside) * 1e6
    result = {
        "median_step_bare_ms": bare_ms,
        "median_step_instrumented_ms": instr_ms,
        "overhead_pct": 100.0 * (statistics.median(ratios) - 1.0),
        "overhead_pct_ci95": _bootstrap_ci(ratios),
        "overhead_pct_pooled": 100.0 * (instr_ms / bare_ms - 1.0),
        "in_situ_ledger_us": inside_us,
        "in_situ_ledger_p90_us": sorted(inside)[int(0.9 * len(inside))] * 1e6,
        "in_situ_overhead_pct": 100.0 * inside_us * 1e-3 / bare_ms,
        "tight_loop_span_us": span_us,
        "steps_per_mode": len(bare),
        "config": {
            **vars(args),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "loadavg_1m": os.getloadavg()[0],
        },
    }
    ci = result["overhead_pct_ci95"]
    rows = [
        ("median step, bare / instrumented", f"{bare_ms:.3f} / {instr_ms:.3f} ms"),
        (
            "overhead, paired steps (95% CI) / pooled medians",
            f"{result['overhead_pct']:+.2f} % [{ci[0]:+.2f}, {ci[1]:+.2f}] / "
            f"{result['overhead_pct_pooled']:+.2f} %",
        ),
        (
            "time inside the ledger per step, median / p90",
            f"{inside_us:.1f} / {result['in_situ_ledger_p90_us']:.1f} us",
        ),
        (
            "in-situ overhead = ledger time / median bare step",
            f"{result['in_situ_overhead_pct']:.3f} %",
        ),
        ("one span in a tight loop (hot caches)", f"{span_us:.1f} us"),
        ("steps per mode, load avg", f"{len(bare)}, {os.getloadavg()[0]:.1f}"),
    ]
    print("| metric | value |\n|---|---|")
    print("\n".join(f"| {k} | {v} |" for k, v in rows))
    save_json(result, args.out)


if __name__ == "__main__":
    main()
