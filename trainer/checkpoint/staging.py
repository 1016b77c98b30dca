"""Checkpoint staging: copy the state to host memory while training goes on.

TorchRec's (legacy) ShardedTensor refuses ``data_ptr()``, which every copy engine calls, so
the sharded tensors' local shards are staged as plain tensors and the staged copies are
wrapped back into ShardedTensors with the original global metadata: DCP still sees
ShardedTensors it can reshard on load.

Two copy engines:

* On a GPU with async staging, ``SideStreamCopy``: the training thread enqueues the copies
  and returns at once; the loop never waits for them.
  - ``snapshot`` (when the state fits in half the free device memory): a device-to-device
    copy into cached device buffers on the compute stream (GPU memory bandwidth: the
    fastest copy there is), then device-to-host copies from those buffers into cached
    pinned host buffers on a side CUDA stream. The next forward/backward runs while the
    host copies are in flight: it changes the weights, never the snapshot.
  - ``ordered`` (the state does not fit twice): the host copies read the live weights on
    the side stream, and the compute stream waits for them (an event, not the host)
    before its next kernel: no extra device memory, no overlap with the next step.
  Whoever writes the checkpoint (the checkpointer's background thread) waits on the
  copies' event.
* Otherwise, DCP's ``DefaultStager`` (reusable CPU buffers, its own thread; on a GPU
  without async staging, pinned memory and non-blocking copies): the reference that
  ``benchmarks/bench_staging.py`` measures the side stream against.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions

SNAPSHOT_FREE_FRACTION = 0.5  # snapshot on the device only if it takes at most this share


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


def local_tensors(tree: Any) -> Any:
    """The nested dict with each ShardedTensor as the list of its local shard tensors (under
    ``__sharded_local__``): what a rank holds of it, without copying anything."""
    return _split(tree, {})


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
    """One staging copy. ``copied`` completes once the weights may change again (the copy
    is done, or the device orders it before any change); ``state_dict()`` then gives the
    staged state with its ShardedTensors rebuilt, once the copy has landed in host memory
    (``ready``). Both are left to whoever writes the checkpoint, off the training thread."""

    def __init__(
        self,
        copied: Future[Any],
        plain: Any,
        sharded: dict[int, ShardedTensor],
        ready: Callable[[], None] = lambda: None,
    ):
        self.copied = copied
        self._plain, self._sharded, self._ready = plain, sharded, ready

    def staged(self) -> Any:
        """The staged copy as plain tensors (a ShardedTensor as the list of its local
        shards, under ``__sharded_local__``), once it has landed in host memory."""
        staged = self.copied.result()
        self._ready()
        return staged

    def state_dict(self) -> dict[str, Any]:
        return _join(self.staged(), self._plain, self._sharded)


def _leaves(tree: Any, path: tuple = ()) -> list[tuple[tuple, torch.Tensor]]:
    """(path, tensor) of every tensor leaf of a nested dict/list, in a stable order."""
    if isinstance(tree, torch.Tensor):
        return [(path, tree)]
    if isinstance(tree, dict):
        return [leaf for k, v in tree.items() for leaf in _leaves(v, (*path, k))]
    if isinstance(tree, list | tuple):
        return [leaf for i, v in enumerate(tree) for leaf in _leaves(v, (*path, i))]
    return []


class StateChanged(RuntimeError):
    """A copy of the live state that the loop changed while it was being made: not a state
    the job was ever in, so it is never written."""


class VersionGuard:
    """What a copy made while the loop runs on must not see: a change of the tensors it
    reads. A host copy of the live state runs on its own thread through the next step's
    forward (the loop waits for it only before backward, when the weights change); it is a
    consistent state only if no tensor it reads was changed in place meanwhile. An in-place
    op bumps its tensor's version counter: the guard keeps the counters of the host tensors
    as the copy began. Not every kernel does (native BatchNorm updates its running
    statistics without), which is why a model with buffers copies before its forward
    (``CheckpointStates.buffers``): this guard is the second line. Device tensors need no
    guard: their copy is ordered on the device before any later kernel (``SideStreamCopy``).

    ``sound`` is False when a tensor has no counter (an inference tensor): such a copy must
    complete before the loop goes on."""

    def __init__(self, tree: Any) -> None:
        self._seen: list[tuple[torch.Tensor, int]] = []
        self.sound = True
        for _, tensor in _leaves(tree):
            if tensor.device.type != "cpu":
                continue
            try:
                self._seen.append((tensor, tensor._version))
            except RuntimeError:  # an inference tensor keeps no version counter
                self.sound = False

    def changed(self) -> int:
        """How many of the guarded tensors were changed in place since the copy began."""
        return sum(1 for tensor, version in self._seen if tensor._version != version)


def _replace(tree: Any, staged: dict[tuple, torch.Tensor], path: tuple = ()) -> Any:
    """The tree with each tensor leaf replaced by its staged copy."""
    if isinstance(tree, torch.Tensor):
        return staged[path]
    if isinstance(tree, dict):
        return {k: _replace(v, staged, (*path, k)) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_replace(v, staged, (*path, i)) for i, v in enumerate(tree))
    return tree


class SideStreamCopy:
    """Copies a state dict into cached host buffers without blocking the training thread
    (see the module docstring). CPU tensors are copied at once; CUDA tensors are copied to
    pinned memory on a side stream, from a device snapshot when ``snapshot`` allows.

    ``snapshot``: True, False, or None to decide per copy from the free device memory.
    Buffers are kept per leaf path and reused while shape and dtype stay the same.
    """

    def __init__(self, snapshot: bool | None = None) -> None:
        self.snapshot = snapshot
        self._host: dict[tuple, torch.Tensor] = {}
        self._device: dict[tuple, torch.Tensor] = {}
        self._stream: torch.cuda.Stream | None = None
        self._done: torch.cuda.Event | None = None  # the last copy's completion
        self.last_mode = ""  # "cpu", "snapshot" or "ordered": what the last copy did

    @staticmethod
    def _buffer(cache: dict, path: tuple, like: torch.Tensor, **kw: Any) -> torch.Tensor:
        buf = cache.get(path)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = torch.empty(like.shape, dtype=like.dtype, **kw)
            cache[path] = buf
        return buf

    def _use_snapshot(self, cuda: list[torch.Tensor]) -> bool:
        if self.snapshot is not None:
            return self.snapshot
        need = sum(t.numel() * t.element_size() for t in cuda)
        cached = sum(b.numel() * b.element_size() for b in self._device.values())
        free, _ = torch.cuda.mem_get_info(cuda[0].device)
        return need <= cached or need <= SNAPSHOT_FREE_FRACTION * (free + cached)

    def copy(self, tree: Any) -> tuple[Any, Callable[[], None]]:
        """Enqueue the copy of ``tree``; returns the staged tree (valid once the returned
        ``ready`` has returned) and ``ready``. The weights may change as soon as this returns."""
        leaves = _leaves(tree)
        staged: dict[tuple, torch.Tensor] = {}
        cuda = [(p, t) for p, t in leaves if t.is_cuda]
        for path, t in leaves:
            if not t.is_cuda:
                staged[path] = self._buffer(self._host, path, t).copy_(t)
        if not cuda:
            self.last_mode = "cpu"
            return _replace(tree, staged), lambda: None
        compute = torch.cuda.current_stream(cuda[0][1].device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(cuda[0][1].device)
        if self._done is not None:  # the buffers are free only once the last copy is done
            compute.wait_event(self._done)
        snapshot = self._use_snapshot([t for _, t in cuda])
        sources = {}
        for path, t in cuda:
            if snapshot:  # on the compute stream: ordered before any later change
                sources[path] = self._buffer(self._device, path, t, device=t.device).copy_(t)
            else:
                sources[path] = t
        self._stream.wait_stream(compute)  # the copies see the finished step
        with torch.cuda.stream(self._stream):
            for path, src in sources.items():
                host = self._buffer(self._host, path, src, pin_memory=True)
                staged[path] = host.copy_(src, non_blocking=True)
                src.record_stream(self._stream)  # not reused by the allocator before done
            done = torch.cuda.Event()
            done.record(self._stream)
        if not snapshot:
            compute.wait_event(done)  # the next kernel that may change them waits
            self._device.clear()
        self._done, self.last_mode = done, "snapshot" if snapshot else "ordered"
        return _replace(tree, staged), done.synchronize

    def close(self) -> None:
        if self._done is not None:
            self._done.synchronize()
        self._host.clear()
        self._device.clear()


class ShardedStateStager(AsyncStager):
    """Stages state dicts with ShardedTensors (see the module docstring). ``engine``:
    "side_stream", "dcp" (DefaultStager), or None: the side stream on a GPU with async
    staging, else DCP's."""

    def __init__(self, options: StagingOptions, engine: str | None = None) -> None:
        if engine is None:
            gpu = torch.cuda.is_available()
            engine = "side_stream" if gpu and options.use_async_staging else "dcp"
        if engine not in ("side_stream", "dcp"):
            raise ValueError(f"staging engine must be 'side_stream' or 'dcp', got {engine!r}")
        self.engine = engine
        self._copy = SideStreamCopy() if engine == "side_stream" else None
        self._inner = DefaultStager(options) if engine == "dcp" else None

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._inner.should_synchronize_after_execute if self._inner else False

    def begin(self, state_dict: dict[str, Any]) -> Staging:
        """Start copying ``state_dict``: in the background with async staging, else now."""
        sharded: dict[int, ShardedTensor] = {}
        plain = _split(state_dict, sharded)
        if self._copy is not None:
            staged_tree, ready = self._copy.copy(plain)
            copied: Future[Any] = Future()
            copied.set_result(staged_tree)
            return Staging(copied, plain, sharded, ready)
        assert self._inner is not None
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
        if self._inner is not None:
            self._inner.synchronize_staging()

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()
        if self._copy is not None:
            self._copy.close()
