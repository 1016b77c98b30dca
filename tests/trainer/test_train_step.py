"""The training step's order: a checkpoint's copy of the state may run until the step
changes the weights, so ``before_update`` must come after the forward and before backward."""

from __future__ import annotations

from typing import Any

import torch

from trainer.data.batch import Batch
from trainer.train import train_step


class Dense(torch.nn.Module):
    """Takes what the model takes (dense features and the two KeyedJaggedTensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 1)
        self.forwards = 0

    def forward(self, dense: torch.Tensor, sparse: Any, history: Any) -> torch.Tensor:
        self.forwards += 1
        return self.linear(dense).squeeze(-1)


def _batch(rows: int = 4) -> Batch:
    return Batch(
        dense=torch.randn(rows, 3),
        cat=torch.zeros(rows, 2, dtype=torch.int64),
        item=torch.zeros(rows, dtype=torch.int64),
        history_values=torch.zeros(rows, dtype=torch.int64),
        history_offsets=torch.arange(rows + 1, dtype=torch.int64),
        labels=torch.ones(rows),
    )


def test_before_update_runs_once_after_the_forward_and_before_the_weights_change() -> None:
    model = Dense()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    before = model.linear.weight.detach().clone()
    seen: list[tuple[int, bool, bool]] = []

    def before_update() -> None:  # what the checkpointer's wait sees
        unchanged = torch.equal(model.linear.weight, before)
        seen.append((model.forwards, unchanged, model.linear.weight.grad is None))

    train_step(model, optimizer, _batch(), torch.device("cpu"), before_update=before_update)
    assert seen == [(1, True, True)]  # after the forward, before backward and the update
    assert not torch.equal(model.linear.weight, before)  # and the step did update
