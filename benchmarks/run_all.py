"""`make bench`: run every benchmark one after another (never in parallel: they time the
machine) and collect their markdown tables into benchmarks/results/summary.md."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BENCHMARKS = [
    "bench_throughput.py",
    "bench_ledger.py",
    "bench_checkpoint.py",
    "bench_startup.py",
    "bench_gc.py",
    "bench_attention.py",
    "bench_towers.py",
    "bench_publish.py",
    "bench_recovery.py",
    "bench_relaunch_nodes.py",
    "bench_standby_park.py",
    "bench_memory_tier.py",
]
# Not here, run on their own: bench_ett.py (`make bench-ett`, ~15 min), bench_hosts.py (a
# Prefect stack), bench_incremental.py (writes several 5 GB checkpoints to local disk).


def main() -> int:
    results = HERE / "results"
    results.mkdir(exist_ok=True)
    sections, failed = [], []
    for name in BENCHMARKS:
        script = HERE / name
        if not script.exists():
            continue
        print(f"== {name}", flush=True)
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True
        )
        print(proc.stdout[-4000:], proc.stderr[-2000:] if proc.returncode else "", flush=True)
        elapsed = time.perf_counter() - start
        if proc.returncode:
            failed.append(name)
        tables = "\n".join(line for line in proc.stdout.splitlines() if line.startswith("|"))
        sections.append(f"## {name} ({elapsed:.0f} s, exit {proc.returncode})\n\n{tables}\n")
    (results / "summary.md").write_text("# Benchmark results\n\n" + "\n".join(sections))
    print(f"wrote {results / 'summary.md'}; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
