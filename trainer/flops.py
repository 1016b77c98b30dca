"""Model FLOPs of a training step, counted analytically at the batch's real history lengths.

MFU (infra/accounting/mfu.py) divides these by the device's peak. Only matrix products count, as in
the usual MFU definition: the MLPs, the pairwise dot interaction, the attention tower's
projections and its attention (QK^T and PV over each jagged sequence at its own length,
never the padded one). Embedding lookups, norms and the optimizers are memory-bound and
left out. Backward is twice the forward (input and weight gradients), except for layers
whose input needs no gradient (the first dense layer: weight gradients only).

The count is linear in three numbers of a batch: rows, history items, and the sum of
squared history lengths (attention pairs), so a step's FLOPs cost three integer sums over
its offsets; ``tests/trainer/test_flops.py`` checks the formula against
``torch.utils.flop_counter`` on the real model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from infra.accounting.ledger import Ledger
from infra.accounting.ledger_format import Mark
from infra.accounting.mfu import cpu_model
from infra.settings import DataConfig, JobConfig, ModelConfig


def _linear(fan_in: int, fan_out: int) -> int:
    return 2 * fan_in * fan_out


def _mlp(sizes: list[int]) -> list[int]:
    return [_linear(a, b) for a, b in zip(sizes[:-1], sizes[1:], strict=True)]


@dataclass(frozen=True)
class ModelFlops:
    """Training FLOPs (forward + backward) per row, per history item and per attention
    pair (query, key) of one sequence; a row with history length L costs
    ``per_row + per_item * L + per_pair * L**2``."""

    per_row: int
    per_item: int
    per_pair: int

    @classmethod
    def of(cls, data: DataConfig, model: ModelConfig) -> ModelFlops:
        dim = model.embedding_dim
        vectors = len(data.cat_vocab_sizes) + 3  # dense, categorical, item, history
        dense = _mlp([data.num_dense, *model.dense_arch])
        over_in = dim + vectors * (vectors - 1) // 2
        over = [*_mlp([over_in, *model.over_arch]), _linear(model.over_arch[-1], 1)]
        interaction = 2 * vectors * vectors * dim  # one bmm [N, D] x [D, N]
        # Forward, plus input and weight gradients (the first layer's input is data).
        per_row = 2 * dense[0] + 3 * (sum(dense[1:]) + interaction + sum(over))
        per_item = per_pair = 0
        if model.history_tower == "attention":
            per_item = 3 * (_linear(dim, 3 * dim) + _linear(dim, dim) + _linear(dim, 1))
            per_pair = 3 * 4 * dim  # QK^T and PV, 2 * dim each, summed over the heads
        return cls(per_row, per_item, per_pair)

    def of_lengths(self, lengths: np.ndarray) -> np.ndarray:
        """FLOPs of each row (int64) from its history length."""
        n = lengths.astype(np.int64)
        return self.per_row + self.per_item * n + self.per_pair * n * n

    def of_batch(self, offsets: torch.Tensor) -> int:
        """FLOPs of one training step on a batch with these history offsets [B + 1]."""
        n = np.diff(offsets.cpu().numpy())  # the loader's batches are on the CPU: no copy
        rows, items, pairs = n.size, int(n.sum()), int((n * n).sum())
        return self.per_row * rows + self.per_item * items + self.per_pair * pairs


def device_attrs(device: torch.device, world_size: int) -> dict[str, Any]:
    """What the steps run on, as infra/accounting/mfu.py looks up its peak: device type and name,
    matmul dtype (the model trains in fp32; TF32 when torch allows it on CUDA), threads."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        dtype = "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    else:
        name, dtype = cpu_model(), "fp32"
    return {
        "device": device.type,
        "device_name": name,
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "world_size": world_size,
    }


def record_model_flops(
    ledger: Ledger, config: JobConfig, device: torch.device, world_size: int
) -> ModelFlops:
    """Mark the attempt's device and FLOP coefficients in the ledger; returns the counter
    whose ``of_batch`` gives each step's ``flops`` attr."""
    flops = ModelFlops.of(config.data, config.model)
    ledger.mark(Mark.MODEL_FLOPS, **device_attrs(device, world_size), **asdict(flops))
    return flops
