"""PyTorch's native checkpoint staging, made to accept TorchRec's ShardedTensors.

DCP's ``DefaultStager`` copies a state dict into reusable CPU buffers (pinned and shared
memory, non-blocking copies on a side stream on GPU), but it calls ``data_ptr()`` on every
tensor, which TorchRec's (legacy) ShardedTensor refuses. So the sharded tensors' local
shards go through the DefaultStager as plain tensors, and the staged copies are wrapped
back into ShardedTensors with the original global metadata: the copy engine stays
PyTorch's own, and DCP still sees ShardedTensors it can reshard on load.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions


def _split(tree: Any, sharded: dict[int, ShardedTensor]) -> Any:
    """Copy of the nested dict with each ShardedTensor replaced by the list of its local
    shard tensors (remembered in ``sharded`` by the list's id)."""
    if isinstance(tree, ShardedTensor):
        local = [shard.tensor for shard in tree.local_shards()]
        holder = {"__sharded_local__": local}
        sharded[id(holder)] = tree
        return holder
    if isinstance(tree, dict):
        return {key: _split(value, sharded) for key, value in tree.items()}
    return tree


def _join(staged: Any, original: Any, sharded: dict[int, ShardedTensor]) -> Any:
    """Rebuild ShardedTensors around the staged local shards, walking both trees together."""
    if isinstance(original, dict) and "__sharded_local__" in original:
        source = sharded[id(original)]
        shards = [
            Shard(tensor=tensor, metadata=shard.metadata)
            for tensor, shard in zip(
                staged["__sharded_local__"], source.local_shards(), strict=True
            )
        ]
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, source.metadata(), process_group=source._process_group
        )
    if isinstance(original, dict):
        return {key: _join(staged[key], original[key], sharded) for key in original}
    return staged


class Staging:
    """One staging copy. ``copied`` completes once the copy is done, so the weights may
    change again; ``state_dict()`` then gives the staged state with its ShardedTensors
    rebuilt. Rebuilding is left to whoever writes the checkpoint, off the training thread."""

    def __init__(self, copied: Future[Any], plain: Any, sharded: dict[int, ShardedTensor]):
        self.copied = copied
        self._plain, self._sharded = plain, sharded

    def state_dict(self) -> dict[str, Any]:
        return _join(self.copied.result(), self._plain, self._sharded)


class ShardedStateStager(AsyncStager):
    """A DefaultStager that also stages ShardedTensors (see the module docstring)."""

    def __init__(self, options: StagingOptions) -> None:
        self._inner = DefaultStager(options)

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._inner.should_synchronize_after_execute

    def begin(self, state_dict: dict[str, Any]) -> Staging:
        """Start copying ``state_dict``: in the background with async staging, else now."""
        sharded: dict[int, ShardedTensor] = {}
        plain = _split(state_dict, sharded)
        staged = self._inner.stage(plain)
        if not isinstance(staged, Future):
            done: Future[Any] = Future()
            done.set_result(staged)
            staged = done
        return Staging(staged, plain, sharded)

    def stage(self, state_dict: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        """The AsyncStager interface (``dcp.async_save``): the staged state, once copied."""
        return self.begin(state_dict).state_dict()

    def synchronize_staging(self) -> None:
        self._inner.synchronize_staging()

    def close(self) -> None:
        self._inner.close()
