"""Jagged attention, forward + backward: length-bucketed CPU path vs padded SDPA reference.

Workload: a history tower's self-attention over a batch of user histories with
Zipf-distributed lengths (P(L) ~ L**-a on 1..max_len, a solved so the mean is --mean-len;
defaults: batch 256, max 512, mean 32; a seeded batch whose sample mean is within 5% of it),
2 heads x 32 dims, fp32, causal and not.

Time: one fwd+bwd (output, then backward of <out, g> for a fixed random g) per rep; the
paths alternate within each rep (ABBA order) so drift and other load hit both alike; we
report medians of wall time and of process CPU time (less sensitive to other processes on
a shared machine). Torch uses --threads intra-op threads (default 1: the trainer runs one
process per core under torchrun).

Peak memory: a fresh subprocess per (path, causal) builds the inputs, runs one warm-up
fwd+bwd, resets the kernel's peak-RSS counter (writes 5 to /proc/self/clear_refs), runs one
fwd+bwd and reports VmHWM - VmRSS before the run: the resident memory the step added at
its peak (activations saved for backward, temporaries, gradients). The subprocess runs with
MALLOC_MMAP_THRESHOLD_=65536 so glibc returns freed large blocks to the OS instead of
keeping them in its heap, where the warm-up's freed memory would hide the measured peak.

With CUDA: the same batch on the GPU in bf16, the Triton kernels against padded SDPA,
the bucketed path and torch.nested jagged SDPA (non-causal only: nested SDPA has no causal
mode), each checked against the reference first; time via cuda synchronize, peak via
torch.cuda.max_memory_allocated. ``--gpu-only`` runs just that (make gpu-check);
``--dry-run`` runs the same device benchmark on a tiny batch on the CPU (Triton too when
TRITON_INTERPRET=1 is set), to check the script without a GPU.

    .venv/bin/python benchmarks/bench_attention.py [--reps 5 --threads 1] [--gpu-only|--dry-run]

Prints a markdown table and writes benchmarks/results/attention.json.
Targets: cpu path >= 3x faster than the reference and <= 1/5 of its peak memory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.save import save_json  # noqa: E402
from trainer.attention import jagged_attention  # noqa: E402
from trainer.attention.cpu import plan_buckets  # noqa: E402

CPU_PATHS = ("cpu", "reference")


def zipf_exponent(max_len: int, mean: float) -> float:
    """Exponent a of P(L) ~ L**-a on 1..max_len whose mean is ``mean`` (bisection)."""
    support = np.arange(1, max_len + 1, dtype=np.float64)
    lo, hi = 0.0, 5.0
    for _ in range(100):
        a = (lo + hi) / 2
        p = support**-a
        if (p * support).sum() / p.sum() > mean:
            lo = a
        else:
            hi = a
    return (lo + hi) / 2


def zipf_lengths(batch: int, max_len: int, mean: float, seed: int) -> list[int]:
    """A batch of Zipf lengths whose *sample* mean is within 5% of ``mean``.

    The tail is heavy (a ~ 1.3), so one batch of 256 draws can have a mean of 25 or 45; we
    keep drawing seeded batches until one is representative (deterministic per seed).
    """
    a = zipf_exponent(max_len, mean)
    support = np.arange(1, max_len + 1)
    p = support.astype(np.float64) ** -a
    rng = np.random.default_rng(seed)
    for _ in range(10_000):
        lengths = rng.choice(support, size=batch, p=p / p.sum())
        if abs(lengths.mean() - mean) <= 0.05 * mean:
            return lengths.tolist()
    raise RuntimeError(f"no batch with mean ~{mean} in 10000 draws")


def make_inputs(args, device: str = "cpu", dtype: torch.dtype = torch.float32):
    lengths = zipf_lengths(args.batch, args.max_len, args.mean_len, args.seed)
    offsets = torch.tensor([0, *lengths]).cumsum(0).to(device)
    total = int(offsets[-1])
    gen = torch.Generator().manual_seed(args.seed)
    q, k, v, g = (
        torch.randn(total, args.heads, args.dim, generator=gen).to(device, dtype) for _ in range(4)
    )
    return lengths, q, k, v, offsets, g


def nested_attention(q, k, v, offsets, causal: bool) -> torch.Tensor:
    """torch.nested jagged-layout SDPA on the same jagged rows (non-causal only)."""

    def nested(x: torch.Tensor) -> torch.Tensor:  # [total, heads, dim] -> [B, heads, j, dim]
        return torch.nested.nested_tensor_from_jagged(x, offsets).transpose(1, 2)

    if causal:
        raise ValueError("torch.nested SDPA has no causal mode")
    return F.scaled_dot_product_attention(nested(q), nested(k), nested(v)).transpose(1, 2).values()


def fwd_bwd(impl: str, causal: bool, q, k, v, offsets, g) -> torch.Tensor:
    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    if impl == "nested":
        out = nested_attention(q, k, v, offsets, causal)
    else:
        out = jagged_attention(q, k, v, offsets, causal=causal, impl=impl)
    (out * g).sum().backward()
    return out.detach()


def score_elements(lengths: list[int], heads: int) -> dict[str, int]:
    """Attention-matrix entries computed: padded batch, bucketed, and the jagged ideal."""
    buckets = plan_buckets(lengths)
    return {
        "reference": len(lengths) * max(lengths) ** 2 * heads,
        "cpu": sum(len(b.seqs) * b.max_len**2 for b in buckets) * heads,
        "ideal": sum(n * n for n in lengths) * heads,
        "cpu_buckets": len(buckets),
    }


# ------------------------------------------------------------------ CPU time


def time_cpu(args, inputs) -> dict[tuple[str, bool], dict[str, float]]:
    _, q, k, v, offsets, g = inputs
    results = {}
    for causal in (False, True):
        samples: dict[str, list[tuple[float, float]]] = {p: [] for p in CPU_PATHS}
        for impl in CPU_PATHS:  # warm-up
            fwd_bwd(impl, causal, q, k, v, offsets, g)
        for rep in range(args.reps):
            for impl in CPU_PATHS if rep % 2 == 0 else CPU_PATHS[::-1]:
                wall, cpu = time.perf_counter(), time.process_time()
                fwd_bwd(impl, causal, q, k, v, offsets, g)
                samples[impl].append((time.perf_counter() - wall, time.process_time() - cpu))
        for impl, s in samples.items():
            results[(impl, causal)] = {
                "wall_ms": 1e3 * statistics.median(w for w, _ in s),
                "cpu_ms": 1e3 * statistics.median(c for _, c in s),
                "wall_ms_all": [round(1e3 * w, 1) for w, _ in s],
            }
    return results


def _status_kib(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", status).group(1))


def measure_memory_here(args) -> dict[str, float]:
    """In a fresh process: resident-memory peak added by one fwd+bwd (after a warm-up)."""
    _, q, k, v, offsets, g = make_inputs(args)
    causal = bool(args.causal)
    fwd_bwd(args.measure_memory, causal, q, k, v, offsets, g)
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    fwd_bwd(args.measure_memory, causal, q, k, v, offsets, g)
    return {"peak_mib": (_status_kib("VmHWM") - before) / 1024, "baseline_mib": before / 1024}


def measure_memory(args, impl: str, causal: bool) -> dict[str, float] | None:
    if not Path("/proc/self/clear_refs").exists():
        return None
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": pythonpath}
    cmd = [sys.executable, __file__, "--measure-memory", impl, "--causal", str(int(causal))]
    cmd += [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in _WORKLOAD_ARGS]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ GPU


DEVICE_PATHS = ("triton", "reference", "cpu", "nested")


def bench_device(args, device: str, dtype: torch.dtype, paths=DEVICE_PATHS) -> list[dict]:
    """fwd+bwd of each path on ``device``: median wall time, peak memory (CUDA), and the
    largest difference of its output from the reference's (checked before timing)."""
    lengths, q, k, v, offsets, g = make_inputs(args, device, dtype)
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = []
    for causal in (False, True):
        ref = fwd_bwd("reference", causal, q, k, v, offsets, g).float()
        for impl in paths:
            if impl == "nested" and causal:
                continue
            diff = (fwd_bwd(impl, causal, q, k, v, offsets, g).float() - ref).abs().max().item()
            sync()
            base = torch.cuda.memory_allocated() if cuda else 0
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(max(args.reps, 10) if cuda else args.reps):
                t = time.perf_counter()
                fwd_bwd(impl, causal, q, k, v, offsets, g)
                sync()
                times.append(time.perf_counter() - t)
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None
            rows.append(
                {
                    "path": impl,
                    "causal": causal,
                    "device": f"{device} {str(dtype).removeprefix('torch.')}",
                    "wall_ms": 1e3 * statistics.median(times),
                    "peak_mib": peak,
                    "max_abs_diff_vs_reference": diff,
                }
            )
    return rows


