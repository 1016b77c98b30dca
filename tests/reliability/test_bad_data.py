"""Bad data: a file with more bad rows than data.max_bad_row_fraction fails the attempt
with BAD_DATA (not retried), naming the file and one bad row; fewer are skipped and counted.

Before, any share of bad rows short of a whole file was skipped silently: a broken export
(here: one label in twenty is 2) trained a model on what was left.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from infra import storage
from infra.checkpoint_manifest import committed_checkpoints
from infra.exit_codes import ExitCode, Outcome, outcome_of
from tests.reliability.jobs import job_config, run_to_end

pytestmark = pytest.mark.slow


def spoil_labels(data_url: str, into: Path, every: int) -> str:
    """A copy of the data set whose every ``every``-th training row has label 2."""
    src = storage.local_path(data_url)
    assert src is not None
    shutil.copytree(src, into)
    for shard in sorted((into / "train").glob("*.parquet")):
        table = pq.read_table(shard)
        bad = np.arange(table.num_rows) % every == 0
        label = pc.if_else(pa.array(bad), pa.scalar(2.0, pa.float32()), table.column("label"))
        pq.write_table(table.set_column(0, "label", label), shard)
    return f"file://{into}"


def test_too_many_bad_rows_fail_with_bad_data_naming_file_and_row(
    tmp_path: Path, data_url: str
) -> None:
    spoilt = spoil_labels(data_url, tmp_path / "spoilt", every=20)  # 5% of the rows
    config = job_config(tmp_path, spoilt, steps=10)
    code, out = run_to_end(config, tmp_path)
    assert code == ExitCode.BAD_DATA, out[-3000:]
    assert outcome_of(code) is Outcome.BAD_DATA and Outcome.BAD_DATA.fatal  # not retried
    [line] = [line for line in out.splitlines() if "bad data:" in line]
    assert "/train/part-" in line and ".parquet:" in line, line
    assert "more than data.max_bad_row_fraction=0.01" in line, line
    assert "label not 0/1" in line and " row " in line, line
    assert committed_checkpoints(config.layout) == []  # nothing trained on it


def test_bad_rows_below_the_limit_are_skipped_and_counted(tmp_path: Path, data_url: str) -> None:
    from trainer.data.loader import TrainLoader

    spoilt = spoil_labels(data_url, tmp_path / "spoilt", every=200)  # 0.5%
    data = job_config(tmp_path, spoilt, steps=10).data
    loader = TrainLoader(data, 0, 1, seed=0, prefetch=0)
    rows = sum(len(next(loader)) for _ in range(40))  # more than every training row
    loader.close()
    assert loader.stats["bad_rows"] >= rows // 200 > 0
