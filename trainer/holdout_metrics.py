"""Holdout evaluation: AUC and log-loss over every rank's share of the holdout rows.

Every rank evaluates the same number of batches (collectives inside the sharded model need
it), then predictions are gathered so all ranks report the same numbers. They are gathered
as CPU tensors, so on a group with a CPU backend (``DistEnv.cpu_group``): under NCCL alone
this gather would fail.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from trainer.data.batch import Batch
from trainer.distributed import has_cpu_backend
from trainer.model import batch_to_kjts


def auc_and_logloss(probs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    # Imported here: every trainer imports this module before its first step, and only
    # inline eval, the side evaluator and publishing compute an AUC (torchmetrics takes
    # ~0.6 s to import on a small CPU host, on the Time to Start's critical path).
    from torchmetrics.functional.classification import binary_auroc

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


def _gather(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's ``tensor`` (CPU, same shape on every rank), concatenated in rank order."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return tensor
    if not has_cpu_backend(group):
        raise RuntimeError(
            f"evaluation gathers CPU tensors, but its group's backend "
            f"{dist.get_backend_config(group)!r} has none for CPU: pass DistEnv.cpu_group"
        )
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor, group=group)
    return torch.cat(parts)


def evaluate(
    model: nn.Module,
    batches: list[Batch],
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """Holdout AUC, log-loss and row count, identical on every rank; ``group`` gathers the
    CPU predictions (None: the default group, which must have a CPU backend)."""
    probs = predict(model, batches, device)
    labels = torch.cat([b.labels for b in batches]) if batches else torch.empty(0)
    probs, labels = _gather(probs, group), _gather(labels, group)
    return {**auc_and_logloss(probs, labels), "rows": float(labels.numel())}
