"""A checkpoint's model part -> one unsharded RankingModel on CPU, whatever world size wrote it.

Shared by the publisher (publish/load.py) and the async evaluator (trainer/checkpoint_evaluator.py):
both read a checkpoint written by N ranks, whose embedding tables are sharded table-wise
across them, into a single process without a process group. DCP's ``no_dist=True`` load
reshards those shards into the plain tensors of one model. Verifying the files against the
manifest is the caller's job, BEFORE this deserialises anything (restore.fetch does it).
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from infra.settings import JobConfig
from trainer.model import RankingModel


def cpu_model(config: JobConfig) -> RankingModel:
    """The job's model, unsharded, on CPU (its weights are overwritten by a load)."""
    return RankingModel(config.data, config.model, device=torch.device("cpu"))


def load_model_weights(local_dir: str, model: nn.Module) -> None:
    """Fill ``model`` in place from the checkpoint's ``model`` part in ``local_dir``.

    Every weight of the model is read, so a model reused across checkpoints never mixes
    two of them once a load has returned. DCP wraps a reader's error in CheckpointException
    (a BaseException): callers catch it alongside OSError/RuntimeError.
    """
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=local_dir, no_dist=True)
    model.load_state_dict(state["model"])
