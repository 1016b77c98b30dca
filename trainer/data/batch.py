"""The batch handed from the data loader to the model: plain tensors, no TorchRec types.

Keeping TorchRec out of the data layer lets the loader, the publisher and the tests build
batches without a process group; the trainer turns a Batch into a KeyedJaggedTensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import numpy as np
import torch


@dataclass
class Batch:
    """One mini-batch of click-log rows.

    dense:           float32 [B, num_dense]
    cat:             int64   [B, num_cat], one id per categorical feature, in [0, vocab_f)
    item:            int64   [B], the candidate item, in [0, item_vocab_size)
    history_values:  int64   [sum of lengths], the user's past item ids, concatenated
    history_offsets: int64   [B + 1], row i's history is values[offsets[i]:offsets[i+1]]
    labels:          float32 [B], click (1.0) or not (0.0)
    """

    dense: torch.Tensor
    cat: torch.Tensor
    item: torch.Tensor
    history_values: torch.Tensor
    history_offsets: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        return Batch(*(fn(getattr(self, f.name)) for f in fields(self)))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        """Page-locked copy so the host-to-GPU copy can overlap compute (GPU only)."""
        return self._map(torch.Tensor.pin_memory)

    def row_digest(self) -> int:
        """An order-free digest of the batch's rows (a sum of per-row hashes, mod 2**64):
        the ranks' digests of one global batch add up (mod 2**64) to the global batch's, however its
        rows were split or re-dealt, so runs on different world sizes can be compared."""
        bits = self.dense.contiguous().view(torch.int32).numpy().astype(np.uint64)
        words = np.concatenate([bits, self.cat.numpy().astype(np.uint64)], axis=1)
        mults = (np.arange(words.shape[1], dtype=np.uint64) * 2 + 1) * np.uint64(0x9E3779B97F4A7C15)
        with np.errstate(over="ignore"):
            row = (words * mults).sum(axis=1, dtype=np.uint64)
            row ^= row >> np.uint64(31)
            row *= np.uint64(0xBF58476D1CE4E5B9)
            row ^= row >> np.uint64(29)
            return int(row.sum(dtype=np.uint64))
