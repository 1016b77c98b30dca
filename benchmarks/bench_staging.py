"""Checkpoint staging on a GPU: what the training loop pays, against a raw copy of the bytes.

The state: ``--sizes`` MB of fp32 tensors on the device (8 tensors per size). A "step" is
what the loop does next: matmuls, then an in-place update of every state tensor (the
optimizer). Measured per engine, all in one run, medians of ``--reps`` after a first copy
that allocates the buffers (reported apart):

* raw copy: ``copy_(non_blocking)`` of every tensor into preallocated pinned buffers plus a
  synchronize: the time the bytes take to reach the host, and the floor for blocking.
* dcp: DCP's DefaultStager with its CUDA options (pinned + shared memory, async staging on
  its thread, non-blocking copies on its stream); the loop must wait for its future before
  the step changes the weights.
* side_stream snapshot / ordered (trainer/checkpoint/staging.py): the loop waits for
  nothing; the snapshot copies on the device first, "ordered" makes the step wait on the
  device instead.

For each: ``blocking`` (host time from the save call until the loop may start the step),
``added to loop`` (save call to the end of the next step, synchronized, minus a plain
step: what a checkpoint costs the loop), and ``landed`` (save call until the host copy
is complete, with no step after it: what the checkpoint writer waits for).

    .venv/bin/python benchmarks/bench_staging.py [--sizes 256,1024] [--reps 5] [--dry-run]

``--dry-run`` runs the same code on CPU tensors (tiny sizes): no GPU numbers, it only
checks the script. Writes benchmarks/results/staging.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: E402

from benchmarks.save import save_json  # noqa: E402
from trainer.checkpoint.staging import SideStreamCopy  # noqa: E402

PARTS = 8


def make_state(mb: int, device: str) -> dict[str, torch.Tensor]:
    per = mb * 2**20 // 4 // PARTS
    return {f"w{i}": torch.randn(per // 1024, 1024, device=device) for i in range(PARTS)}


class Loop:
    """The next step: a fixed amount of matmul work, then every state tensor changes."""

    def __init__(self, device: str) -> None:
        self.device = device
        size = 2048 if device == "cuda" else 128  # CPU: a dry run, keep it short
        self.x = torch.randn(size, size, device=device) / 64
        self.sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step(self, state: dict[str, torch.Tensor]) -> None:
        y = self.x
        for _ in range(8 if self.device == "cuda" else 1):
            y = torch.tanh(y @ self.x)
        for t in state.values():
            t.add_(y[0, 0] * 1e-6)

    def plain(self, state: dict[str, torch.Tensor], reps: int) -> float:
        times = []
        for _ in range(reps + 1):
            self.sync()
            start = time.perf_counter()
            self.step(state)
            self.sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])


Engine = Callable[[dict[str, torch.Tensor]], tuple[Callable[[], None], Callable[[], None]]]


def raw_copy(device: str) -> Engine:
    """Preallocated pinned buffers, copy and synchronize: blocking == landed."""
    bufs: dict[str, torch.Tensor] = {}
    pin = device == "cuda"

    def save(state: dict[str, torch.Tensor]) -> tuple[Callable[[], None], Callable[[], None]]:
        for k, t in state.items():
            if k not in bufs:
                bufs[k] = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            bufs[k].copy_(t, non_blocking=pin)
        if pin:
            torch.cuda.synchronize()
        return (lambda: None), (lambda: None)

    return save


def dcp_stager(device: str, mb: int) -> tuple[Engine, Callable[[], None]]:
    """DCP's CUDA options; shared memory only where /dev/shm can hold the state (a full
    /dev/shm kills the process with SIGBUS, which no except clause catches)."""
    gpu = device == "cuda"
    shm = gpu and _shm_free() > 2 * mb * 2**20
    stager = DefaultStager(StagingOptions(gpu, shm, True, gpu))

    def save(state: dict[str, torch.Tensor]) -> tuple[Callable[[], None], Callable[[], None]]:
        future = stager.stage(state)
        future.result()  # the loop may change the weights only after this
        return (lambda: None), (lambda: None)

    return save, stager.close


def _shm_free() -> int:
    try:
        return shutil.disk_usage("/dev/shm").free
    except OSError:
        return 0


def side_stream(snapshot: bool) -> tuple[Engine, Callable[[], None]]:
    copy = SideStreamCopy(snapshot=snapshot)

    def save(state: dict[str, torch.Tensor]) -> tuple[Callable[[], None], Callable[[], None]]:
        _, ready = copy.copy(state)
        return (lambda: None), ready

    return save, copy.close


def measure(
    engine: Engine, state: dict[str, torch.Tensor], loop: Loop, reps: int
) -> dict[str, float]:
    """First save apart; then medians of blocking and of save-to-end-of-next-step; and,
    in saves without a step after them, of the time until the copy is on the host."""
    rows: list[tuple[float, float]] = []
    for _ in range(reps + 1):
        loop.sync()
        start = time.perf_counter()
        _, ready = engine(state)
        blocking = time.perf_counter() - start
        loop.step(state)
        loop.sync()
        rows.append((blocking, time.perf_counter() - start))
        ready()
    landed = []
    for _ in range(reps):
        loop.sync()
        start = time.perf_counter()
        engine(state)[1]()
        landed.append(time.perf_counter() - start)
    return {
        "blocking_s": statistics.median(r[0] for r in rows[1:]),
        "save_plus_step_s": statistics.median(r[1] for r in rows[1:]),
        "landed_s": statistics.median(landed),
        "first_blocking_s": rows[0][0],
    }


def run(sizes: list[int], reps: int, device: str) -> list[dict[str, Any]]:
    rows = []
    for mb in sizes:
        state = make_state(mb, device)
        loop = Loop(device)
        loop.plain(state, 2)  # warm-up
        engines: list[tuple[str, Engine, Callable[[], None]]] = [
            ("raw copy", raw_copy(device), lambda: None),
            ("dcp DefaultStager", *dcp_stager(device, mb)),
            ("side_stream snapshot", *side_stream(True)),
            ("side_stream ordered", *side_stream(False)),
        ]
        plain = loop.plain(state, reps)
        for name, engine, close in engines:
            row: dict[str, Any] = {"size_mb": mb, "engine": name, "device": device}
            try:
                result = measure(engine, state, loop, reps)
                row |= {
                    "plain_step_s": plain,
                    "added_to_loop_s": result["save_plus_step_s"] - plain,
                }
                rows.append(row | result)
            except (RuntimeError, OSError) as exc:  # e.g. /dev/shm too small for DCP's buffers
                rows.append(row | {"error": f"{type(exc).__name__}: {exc}"[:500]})
            finally:
                close()
        del state, loop
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        "| size | engine | blocking (ms) | added to loop (ms) | landed on host (ms) "
        "| blocking x raw copy | first save blocking (ms) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['size_mb']} MB | {r['engine']} | failed: {r['error'][:80]} | | | | |")
            continue
        raw = next(x for x in rows if x["size_mb"] == r["size_mb"] and x["engine"] == "raw copy")
        raw_s = raw.get("blocking_s")
        ratio = r["blocking_s"] / raw_s if raw_s else float("nan")
        print(
            f"| {r['size_mb']} MB | {r['engine']} | {1e3 * r['blocking_s']:.2f} "
            f"| {1e3 * r['added_to_loop_s']:.2f} | {1e3 * r['landed_s']:.2f} | {ratio:.3f} "
            f"| {1e3 * r['first_blocking_s']:.2f} |"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256,1024", help="state sizes in MB")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dry-run", action="store_true", help="CPU tensors, tiny sizes")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/staging.json")
    args = parser.parse_args(argv)
    if args.dry_run:
        device, sizes, reps = "cpu", [4], 2
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_staging measures GPU staging: no CUDA device (try --dry-run)")
        device, sizes, reps = "cuda", [int(x) for x in args.sizes.split(",")], args.reps
    rows = run(sizes, reps, device)
    print_table(rows)
    save_json({"device": device, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
