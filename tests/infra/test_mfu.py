"""MFU beside ETT: peaks, the hand-computed decomposition, the cached CPU peak, `ett report`.

The hand-built job (seconds after T0), device "NVIDIA H200" fp32 (67 TFLOP/s), 2 ranks::

    attempt 0  rank 0: mark @1, steps 1 [2,4] 2 [4,6] 3 [6,8], 10 FLOPs each; dies
               rank 1: the same steps, 30 FLOPs each
    attempt 1  rank 0: mark @10, steps 3 [11,13] 4 [13,15], 20 FLOPs each; job_end @15
               rank 1: the same steps, 40 FLOPs each

Effective executions (the last of each step per rank): rank 0 10+10+20+20, rank 1
30+30+40+40, F = 200. W = 14 (mark @1 to job_end @15), T_eff = 8 (a0's step 3 was redone).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from infra.accounting import mfu
from infra.accounting.ett import report_for_job
from infra.accounting.ledger import Ledger
from infra.accounting.mfu import gpu_peak, mfu_for_job, mfu_metrics
from infra.accounting.report import format_table, to_markdown
from infra.job_layout import JobLayout
from tests.factories import ROOT, run_trainer, tiny_config, write_dataset

T0 = 1_700_000_000.0
H200 = {"device": "cuda", "device_name": "NVIDIA H200", "dtype": "fp32", "world_size": 2}


def _write_job(job_url: str) -> None:
    clock = lambda: T0  # noqa: E731 - every time below is given explicitly
    for attempt, mark_t, steps, flops in [
        (0, 1, [(1, 2, 4), (2, 4, 6), (3, 6, 8)], (10, 30)),
        (1, 10, [(3, 11, 13), (4, 13, 15)], (20, 40)),
    ]:
        for rank in (0, 1):
            with Ledger(JobLayout.at(job_url), attempt=attempt, rank=rank, clock=clock) as led:
                led.mark("model_flops", t=T0 + mark_t, **H200)
                for step, s, e in steps:
                    led.record_span("train_step", T0 + s, T0 + e, step=step, flops=flops[rank])
                if attempt == 1 and rank == 0:
                    led.mark("job_end", t=T0 + 15)


@pytest.mark.parametrize(
    ("name", "dtype", "peak"),
    [
        ("NVIDIA H200", "fp32", 67e12),
        ("NVIDIA H200", "bf16", 989.4e12),
        ("NVIDIA H100 80GB HBM3", "tf32", 494.7e12),
        ("NVIDIA H100 PCIe", "fp32", 51e12),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
        ("NVIDIA L4", "fp32", 30.3e12),
        ("NVIDIA L40S", "fp32", 91.6e12),
        ("Tesla V100-SXM2-16GB", "bf16", None),
        ("Some Future GPU", "fp32", None),
    ],
)
def test_gpu_peaks_by_name_and_dtype(name: str, dtype: str, peak: float | None) -> None:
    assert gpu_peak(name, dtype) == peak


def test_mfu_and_ett_x_mfu_by_hand(tmp_path: Path) -> None:
    job_url = str(tmp_path / "job")
    _write_job(job_url)
    report = report_for_job(JobLayout.at(job_url))
    assert report.wall_s == 14 and report.buckets["effective_training"] == 8
    m = mfu_for_job(JobLayout.at(job_url), report)
    assert m is not None
    peak = 67e12
    assert m.model_flops == 200
    assert m.mfu_pct == pytest.approx(100 * 200 / (2 * peak * 8))
    assert m.ett_x_mfu_pct == pytest.approx(100 * 200 / (2 * peak * 14))
    assert m.ett_x_mfu_pct == pytest.approx(report.ett_pct * m.mfu_pct / 100)
    assert m.peak_flops == peak and "H200" in m.peak_source
    metrics = mfu_metrics(JobLayout.at(job_url), report)
    assert metrics["mfu_pct"] == m.mfu_pct and metrics["ett_x_mfu_pct"] == m.ett_x_mfu_pct
    for text in (format_table(report, m), to_markdown(report, m)):
        assert "MFU%" in text and "ETT% x MFU" in text
        assert f"{m.mfu_pct:.2f}" in text


def test_no_flops_or_unknown_device_gives_no_mfu(tmp_path: Path) -> None:
    job_url = str(tmp_path / "job")
    with Ledger(JobLayout.at(job_url), clock=lambda: T0) as led:
        led.record_span("train_step", T0 + 1, T0 + 2, step=1)
        led.mark("job_end", t=T0 + 2)
    report = report_for_job(JobLayout.at(job_url))
    assert (
        mfu_for_job(JobLayout.at(job_url), report) is None
        and mfu_metrics(JobLayout.at(job_url), report) == {}
    )
    unknown = str(tmp_path / "unknown")
    with Ledger(JobLayout.at(unknown), clock=lambda: T0) as led:
        led.mark("model_flops", t=T0, **{**H200, "device_name": "Some Future GPU"})
        led.record_span("train_step", T0 + 1, T0 + 2, step=1, flops=5)
    assert mfu_for_job(JobLayout.at(unknown), report_for_job(JobLayout.at(unknown))) is None


def test_cpu_peak_is_measured_once_and_cached(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    real = mfu.measure_cpu_peak

    def counted(threads: int, dtype: str = "fp32") -> float:
        calls.append(threads)
        return real(threads, dtype, size=256, reps=2)

    monkeypatch.setattr(mfu, "measure_cpu_peak", counted)
    first = mfu.cpu_peak(1)
    assert first is not None and first > 1e8  # any CPU does 0.1 GFLOP/s
    assert mfu.cpu_peak(1) == first and calls == [1]
    cached = json.loads((tmp_path / "ett-pipeline" / "peak_flops.json").read_text())
    assert list(cached.values()) == [first]
    assert mfu.cpu_peak(1, model="a CPU this machine is not") is None  # never measured here


@pytest.mark.slow
def test_ett_report_shows_mfu_of_a_trained_job(tmp_path: Path) -> None:
    config = tiny_config(
        tmp_path,
        job_id="mfu",
        model={"history_tower": "attention"},
        train={"steps": 8, "eval_every": 0, "eval_rows": 256, "log_every": 4},
        checkpoint={"mode": "off"},
    )
    write_dataset(config)
    result = run_trainer(config, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:]
    config_path = tmp_path / "mfu.yaml"  # written by run_trainer
    ett = Path(sys.executable).parent / "ett"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    out = subprocess.run(
        [str(ett), "report", "mfu", "--config", str(config_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {
        line.split("  ")[0]: line.split("  ")[-1].strip()
        for line in out.stdout.splitlines()
        if line.startswith(("MFU%", "ETT% x MFU", "ETT%"))
    }
    mfu_pct, ett_pct = float(rows["MFU%"]), float(rows["ETT%"])
    assert 0 < mfu_pct < 100
    # Each printed figure is rounded (MFU% to 0.005, the product to 0.0005): the product
    # recomputed from the printed ones is that far off at most.
    assert float(rows["ETT% x MFU (end-to-end)"]) == pytest.approx(
        ett_pct * mfu_pct / 100, abs=0.005 * ett_pct / 100 + 0.0005 + 1e-9
    )
    assert "measured matmul" in out.stdout  # a CPU job: the peak was measured, then cached
    assert list((tmp_path / "cache" / "ett-pipeline").glob("peak_flops.json"))
