"""Fixtures shared by the checkpoint tests."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from infra.devstack import servers


@pytest.fixture(scope="module")
def group() -> Iterator[dist.ProcessGroup]:
    """A one-rank gloo process group and a checkpoint group on it, as the trainer has."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(servers.free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield dist.new_group(backend="gloo")
    finally:
        dist.destroy_process_group()
