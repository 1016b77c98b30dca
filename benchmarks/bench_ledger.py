"""Ledger overhead per training step: instrumented vs bare steps, interleaved in one run.

A "step" is a small MLP forward/backward/optimizer step on CPU (~5-20 ms). Blocks of steps
alternate between bare and instrumented (one ``ledger.span("train_step")`` per step, written
and flushed to a local file), in ABBA order so slow drift (thermal, other load) cancels. The
overhead is the median over adjacent block pairs of (instrumented / bare medians - 1); we also
report the pooled medians and the raw cost of one event in a tight loop, which is the more
precise number on a shared machine (the step-time difference is within the step's noise).

    .venv/bin/python benchmarks/bench_ledger.py [--blocks 100 --steps 6 --events 20000]

Prints a markdown table and writes benchmarks/results/ledger.json. Target: < 1% per step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from infra.ledger import Ledger  # noqa: E402


def make_step(batch: int, width: int, seed: int = 0) -> Callable[[], None]:
    """A closure running one fwd/bwd/Adam step of a 3-layer MLP on fixed random data."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, 1),
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(batch, width), torch.randn(batch, 1)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()

    return step


def run_block(
    step: Callable[[], None], n: int, ledger: Ledger | None, first: int
) -> list[tuple[float, float]]:
    """Per-step (wall, thread CPU) seconds; with a ledger each step is one train_step span.

    CPU time of this thread (torch runs single-threaded here) is barely affected by other
    processes on a shared machine, so it is the steadier of the two measures.
    """
    times = []
    for i in range(n):
        w0, c0 = time.perf_counter(), time.thread_time()
        if ledger is None:
            step()
        else:
            with ledger.span("train_step", step=first + i):
                step()
        times.append((time.perf_counter() - w0, time.thread_time() - c0))
    return times


def _medians(times: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def _bootstrap_ci(ratios: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval (in %) of the median paired ratio: is the overhead noise?"""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(n))
    return 100.0 * (meds[int(0.025 * n)] - 1.0), 100.0 * (meds[int(0.975 * n)] - 1.0)


def _fmt_ci(ci: tuple[float, float]) -> str:
    return f"[{ci[0]:+.2f}, {ci[1]:+.2f}]"


def event_cost_us(ledger: Ledger, n: int) -> dict[str, float]:
    """Raw cost of writing one event (span / mark) in a tight loop, in microseconds."""
    t0 = time.perf_counter()
    for i in range(n):
        with ledger.span("train_step", step=i):
            pass
    span_us = (time.perf_counter() - t0) / n * 1e6
    t0 = time.perf_counter()
    for i in range(n):
        ledger.mark("checkpoint_committed", step=i)
    return {"span_us": span_us, "mark_us": (time.perf_counter() - t0) / n * 1e6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=100, help="blocks per mode (ABBA order)")
    p.add_argument("--steps", type=int, default=6, help="steps per block")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--events", type=int, default=20_000, help="events for the raw-cost loop")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ledger.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    step = make_step(args.batch, args.width)
    samples: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    ratios: list[tuple[float, float]] = []  # instrumented / bare block medians, per pair
    with tempfile.TemporaryDirectory(prefix="bench-ledger-") as tmp:
        ledger = Ledger(str(Path(tmp) / "job"))
        run_block(step, args.warmup, ledger, 0)
        n = 0
        for block in range(args.blocks):
            order = (None, ledger) if block % 4 in (0, 3) else (ledger, None)
            med: dict[bool, tuple[float, float]] = {}
            for led in order:
                times = run_block(step, args.steps, led, n)
                samples[led is not None].extend(times)
                med[led is not None] = _medians(times)
                n += args.steps
            ratios.append((med[True][0] / med[False][0], med[True][1] / med[False][1]))
        cost = event_cost_us(ledger, args.events)
        ledger.close()
    (wall_b, cpu_b), (wall_i, cpu_i) = _medians(samples[False]), _medians(samples[True])
    result = {
        "median_step_bare_ms": wall_b * 1e3,
        "median_step_instrumented_ms": wall_i * 1e3,
        "overhead_pct": 100.0 * (statistics.median(r[0] for r in ratios) - 1.0),
        "overhead_pct_pooled": 100.0 * (wall_i / wall_b - 1.0),
        "median_step_cpu_bare_ms": cpu_b * 1e3,
        "median_step_cpu_instrumented_ms": cpu_i * 1e3,
        "overhead_pct_ci95": _bootstrap_ci([r[0] for r in ratios]),
        "overhead_cpu_pct": 100.0 * (statistics.median(r[1] for r in ratios) - 1.0),
        "overhead_cpu_pct_ci95": _bootstrap_ci([r[1] for r in ratios]),
        "span_cost_us": cost["span_us"],
        "mark_cost_us": cost["mark_us"],
        "overhead_pct_from_event_cost": 100.0 * cost["span_us"] * 1e-6 / wall_b,
        "steps_per_mode": len(samples[False]),
        "config": {**vars(args), "torch": torch.__version__, "python": platform.python_version(),
                   "machine": platform.machine(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                   "loadavg_1m": os.getloadavg()[0]},
    }
    rows = [
        ("median step wall, bare / instrumented",
         f"{result['median_step_bare_ms']:.3f} / {result['median_step_instrumented_ms']:.3f} ms"),
        ("overhead, wall (paired blocks, 95% CI / pooled)",
         f"{result['overhead_pct']:+.2f} % {_fmt_ci(result['overhead_pct_ci95'])} / "
         f"{result['overhead_pct_pooled']:+.2f} %"),
        ("median step CPU, bare / instrumented",
         f"{result['median_step_cpu_bare_ms']:.3f} / "
         f"{result['median_step_cpu_instrumented_ms']:.3f} ms"),
        ("overhead, CPU (paired blocks, 95% CI)",
         f"{result['overhead_cpu_pct']:+.2f} % {_fmt_ci(result['overhead_cpu_pct_ci95'])}"),
        ("cost per span / mark event", f"{cost['span_us']:.1f} / {cost['mark_us']:.1f} us"),
        ("overhead = span cost / median step", f"{result['overhead_pct_from_event_cost']:.3f} %"),
        ("steps per mode, load avg", f"{len(samples[False])}, {os.getloadavg()[0]:.1f}"),
    ]
    print("| metric | value |\n|---|---|")
    print("\n".join(f"| {k} | {v} |" for k, v in rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
