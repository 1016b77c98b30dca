"""Model FLOPs Utilization (MFU) beside ETT%: the two halves of lost compute.

ETT% says how much of a job's wall time went to effective training steps; MFU says how
much of the devices' peak those steps used. Their product, ETT% x MFU, is the share of the
peak compute over the whole wall time that became useful model FLOPs:

    MFU       = F / (world x peak x T_eff)
    ETT x MFU = F / (world x peak x W)        (= ETT% / 100 x MFU, exactly)

F is the model FLOPs of the effective step executions of every rank (the last execution of
each step number, as ETT counts them), T_eff the effective_training seconds and W the wall
time of the ETT report. The trainer records the FLOPs of each step at its real jagged
lengths as the ``flops`` attr of its train_step span (trainer/flops.py) and, per attempt
and rank, a ``model_flops`` mark naming the device, matmul dtype, threads and world size.

Peaks: a table of GPU datasheet peaks (dense, no sparsity) by name and dtype; on a CPU, a
measured matmul peak (best of a few square matmuls at the trainer's thread count), measured
once per CPU model, dtype and thread count and cached in ``$XDG_CACHE_HOME/ett-pipeline``,
never on the trainer's startup path (the report or the benchmark measures it). A peak
measured on a shared machine is low, so such an MFU is an upper bound.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import re
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from infra.accounting.ledger_format import Event, Mark, Span
from infra.accounting.ledger_read import read_events
from infra.accounting.records import Bucket, EttReport
from infra.job_layout import JobLayout

log = logging.getLogger(__name__)

T = 1e12
# Datasheet peaks in FLOP/s, dense (NVIDIA quotes tf32/bf16 "with sparsity": half of that).
# First match wins: the more specific names come first.
GPU_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"H200 NVL|H100 NVL", {"fp32": 60 * T, "tf32": 417.5 * T, "bf16": 835.5 * T}),
    (r"H100 PCIe", {"fp32": 51 * T, "tf32": 378 * T, "bf16": 756 * T}),
    (r"H200|H100", {"fp32": 67 * T, "tf32": 494.7 * T, "bf16": 989.4 * T}),
    (r"A100", {"fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T}),
    (r"L40S", {"fp32": 91.6 * T, "tf32": 183 * T, "bf16": 362 * T}),
    (r"L40\b", {"fp32": 90.5 * T, "tf32": 90.5 * T, "bf16": 181 * T}),
    (r"L4\b", {"fp32": 30.3 * T, "tf32": 60 * T, "bf16": 121 * T}),
    (r"V100", {"fp32": 15.7 * T}),
)


def gpu_peak(device_name: str, dtype: str) -> float | None:
    """The datasheet peak of a GPU (as torch.cuda.get_device_name names it); None if unknown."""
    for pattern, peaks in GPU_PEAKS:
        if re.search(pattern, device_name):
            return peaks.get(dtype) or None
    return None


def cpu_model() -> str:
    """The CPU's model name (what a measured peak is cached under)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_file() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(root) / "ett-pipeline" / "peak_flops.json"


def _peak_key(model: str, dtype: str, threads: int) -> str:
    return f"{model}|{dtype}|threads={threads}"


def measure_cpu_peak(threads: int, dtype: str = "fp32", size: int = 1024, reps: int = 8) -> float:
    """Best FLOP/s of ``reps`` square matmuls at ``threads`` intra-op threads."""
    import torch

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(size, size, dtype=torch_dtype)
        b = torch.randn(size, size, dtype=torch_dtype)
        torch.mm(a, b)  # warm-up
        best = math.inf
        for _ in range(reps):
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return 2 * size**3 / best


def cpu_peak(threads: int, dtype: str = "fp32", model: str | None = None) -> float | None:
    """The cached measured peak of this machine's CPU (measured now if missing). For another
    CPU model (a ledger written elsewhere): only what the cache holds, else None."""
    here = cpu_model()
    model = model or here
    path = _cache_file()
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    key = _peak_key(model, dtype, threads)
    if key in cache:
        return float(cache[key])
    if model != here:
        return None
    cache[key] = measure_cpu_peak(threads, dtype)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cache, indent=2))
        tmp.replace(path)
    except OSError as exc:  # a cache: measuring again next time is fine
        log.warning("could not cache the measured CPU peak in %s: %s", path, exc)
    return float(cache[key])


