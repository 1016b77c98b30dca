"""Two processes under torchrun (gloo on CPU) with table-wise sharded embeddings."""

from __future__ import annotations

import statistics

import pytest

from infra.accounting.ledger_read import read_events
from tests.factories import run_trainer, tiny_config, write_dataset


@pytest.mark.slow
def test_two_ranks_train_sharded_tables_and_agree(tmp_path) -> None:
    config = tiny_config(
        tmp_path,
        job_id="two-ranks",
        train={"steps": 30, "eval": "inline", "eval_every": 15, "eval_rows": 512, "log_every": 10},
        checkpoint={"mode": "off"},
    )
    write_dataset(config)
    result = run_trainer(config, tmp_path, nproc=2)
    assert result.returncode == 0, result.stdout[-3000:]

    events = read_events(config.layout)
    for rank in (0, 1):
        steps = [e for e in events if e.rank == rank and e.name == "train_step"]
        assert [e.step for e in steps] == list(range(1, 31)), f"rank {rank} missed steps"
        losses = [e.attrs["loss"] for e in steps]
        first, last = statistics.mean(losses[:5]), statistics.mean(losses[-5:])
        assert last < first, f"rank {rank} did not learn: {first:.4f} -> {last:.4f}"
    # Evaluation gathers predictions from both ranks: both report the same numbers.
    evals = {(e.rank, e.step): e.attrs for e in events if e.name == "eval"}
    for step in (15, 30):
        assert evals[(0, step)]["auc"] == evals[(1, step)]["auc"]
        assert evals[(0, step)]["logloss"] == evals[(1, step)]["logloss"]
        assert evals[(0, step)]["rows"] == 512
