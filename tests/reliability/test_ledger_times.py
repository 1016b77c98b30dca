"""Implausible ledger times never become the report's numbers: a job trained by ``ett
train``, its ledger then altered as a fault alters it, reported by ``ett report``.

The findings these pin: one ``train_step`` line whose ``end`` had a single flipped digit
(still valid JSON) made the report say wall 8.0e9 s and ETT 100.0%; a resumed job whose
earlier ledger was 90 s ahead of this host's clock reported a wall time and a Time to Start
stretched by the offset, and ETT 40%, with no warning.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from infra import storage
from infra.accounting.ett import report_for_job
from infra.settings import JobConfig
from tests.flows.test_cli import ett, write
from tests.reliability.jobs import job_config


def _train(config: JobConfig, tmp_path: Path, *flags: str) -> int:
    path = write(config, tmp_path / f"{config.job_id}.yaml")
    return ett("train", "--config", path, "--backoff-s", "0", *flags, cwd=tmp_path).returncode


def _ledger(config: JobConfig) -> Path:
    return Path(storage.local_path(config.layout.url) or "", "ledger")


def _rewrite(path: Path, change) -> None:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(change(r)) + "\n" for r in records))


def test_a_flipped_digit_in_one_steps_end_is_rejected_and_said(
    tmp_path: Path, data_url: str
) -> None:
    config = job_config(tmp_path, data_url, 40, job_id="flipped", recovery={"standby": False})
    assert _train(config, tmp_path) == 0
    clean = report_for_job(config.layout)

    def flip(rec: dict) -> dict:
        if rec["name"] == "train_step" and rec.get("step") == 17:
            text = repr(rec["end"])
            rec["end"] = float(("8" if text[0] != "8" else "9") + text[1:])  # one digit
        return rec

    _rewrite(_ledger(config) / "trainer-attempt000-rank000.jsonl", flip)
    shown = ett("report", "flipped", "--config", str(tmp_path / "flipped.yaml"), cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    report = report_for_job(config.layout)
    assert abs(report.wall_s - clean.wall_s) < 1e-3 and report.ett_pct < 100.0
    assert abs(report.ett_pct - clean.ett_pct) < 0.01
    assert report.clock.retimed == 1
    assert "Ledger checks" in shown.stdout
    assert "1 event time(s) rejected" in shown.stdout
    assert "trainer-attempt000-rank000.jsonl line" in shown.stdout and "step 17" in shown.stdout


def test_an_earlier_ledger_ahead_of_this_hosts_clock_is_moved_back_and_said(
    tmp_path: Path, data_url: str
) -> None:
    """Attempt 0 runs and is SIGKILLed with ``max_failures`` 0: the job fails. Its ledger is
    then moved 90 s into the future (a clock that ran ahead while it ran). ``ett train``
    resumes the job on this host: the report's wall time is the time that really passed,
    and it says which files were moved back, and by how much."""
    config = job_config(
        tmp_path,
        data_url,
        60,
        job_id="ahead",
        recovery={"standby": False},
        faults=[{"kind": "sigkill", "step": 30, "attempt": 0}],
    )
    began = time.time()
    assert _train(config, tmp_path, "--max-failures", "0") != 0

    def ahead(rec: dict) -> dict:
        if rec["name"] != "clock":
            for key in ("start", "end", "t"):
                if key in rec:
                    rec[key] += 90.0
        return rec

    earlier = sorted(_ledger(config).glob("*-attempt000-*.jsonl"))
    assert earlier
    for path in earlier:
        _rewrite(path, ahead)
    assert _train(config, tmp_path) == 0
    real = time.time() - began

    report = report_for_job(config.layout)
    assert report.finished and report.num_steps == 60
    assert report.wall_s <= real  # never more than what passed (it was real + 90 s before)
    assert report.time_to_start_s is not None and report.time_to_start_s < real / 2
    moved = [o for o in report.clock.offsets if abs(o.offset_s - 90.0) < 0.5]
    assert moved and all("attempt000" in o.what for o in moved), report.clock.offsets
    shown = ett("report", "ahead", "--config", str(tmp_path / "ahead.yaml"), cwd=tmp_path)
    assert "ran 90.0 s ahead of its newest process" in shown.stdout
