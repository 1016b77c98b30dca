"""A DLRM-style ranking model on TorchRec, with a swappable user-history tower.

    dense features ──► dense MLP ─────────────┐
    categorical ids ─► EmbeddingBagCollection ─┼─► pairwise dot interaction ─► over MLP ─► logit
    candidate item ──► (same collection) ──────┤
    user history ────► history tower ──────────┘

The sparse collections are what DistributedModelParallel shards across ranks; everything
after the lookups (``dense_forward``) is plain dense compute, the part worth compiling.
The publisher imports this module (never the training loop) to rebuild the model on CPU.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from infra.settings import DataConfig, ModelConfig
from trainer.data.batch import Batch
from trainer.towers import HISTORY_FEATURE, build_history_tower

ITEM_FEATURE = "item"


def cat_feature_names(data: DataConfig) -> list[str]:
    return [f"cat{i}" for i in range(len(data.cat_vocab_sizes))]


def mlp(sizes: list[int]) -> nn.Sequential:
    """Linear+ReLU layers through ``sizes`` (no activation after the last layer is added by
    the caller when it needs a raw output)."""
    layers: list[nn.Module] = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*layers)


class DenseInteraction(nn.Module):
    """Dense MLP, DLRM dot interaction and over-arch: the compute after embedding lookups."""

    def __init__(self, num_dense: int, num_sparse_vectors: int, config: ModelConfig) -> None:
        super().__init__()
        self.dense_arch = mlp([num_dense, *config.dense_arch])
        num_vectors = num_sparse_vectors + 1
        rows, cols = torch.triu_indices(num_vectors, num_vectors, offset=1)
        self.register_buffer("_rows", rows, persistent=False)
        self.register_buffer("_cols", cols, persistent=False)
        over_in = config.embedding_dim + rows.numel()
        self.over_arch = nn.Sequential(
            mlp([over_in, *config.over_arch]), nn.Linear(config.over_arch[-1], 1)
        )

    def forward(self, dense: torch.Tensor, sparse_vectors: torch.Tensor) -> torch.Tensor:
        """dense [B, num_dense], sparse_vectors [B, F, D] -> logits [B]."""
        dense_out = self.dense_arch(dense)
        vectors = torch.cat([dense_out.unsqueeze(1), sparse_vectors], dim=1)
        products = torch.bmm(vectors, vectors.transpose(1, 2))
        pairs = products[:, self._rows, self._cols]
        return self.over_arch(torch.cat([dense_out, pairs], dim=1)).squeeze(-1)


class RankingModel(nn.Module):
    """The full model. ``forward(dense, sparse_kjt, history_kjt) -> logits [B]``."""

    def __init__(self, data: DataConfig, config: ModelConfig, device: torch.device | None = None):
        """``device`` places the embedding collections only (``meta`` for sharded training)."""
        super().__init__()
        dim = config.embedding_dim
        tables = [
            EmbeddingBagConfig(
                name=f"t_{name}", embedding_dim=dim, num_embeddings=vocab, feature_names=[name]
            )
            for name, vocab in zip(cat_feature_names(data), data.cat_vocab_sizes, strict=True)
        ]
        tables.append(
            EmbeddingBagConfig(
                name="t_item",
                embedding_dim=dim,
                num_embeddings=data.item_vocab_size,
                feature_names=[ITEM_FEATURE],
            )
        )
        self.sparse_arch = EmbeddingBagCollection(tables=tables, device=device)
        self.interaction = DenseInteraction(data.num_dense, len(tables) + 1, config)
        # Built last, so the choice of tower leaves the initial weights of the rest of the
        # model unchanged and towers can be compared seed for seed.
        self.history_tower = build_history_tower(data, config, device)
        self._sparse_keys = [t.feature_names[0] for t in tables]

    def forward(
        self, dense: torch.Tensor, sparse: KeyedJaggedTensor, history: KeyedJaggedTensor
    ) -> torch.Tensor:
        pooled = self.sparse_arch(sparse).to_dict()
        vectors = [pooled[k] for k in self._sparse_keys]
        vectors.append(self.history_tower(history))
        return self.interaction(dense, torch.stack(vectors, dim=1))


def batch_to_kjts(batch: Batch) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor]:
    """Turn a plain Batch into the two KeyedJaggedTensors the model's collections take."""
    size, num_cat = batch.cat.shape
    keys = [f"cat{i}" for i in range(num_cat)] + [ITEM_FEATURE]
    # Feature-major layout: all rows of cat0, then cat1, ..., then item; one id per row each.
    values = torch.cat([batch.cat.t().reshape(-1), batch.item])
    lengths = torch.ones(size * (num_cat + 1), dtype=torch.int32)
    sparse = KeyedJaggedTensor(keys=keys, values=values, lengths=lengths.to(values.device))
    history = KeyedJaggedTensor(
        keys=[HISTORY_FEATURE],
        values=batch.history_values,
        offsets=batch.history_offsets,
    )
    return sparse, history
