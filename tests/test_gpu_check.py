"""`make gpu-check` stays ready for the first GPU: its dry run (every part's CPU-safe form)
runs the way a user runs the script and writes each part's JSON and the summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("gpu_tests", "nccl_training", "attention", "staging")


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "results"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    parts = {name: json.loads((out / f"{name}.json").read_text()) for name in PARTS}
    assert all(p["ok"] for p in parts.values())
    assert parts["gpu_tests"]["collected"] >= 11  # Triton parity (8) and staging (3) on CUDA
    training = parts["nccl_training"]
    assert training["steps"] == 12 and training["checkpoints_committed"] >= 2
    assert training["mfu"]["mfu_pct"] > 0
    assert list((out / "nccl_training_ledger").glob("trainer-*.jsonl"))
    rows = parts["attention"]["result"]["rows"]
    assert {r["path"] for r in rows} == {"triton", "reference", "cpu", "nested"}
    assert max(r["max_abs_diff_vs_reference"] for r in rows) < 1e-4
    engines = {r["engine"] for r in parts["staging"]["result"]["rows"] if "error" not in r}
    assert {"raw copy", "dcp DefaultStager", "side_stream snapshot"} <= engines
    summary = (out / "summary.md").read_text()
    assert "dry run" in summary and "no GPU" in summary
