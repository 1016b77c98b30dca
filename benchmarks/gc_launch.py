"""``python benchmarks/gc_launch.py policy|default [launcher flags]``: the trainer's launcher
(``python -m trainer.launch``) with the garbage collector's policy of trainer/gc_policy.py
(``policy``), or with it switched off (``default``: Python's own, which collects whenever
allocations call for it), for benchmarks/bench_gc.py.

With ``BENCH_GC_LOG`` set to a folder, every full collection of the launcher and of the ranks it
forks (they inherit the callback) is one line in ``<folder>/<pid>.txt``: its wall-clock start
and its duration in seconds.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from trainer import gc_policy, launch  # noqa: E402

FULL = 2  # the oldest generation: a collection of it walks everything not frozen


def record_full_collections(folder: str) -> None:
    started: dict[str, float] = {}

    def callback(phase: str, info: dict[str, int]) -> None:
        if info["generation"] != FULL:
            return
        if phase == "start":
            started["wall"], started["clock"] = time.time(), time.perf_counter()
            return
        took = time.perf_counter() - started["clock"]
        with open(os.path.join(folder, f"{os.getpid()}.txt"), "a") as fh:
            fh.write(f"{started['wall']:.6f} {took:.6f}\n")

    gc.callbacks.append(callback)


def main(argv: list[str]) -> int:
    mode, flags = argv[0], argv[1:]
    if mode not in ("policy", "default"):
        raise SystemExit(f"first argument: policy or default, not {mode!r}")
    if mode == "default":
        gc_policy.pause = lambda: None
        gc_policy.settle = lambda: None
    if folder := os.environ.get("BENCH_GC_LOG"):
        record_full_collections(folder)
    return launch.main(flags)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
