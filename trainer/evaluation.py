"""Holdout evaluation: AUC and log-loss over every rank's share of the holdout rows.

Every rank evaluates the same number of batches (collectives inside the sharded model need
it), then predictions are gathered so all ranks report the same numbers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torchmetrics.functional.classification import binary_auroc

from trainer.data.batch import Batch
from trainer.model import batch_to_kjts


def auc_and_logloss(probs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    eps = 1e-7
    p = probs.double().clamp(eps, 1 - eps)
    y = labels.double()
    logloss = -(y * p.log() + (1 - y) * (1 - p).log()).mean()
    return {"auc": float(binary_auroc(probs, labels.long())), "logloss": float(logloss)}


@torch.no_grad()
def predict(model: nn.Module, batches: list[Batch], device: torch.device) -> torch.Tensor:
    """Click probabilities for this rank's batches, concatenated."""
    was_training = model.training
    model.eval()
    out = []
    for batch in batches:
        batch = batch.to(device)
        sparse, history = batch_to_kjts(batch)
        out.append(torch.sigmoid(model(batch.dense, sparse, history)).float().cpu())
    model.train(was_training)
    return torch.cat(out) if out else torch.empty(0)


def _gather(tensor: torch.Tensor) -> torch.Tensor:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor)
    return torch.cat(parts)


def evaluate(model: nn.Module, batches: list[Batch], device: torch.device) -> dict[str, float]:
    """Holdout AUC, log-loss and row count, identical on every rank."""
    probs = predict(model, batches, device)
    labels = torch.cat([b.labels for b in batches]) if batches else torch.empty(0)
    probs, labels = _gather(probs), _gather(labels)
    return {**auc_and_logloss(probs, labels), "rows": float(labels.numel())}
