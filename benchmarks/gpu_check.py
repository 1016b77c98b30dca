"""`make gpu-check`: what the first GPU must show, in one prepared script (<= 8 min, 1 GPU).

Parts, each a subprocess with its own time limit (killed with its process group past it):

1. gpu_tests: ``pytest -m gpu``: the Triton kernel against the padded reference and the
   bucketed path on CUDA (fp32, bf16, causal and not), the side-stream staging copy.
   Any skipped test fails the check (a skip means the GPU was not used).
2. nccl_training: the demo model trained by one rank under torchrun on the GPU (default
   group ``cpu:gloo,cuda:nccl``) for ``--steps`` steps with async_staged checkpoints, then
   its ETT report and MFU from the ledger.
3. attention: ``bench_attention.py --gpu-only``: Triton vs padded SDPA, the bucketed path
   and torch.nested jagged SDPA, bf16, forward + backward.
4. staging: ``bench_staging.py``: the loop's cost of a checkpoint copy, side stream vs
   DCP's DefaultStager vs a raw device-to-host copy of the same bytes.

Writes ``benchmarks/results/gpu/<part>.json`` (status, duration, numbers) and
``summary.md``; exits 1 if any part failed. ``--dry-run`` runs every part's CPU-safe form
on the CPU, shrunk, into ``benchmarks/results/gpu-dry-run/``: the GPU tests are only
collected, training uses gloo, Triton runs interpreted; it proves the script, not the GPU.

    .venv/bin/python benchmarks/gpu_check.py [--steps 300] [--dry-run] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from infra import storage  # noqa: E402
from infra.accounting.ett import report_for_job  # noqa: E402
from infra.accounting.ledger_format import Mark  # noqa: E402
from infra.accounting.ledger_read import read_events  # noqa: E402
from infra.accounting.mfu import mfu_for_job  # noqa: E402
from infra.processes import terminate_tree  # noqa: E402
from infra.settings import dump_config, load_config  # noqa: E402
from tasks.attempt import LaunchSpec  # noqa: E402

# Seconds per part: together within the 8-minute budget, with room for start-up.
LIMITS = {"gpu_tests": 120, "nccl_training": 210, "attention": 60, "staging": 60}


def run_part(
    cmd: list[str], timeout: float, env: dict[str, str] | None = None, grep: tuple[str, ...] = ()
) -> dict:
    """Run ``cmd`` in its own process group; its exit code, output tail, duration, and
    which of the ``grep`` strings its output holds. Triton runs compiled unless ``env``
    asks for the interpreter."""
    start = time.perf_counter()
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**base, "PYTHONPATH": str(ROOT), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        terminate_tree(proc.pid, grace_s=5.0, reap=proc.poll)
        out, _ = proc.communicate()
        code = None
    return {
        "exit_code": code,
        "timed_out": code is None,
        "duration_s": round(time.perf_counter() - start, 2),
        "tables": [line for line in out.splitlines() if line.startswith("|")],
        "found": {g: g in out for g in grep},
        "output_tail": out[-4000:],
    }


def gpu_tests(dry: bool, out: Path) -> dict[str, Any]:
    """pytest -m gpu; in a dry run only collected (they need CUDA)."""
    xml = out / "gpu_tests.junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"]
    cmd += ["--collect-only"] if dry else [f"--junitxml={xml}", "-rs"]
    res = run_part([*cmd, "tests"], LIMITS["gpu_tests"])
    if dry:
        collected = [line for line in res["output_tail"].splitlines() if "::" in line]
        res["collected"] = len(collected)
        res["ok"] = res["exit_code"] == 0 and len(collected) > 0
        return res
    import xml.etree.ElementTree as ET

    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if xml.exists():
        suite = ET.parse(xml).getroot()
        suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
        counts = {k: int(suite.get(k, 0)) for k in counts}
    res.update(counts)
    res["ok"] = res["exit_code"] == 0 and counts["tests"] > 0 and counts["skipped"] == 0
    return res


def nccl_training(dry: bool, out: Path, steps: int) -> dict[str, Any]:
    """One rank trains the demo model with async staged checkpoints; ETT and MFU after."""
    work = Path(tempfile.mkdtemp(prefix="ett-gpu-check-"))
    sections: dict[str, Any] = {
        "storage": {"root": f"file://{work}/store"},
        "data": {"url": f"file://{work}/data"},
        "train": {"steps": steps, "eval_every": steps // 3, "log_every": 50},
        "checkpoint": {"mode": "async_staged", "every_steps": max(steps // 6, 1)},
    }
    if dry:  # the tests' tiny model and data, eager, gloo on the CPU
        sections["data"] |= {
            "cat_vocab_sizes": [50, 20, 10],
            "item_vocab_size": 100,
            "max_history_len": 16,
            "batch_size": 64,
            "eval_batch_size": 256,
            "generator": {"rows": 4000, "holdout_rows": 1000, "shards": 2},
        }
        sections["model"] = {"embedding_dim": 8, "dense_arch": [16, 8], "over_arch": [16, 8]}
        sections["train"] |= {"compile": False, "eval_rows": 512, "backend": "gloo"}
    else:  # the demo model; less data than the demo's (generated before the time limit)
        sections["train"] |= {"backend": "nccl", "eval_rows": 20_000}
        sections["data"]["generator"] = {"rows": 100_000, "holdout_rows": 20_000}
    config = load_config(job_id="gpu-check", **sections)
    from trainer.data.synthetic import generate

    generate(config.data, config.data.url)
    path = work / "job.yaml"
    dump_config(config, path)
    env = {"OMP_NUM_THREADS": "1"} if dry else {}
    backend = f"backend {'gloo' if dry else 'cpu:gloo,cuda:nccl'}"
    cmd = LaunchSpec(str(path)).command()
    res = run_part(cmd, LIMITS["nccl_training"], env, grep=(backend,))
    storage.configure(config.storage)
    events = read_events(config.layout)
    ledger = out / "nccl_training_ledger"
    ledger.mkdir(exist_ok=True)
    for url in storage.glob(storage.join(config.layout.url, "ledger", "*.jsonl")):
        (ledger / url.rsplit("/", 1)[-1]).write_bytes(storage.read_bytes(url))
    if events:
        report = report_for_job(config.layout)
        mfu = mfu_for_job(config.layout, report)
        marks = [e.attrs for e in events if e.name == Mark.MODEL_FLOPS]
        res.update(
            steps=report.num_steps,
            ett_pct=report.ett_pct,
            step_time_median_s=report.step_time_median_s,
            checkpoints_committed=report.num_checkpoints_committed,
            checkpoint_blocking_mean_s=report.checkpoint_blocking_mean_s,
            device=marks[-1] if marks else None,
            mfu=None if mfu is None else mfu.to_metrics() | {"peak_source": mfu.peak_source},
        )
    res["ok"] = (
        res["exit_code"] == 0
        and res["found"][backend]
        and res.get("steps") == steps
        and res.get("checkpoints_committed", 0) >= 2
        and (dry or (res.get("device") or {}).get("device") == "cuda")
    )
    shutil.rmtree(work, ignore_errors=True)  # the ledger was copied above
    return res


def benchmark(script: str, dry: bool, out: Path, limit: float, extra: list[str]) -> dict:
    json_out = out / f"{Path(script).stem}.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / script), "--out", str(json_out)]
    env = {"TRITON_INTERPRET": "1"} if dry else {}
    res = run_part([*cmd, *(["--dry-run"] if dry else extra)], limit, env)
    res["ok"] = res["exit_code"] == 0 and json_out.exists()
    if json_out.exists():
        res["result"] = json.loads(json_out.read_text())
    return res


def device_line() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} ({torch.cuda.device_count()} visible)"
    return f"no GPU: CPU dry run ({platform.processor() or platform.machine()})"


def write_summary(out: Path, parts: dict[str, dict], dry: bool) -> Path:
    lines = [
        f"# GPU check{' (dry run, CPU only: no GPU numbers)' if dry else ''}",
        "",
        f"- date: {dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- device: {device_line()}",
        f"- torch {torch.__version__}, CUDA {torch.version.cuda}, python "
        f"{platform.python_version()}",
        "",
        "| part | status | seconds |",
        "|---|---|---:|",
    ]
    for name, res in parts.items():
        status = "ok" if res["ok"] else ("timed out" if res.get("timed_out") else "FAILED")
        lines.append(f"| {name} | {status} | {res['duration_s']:.0f} |")
    training = parts.get("nccl_training", {})
    if training.get("steps"):
        mfu = training.get("mfu") or {}
        lines += [
            "",
            "## Training (1 rank)",
            "",
            f"- steps {training['steps']}, median step {training['step_time_median_s']:.4f} s,"
            f" ETT {training['ett_pct']:.1f}%, checkpoints committed "
            f"{training['checkpoints_committed']}, mean blocking per checkpoint "
            f"{training['checkpoint_blocking_mean_s'] or 0:.4f} s",
            f"- MFU {mfu.get('mfu_pct', float('nan')):.3f}%, ETT x MFU "
            f"{mfu.get('ett_x_mfu_pct', float('nan')):.4f}% (peak: {mfu.get('peak_source')})",
        ]
    for name in ("attention", "staging"):
        if parts.get(name, {}).get("tables"):
            lines += ["", f"## {name}", "", *parts[name]["tables"]]
    path = out / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU-safe parts only, shrunk")
    parser.add_argument("--steps", type=int, help="training steps (default 300; dry run 12)")
    parser.add_argument("--out", type=Path, help="results folder")
    args = parser.parse_args(argv)
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("gpu-check needs a CUDA device (no GPU visible); --dry-run checks the script")
        return 2
    out = args.out or ROOT / "benchmarks" / "results" / ("gpu-dry-run" if dry else "gpu")
    out.mkdir(parents=True, exist_ok=True)
    steps = args.steps or (12 if dry else 300)
    plan: dict[str, Callable[[], dict[str, Any]]] = {
        "gpu_tests": lambda: gpu_tests(dry, out),
        "nccl_training": lambda: nccl_training(dry, out, steps),
        "attention": lambda: benchmark(
            "bench_attention.py", dry, out, LIMITS["attention"], ["--gpu-only", "--reps", "10"]
        ),
        "staging": lambda: benchmark(
            "bench_staging.py", dry, out, LIMITS["staging"], ["--sizes", "256,1024"]
        ),
    }
    parts = {}
    for name, part in plan.items():
        print(f"== {name}", flush=True)
        try:
            parts[name] = part()
        except Exception as exc:  # one broken part must not hide the others' results
            parts[name] = {"ok": False, "duration_s": 0.0, "error": f"{type(exc).__name__}: {exc}"}
        res = parts[name]
        (out / f"{name}.json").write_text(json.dumps(res, indent=2, default=str))
        print(f"   {'ok' if res['ok'] else 'FAILED'} in {res['duration_s']:.0f} s", flush=True)
        if not res["ok"]:
            print(res.get("error") or res.get("output_tail", "")[-2000:], flush=True)
    summary = write_summary(out, parts, dry)
    print(summary.read_text())
    return 0 if all(p["ok"] for p in parts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
