"""User-history towers: turn a jagged sequence of past item ids into one vector per row.

Both towers own their item table as a TorchRec collection (``.items``), so
DistributedModelParallel shards it like any other table; ``device`` places only that
collection (``meta`` defers its allocation to the sharder). ``ModelConfig.history_tower``
picks the tower.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from infra.settings import DataConfig, ModelConfig

HISTORY_FEATURE = "history"
HISTORY_TABLE = "t_history"


class PoolingHistoryTower(nn.Module):
    """Mean of the history's item embeddings (an empty history gives zeros)."""

    def __init__(self, data: DataConfig, config: ModelConfig, device: torch.device | None):
        super().__init__()
        table = EmbeddingBagConfig(
            name=HISTORY_TABLE,
            embedding_dim=config.embedding_dim,
            num_embeddings=data.item_vocab_size,
            feature_names=[HISTORY_FEATURE],
            pooling=PoolingType.MEAN,
        )
        self.items = EmbeddingBagCollection(tables=[table], device=device)

    def forward(self, history: KeyedJaggedTensor) -> torch.Tensor:
        return self.items(history)[HISTORY_FEATURE]


def positions_in_sequence(offsets: torch.Tensor) -> torch.Tensor:
    """For jagged offsets [B+1], each element's distance from the END of its sequence
    (0 = most recent), so positions mean recency whatever the sequence length."""
    lengths = offsets[1:] - offsets[:-1]
    total = int(offsets[-1])
    ends = torch.repeat_interleave(offsets[1:], lengths, output_size=total)
    return ends - 1 - torch.arange(total, device=offsets.device)


def segment_mean(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Mean of each jagged segment of ``values`` [total, D] -> [B, D]; empty segments give 0."""
    lengths = offsets[1:] - offsets[:-1]
    segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=values.device), lengths)
    sums = torch.zeros(lengths.numel(), values.shape[1], dtype=values.dtype, device=values.device)
    sums.index_add_(0, segment, values)
    return sums / lengths.clamp(min=1).unsqueeze(1).to(values.dtype)


def segment_weighted_mean(
    values: torch.Tensor, scores: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """Softmax(scores) within each jagged segment, then the weighted sum of ``values``
    [total, D] -> [B, D]; equal scores give the plain mean, empty segments give 0."""
    lengths = offsets[1:] - offsets[:-1]
    batch = lengths.numel()
    segment = torch.repeat_interleave(torch.arange(batch, device=values.device), lengths)
    top = torch.full((batch,), float("-inf"), dtype=scores.dtype, device=scores.device)
    top = top.scatter_reduce(0, segment, scores, reduce="amax", include_self=True)
    weights = torch.exp(scores - top[segment].detach())
    norm = torch.zeros(batch, dtype=scores.dtype, device=scores.device).index_add(
        0, segment, weights
    )
    weights = weights / norm[segment]
    out = torch.zeros(batch, values.shape[1], dtype=values.dtype, device=values.device)
    return out.index_add(0, segment, values * weights.unsqueeze(1))


class AttentionHistoryTower(nn.Module):
    """Item embeddings plus a learned jagged self-attention branch, pooled by a weighted mean.

    The attention branch reads item + recency embeddings and adds its output to each item
    embedding; position-aware scores then weigh the items (a softmax per sequence), so the
    tower can learn that recent items matter more. The branch's output projection and the
    scores start at zero, so the tower starts as the pooling tower (a plain mean) and
    attention only adds what it learns (the zero-initialised residual of ReZero / GPT-style
    blocks); with a normalised residual and a plain mean instead, it trailed the pooling
    tower on the demo data. Attention runs on the jagged values directly (no padding):
    Triton on GPU, a bucketed CPU path otherwise (trainer/attention).
    """

    def __init__(self, data: DataConfig, config: ModelConfig, device: torch.device | None):
        super().__init__()
        dim = config.embedding_dim
        table = EmbeddingConfig(
            name=HISTORY_TABLE,
            embedding_dim=dim,
            num_embeddings=data.item_vocab_size,
            feature_names=[HISTORY_FEATURE],
        )
        self.items = EmbeddingCollection(tables=[table], device=device)
        self.positions = nn.Embedding(data.max_history_len, dim)
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.pool = nn.Linear(dim, 1)  # scores each position for the final weighted mean
        for layer in (self.out, self.pool):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)
        self.heads = config.attention_heads
        self.impl = config.attention_impl

    def forward(self, history: KeyedJaggedTensor) -> torch.Tensor:
        from trainer.attention import jagged_attention

        jagged = self.items(history)[HISTORY_FEATURE]
        items, offsets = jagged.values(), jagged.offsets().long()
        positions = positions_in_sequence(offsets).clamp(max=self.positions.num_embeddings - 1)
        x = self.norm(items + self.positions(positions))
        total, dim = x.shape
        q, k, v = self.qkv(x).view(total, 3, self.heads, dim // self.heads).unbind(1)
        attended = jagged_attention(q, k, v, offsets, impl=self.impl).reshape(total, dim)
        update = self.out(attended)
        scores = self.pool(x + update).squeeze(1)  # position-aware: can learn recency
        return segment_weighted_mean(items + update, scores, offsets)


def build_history_tower(
    data: DataConfig, config: ModelConfig, device: torch.device | None
) -> nn.Module:
    towers = {"pooling": PoolingHistoryTower, "attention": AttentionHistoryTower}
    return towers[config.history_tower](data, config, device)
