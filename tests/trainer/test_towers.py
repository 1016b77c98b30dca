"""History towers: jagged pooling helpers; how the attention tower starts and uses order."""

from __future__ import annotations

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from infra.settings import load_config
from trainer.towers import (
    HISTORY_FEATURE,
    AttentionHistoryTower,
    PoolingHistoryTower,
    positions_in_sequence,
    segment_mean,
    segment_weighted_mean,
)

OFFSETS = torch.tensor([0, 3, 3, 4, 9])  # lengths 3, 0 (empty), 1, 5


def test_positions_count_back_from_the_most_recent_item() -> None:
    assert positions_in_sequence(OFFSETS).tolist() == [2, 1, 0, 0, 4, 3, 2, 1, 0]


def test_segment_weighted_mean_is_a_per_sequence_softmax_average() -> None:
    torch.manual_seed(0)
    values = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    scores = torch.randn(9, dtype=torch.float64, requires_grad=True)
    got = segment_weighted_mean(values, scores, OFFSETS)
    for row, (a, b) in enumerate(zip(OFFSETS[:-1].tolist(), OFFSETS[1:].tolist(), strict=True)):
        want = torch.softmax(scores[a:b], 0) @ values[a:b] if b > a else torch.zeros(4).double()
        torch.testing.assert_close(got[row], want)
    equal = segment_weighted_mean(values, torch.full((9,), 3.0).double(), OFFSETS)
    torch.testing.assert_close(equal, segment_mean(values, OFFSETS))
    assert torch.autograd.gradcheck(
        lambda v, s: segment_weighted_mean(v, s, OFFSETS), (values, scores)
    )
    huge = segment_weighted_mean(values, scores * 1e4, OFFSETS)  # no overflow: max-shifted
    assert torch.isfinite(huge).all()


def _history(items: list[list[int]]) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[HISTORY_FEATURE],
        values=torch.tensor([i for seq in items for i in seq], dtype=torch.long),
        lengths=torch.tensor([len(seq) for seq in items], dtype=torch.long),
    )


@pytest.fixture
def towers() -> tuple[AttentionHistoryTower, PoolingHistoryTower]:
    config = load_config(
        data={"item_vocab_size": 50, "max_history_len": 8},
        model={"embedding_dim": 8, "dense_arch": [8], "attention_heads": 2},
    )
    torch.manual_seed(0)
    attention = AttentionHistoryTower(config.data, config.model, torch.device("cpu"))
    pooling = PoolingHistoryTower(config.data, config.model, torch.device("cpu"))
    weight = attention.items.embeddings[f"t_{HISTORY_FEATURE}"].weight
    pooling.items.embedding_bags[f"t_{HISTORY_FEATURE}"].weight.data.copy_(weight.data)
    return attention, pooling


def test_attention_tower_starts_as_the_pooling_tower(towers) -> None:
    """Its residual branch and pooling scores start at zero: training begins from pooling
    and attention adds only what it learns. Empty and length-1 histories work."""
    attention, pooling = towers
    history = _history([[1, 2, 3], [], [7], [4, 5, 6, 7, 8]])
    out = attention(history)
    torch.testing.assert_close(out, pooling(history))
    assert out[1].abs().sum() == 0  # the empty history


def test_trained_attention_tower_uses_order_and_pooling_cannot(towers) -> None:
    attention, pooling = towers
    with torch.no_grad():  # as after some training: the branch and the scores are non-zero
        for layer in (attention.out, attention.pool):
            layer.weight.normal_()
    forward, backward = _history([[1, 2, 3, 4]]), _history([[4, 3, 2, 1]])
    torch.testing.assert_close(pooling(forward), pooling(backward))
    assert not torch.allclose(attention(forward), attention(backward))
    attention(forward).sum().backward()
    assert attention.qkv.weight.grad is not None and attention.qkv.weight.grad.abs().sum() > 0