def peak_for(attrs: dict[str, Any]) -> tuple[float | None, str]:
    """(peak FLOP/s of one device, where it comes from) for a ``model_flops`` mark's attrs."""
    dtype, name = str(attrs.get("dtype", "fp32")), str(attrs.get("device_name", "?"))
    if attrs.get("device") == "cuda":
        return gpu_peak(name, dtype), f"datasheet {name} {dtype}"
    threads = int(attrs.get("threads", 1))
    return cpu_peak(threads, dtype, model=name), f"measured matmul {name} {dtype} x{threads}"


@dataclass(frozen=True)
class MfuReport:
    """MFU of a job and what it multiplies with ETT% into (percentages of peak)."""

    model_flops: float  # F: effective step executions, all ranks
    effective_s: float  # T_eff (rank 0, as partitioned by the ETT report)
    wall_s: float  # W
    world_size: int
    peak_flops: float  # one device (the last attempt's)
    peak_source: str
    achieved_flops: float  # per device, over the effective steps
    mfu_pct: float
    ett_pct: float
    ett_x_mfu_pct: float

    def to_metrics(self) -> dict[str, float]:
        """Flat numbers for MLflow (the tracking code adds its prefix)."""
        return {
            k: float(v)
            for k, v in asdict(self).items()
            if isinstance(v, int | float) and math.isfinite(v)
        }


def _effective_steps(events: list[Event]) -> list[Event]:
    """Per rank, the last execution of each step number (ordered by attempt, then start)."""
    steps = sorted(
        (e for e in events if e.name == Span.TRAIN_STEP and "flops" in e.attrs),
        key=lambda e: (e.attempt, e.start),
    )
    last: dict[tuple[int, int | None], Event] = {}
    for e in steps:
        last[(e.rank, e.step)] = e
    return list(last.values())


def mfu_report(events: list[Event], report: EttReport) -> MfuReport | None:
    """MFU and ETT x MFU from a job's ledger events and its ETT report; None when the ledger
    has no FLOPs (written before they were recorded) or the device's peak is unknown."""
    steps = _effective_steps(events)
    marks: dict[int, dict[str, Any]] = {}
    for e in sorted(events, key=lambda e: e.start):
        if e.name == Mark.MODEL_FLOPS and e.rank == 0:
            marks[e.attempt] = e.attrs
    effective = report.buckets.get(Bucket.EFFECTIVE_TRAINING, 0.0)
    if not steps or not marks or effective <= 0:
        return None
    peaks = {a: peak_for(attrs) for a, attrs in marks.items()}
    if any(p is None for p, _ in peaks.values()):
        unknown = sorted({src for p, src in peaks.values() if p is None})
        log.warning("no peak FLOP/s known for %s: MFU not reported", ", ".join(unknown))
        return None
    # Each execution counts against its own attempt's devices (attempts may differ).
    latest = max(marks)
    used: dict[int, float] = defaultdict(float)
    total = 0.0
    for e in steps:
        attempt = e.attempt if e.attempt in marks else latest
        flops = float(e.attrs["flops"])
        total += flops
        used[attempt] += flops / (peaks[attempt][0] * int(marks[attempt].get("world_size", 1)))
    mfu = sum(used.values()) / effective
    world = int(marks[latest].get("world_size", 1))
    peak, source = peaks[latest]
    return MfuReport(
        model_flops=total,
        effective_s=effective,
        wall_s=report.wall_s,
        world_size=world,
        peak_flops=peak,
        peak_source=source,
        achieved_flops=mfu * peak,
        mfu_pct=100.0 * mfu,
        ett_pct=report.ett_pct,
        ett_x_mfu_pct=report.ett_pct * mfu,
    )


def mfu_for_job(layout: JobLayout, report: EttReport) -> MfuReport | None:
    """``mfu_report`` of a job's ledger (the report is the job's ETT report)."""
    return mfu_report(read_events(layout), report)


def mfu_metrics(layout: JobLayout, report: EttReport) -> dict[str, float]:
    """MFU metrics of a job for MLflow (empty when there is no MFU to report)."""
    mfu = mfu_for_job(layout, report)
    return {} if mfu is None else mfu.to_metrics()
