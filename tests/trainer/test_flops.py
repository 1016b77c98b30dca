"""The analytic FLOP count of a training step against torch.utils.flop_counter on the model.

The counter sees every matmul of one forward + backward of the real RankingModel (attention
through SDPA's math kernel, so its matmuls are counted too). Jagged attention is counted at
the real lengths, so the comparison uses batches whose histories share one length (no
padding in the counted kernels); ``of_batch`` on mixed lengths must equal the per-row sum.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from tests.factories import tiny_config
from trainer.data.batch import Batch
from trainer.flops import ModelFlops
from trainer.model import RankingModel, batch_to_kjts


def _batch(config, lengths: list[int]) -> Batch:
    rows = len(lengths)
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    return Batch(
        dense=torch.randn(rows, config.data.num_dense),
        cat=torch.zeros(rows, len(config.data.cat_vocab_sizes), dtype=torch.long),
        item=torch.zeros(rows, dtype=torch.long),
        history_values=torch.zeros(int(offsets[-1]), dtype=torch.long),
        history_offsets=offsets,
        labels=torch.ones(rows),
    )


def _counted(config, batch: Batch) -> int:
    torch.manual_seed(0)
    model = RankingModel(config.data, config.model)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        sparse, history = batch_to_kjts(batch)
        logits = model(batch.dense, sparse, history)
        torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize(
    ("tower", "dims", "length"),
    [
        ("attention", (8, [16, 8], [16, 8], 2), 5),
        ("attention", (16, [32, 16], [24, 12], 4), 11),
        ("pooling", (8, [16, 8], [16, 8], 2), 7),
    ],
)
def test_step_flops_match_the_flop_counter(tmp_path: Path, tower, dims, length) -> None:
    dim, dense_arch, over_arch, heads = dims
    config = tiny_config(
        tmp_path,
        model={
            "embedding_dim": dim,
            "dense_arch": dense_arch,
            "over_arch": over_arch,
            "attention_heads": heads,
            "history_tower": tower,
            "attention_impl": "reference",
        },
    )
    batch = _batch(config, [length] * 6)
    analytic = ModelFlops.of(config.data, config.model).of_batch(batch.history_offsets)
    assert analytic == _counted(config, batch)


def test_batch_flops_are_the_sum_of_row_flops(tmp_path: Path) -> None:
    config = tiny_config(tmp_path)
    flops = ModelFlops.of(config.data, config.model)
    lengths = np.array([0, 1, 3, 17, 0, 35, 2])
    offsets = torch.tensor([0, *lengths.tolist()]).cumsum(0)
    assert flops.of_batch(offsets) == int(flops.of_lengths(lengths).sum())
    assert flops.per_pair > 0  # the default tower is attention: quadratic in the length