def bench_gpu(args) -> list[dict]:
    return bench_device(args, "cuda", torch.bfloat16)


def print_device_table(rows: list[dict]) -> None:
    print("| path | device | causal | wall ms | peak MiB | vs reference | max abs diff |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ref = _row(rows, "reference", r["causal"])
        peak = "n/a" if r["peak_mib"] is None else f"{r['peak_mib']:.1f}"
        print(
            f"| {r['path']} | {r['device']} | {r['causal']} | {r['wall_ms']:.2f} | {peak} "
            f"| {ref['wall_ms'] / r['wall_ms']:.1f}x | {r['max_abs_diff_vs_reference']:.2e} |"
        )


def run_device_only(args, device: str, dtype: torch.dtype, paths) -> None:
    """--gpu-only / --dry-run: the device benchmark alone, its table and its JSON."""
    rows = bench_device(args, device, dtype, paths)
    print_device_table(rows)
    config = {k: getattr(args, k) for k in (*_WORKLOAD_ARGS, "reps")}
    save_json({"config": config, "rows": rows}, args.out)


# ------------------------------------------------------------------ main

_WORKLOAD_ARGS = ("batch", "max_len", "mean_len", "heads", "dim", "seed", "threads")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--mean-len", type=float, default=32.0)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/attention.json")
    ap.add_argument("--gpu-only", action="store_true", help="only the CUDA benchmark")
    ap.add_argument("--dry-run", action="store_true", help="tiny batch, CPU, no timing claims")
    ap.add_argument("--measure-memory", choices=CPU_PATHS, help=argparse.SUPPRESS)
    ap.add_argument("--causal", type=int, default=0, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _row(rows: list[dict], path: str, causal: bool) -> dict:
    return next(r for r in rows if r["path"] == path and r["causal"] == causal)


def _ratio(num: float | None, den: float | None) -> str:
    return f"{num / den:.3f}x" if num and den else "n/a"


def print_table(args, stats: dict, rows: list[dict], gpu_rows: list[dict], load) -> None:
    print(
        f"\nJagged attention fwd+bwd: batch {args.batch}, Zipf lengths "
        f"(a={stats['zipf_exponent']:.3f}, mean {stats['mean']:.1f}, max {stats['max']}, "
        f"{stats['total_rows']} rows), {args.heads} heads x {args.dim} dims, "
        f"torch threads {args.threads}, median of {args.reps} reps; "
        f"load avg {load[0][0]:.1f} -> {load[1][0]:.1f}\n"
    )
    print("| path | device | causal | wall ms | CPU ms | peak MiB | speedup wall / CPU | memory |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ref = _row(rows, "reference", r["causal"])
        mem = "n/a" if r["peak_mib"] is None else f"{r['peak_mib']:.1f}"
        speed = f"{ref['wall_ms'] / r['wall_ms']:.1f}x / {ref['cpu_ms'] / r['cpu_ms']:.1f}x"
        print(
            f"| {r['path']} | {r['device']} | {r['causal']} | {r['wall_ms']:.1f} "
            f"| {r['cpu_ms']:.1f} | {mem} | {speed} | {_ratio(r['peak_mib'], ref['peak_mib'])} |"
        )
    for r in gpu_rows:
        ref = _row(gpu_rows, "reference", r["causal"])
        print(
            f"| {r['path']} | {r['device']} | {r['causal']} | {r['wall_ms']:.2f} | - "
            f"| {r['peak_mib']:.1f} | {ref['wall_ms'] / r['wall_ms']:.1f}x "
            f"| {_ratio(r['peak_mib'], ref['peak_mib'])} |"
        )


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.measure_memory:
        print(json.dumps(measure_memory_here(args)))
        return
    if args.dry_run:
        try:
            from trainer.attention.triton_kernel import INTERPRETED
        except ImportError:  # no triton: the other paths still run
            INTERPRETED = False
        args.batch, args.max_len, args.mean_len, args.reps = 12, 48, 8.0, 1
        paths = DEVICE_PATHS if INTERPRETED else DEVICE_PATHS[1:]
        run_device_only(args, "cpu", torch.float32, paths)
        return
    if args.gpu_only:
        if not torch.cuda.is_available():
            raise SystemExit("--gpu-only needs a CUDA device")
        run_device_only(args, "cuda", torch.bfloat16, DEVICE_PATHS)
        return

    inputs = make_inputs(args)
    lengths = inputs[0]
    for causal in (False, True):  # the two paths must agree on this very batch
        diff = fwd_bwd("cpu", causal, *inputs[1:]) - fwd_bwd("reference", causal, *inputs[1:])
        assert diff.abs().max().item() < 1e-4, diff.abs().max().item()
    load_before = os.getloadavg()
    timing = time_cpu(args, inputs)
    rows = []
    for causal in (False, True):
        for impl in CPU_PATHS:
            mem = measure_memory(args, impl, causal)
            peak = None if mem is None else mem["peak_mib"]
            rows.append(
                {
                    "path": impl,
                    "causal": causal,
                    "device": "cpu fp32",
                    **timing[(impl, causal)],
                    "peak_mib": peak,
                }
            )
    load = (load_before, os.getloadavg())
    ratios = {}
    for causal in (False, True):
        cpu, ref = _row(rows, "cpu", causal), _row(rows, "reference", causal)
        ratios["causal" if causal else "noncausal"] = {
            "speedup_wall": ref["wall_ms"] / cpu["wall_ms"],
            "speedup_cpu_time": ref["cpu_ms"] / cpu["cpu_ms"],
            "memory_fraction": cpu["peak_mib"] / ref["peak_mib"] if ref["peak_mib"] else None,
        }
    gpu_rows = bench_gpu(args) if torch.cuda.is_available() else []

    stats = {
        "batch": len(lengths),
        "total_rows": sum(lengths),
        "mean": sum(lengths) / len(lengths),
        "max": max(lengths),
        "zipf_exponent": zipf_exponent(args.max_len, args.mean_len),
    }
    elements = score_elements(lengths, args.heads)
    print_table(args, stats, rows, gpu_rows, load)
    print(
        f"\nattention-score entries: padded reference {elements['reference']:,}, "
        f"cpu path ({elements['cpu_buckets']} buckets) {elements['cpu']:,}, "
        f"jagged ideal {elements['ideal']:,}"
    )

    report = {
        "benchmark": "jagged_attention fwd+bwd",
        "config": {k: getattr(args, k) for k in (*_WORKLOAD_ARGS, "reps")},
        "lengths": stats,
        "score_elements": elements,
        "rows": rows,
        "ratios": ratios,
        "gpu_rows": gpu_rows,
        "loadavg_before_after": load,
        "memory_method": "fresh subprocess per path; VmHWM - VmRSS around one fwd+bwd after a "
        "warm-up, HWM reset via /proc/self/clear_refs, MALLOC_MMAP_THRESHOLD_=65536",
        "host": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "cuda": torch.cuda.is_available(),
        },
    }
    save_json(report, args.out)


if __name__ == "__main__":
    main()
