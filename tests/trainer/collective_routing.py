"""The real trainer in a simulated GPU world, recording every collective it issues.

Run by tests/trainer/test_collective_routing.py as the torchrun entry point instead of
``-m trainer``. There is no NCCL on a CPU machine, so each group is created with the device
map the trainer asks for and NCCL swapped for gloo: the default group the trainer asks for
on a GPU, "cpu:gloo,cuda:nccl", becomes "cpu:gloo,cuda:gloo", and a group asked for as
"nccl" becomes "cuda:gloo", which fails on CPU tensors exactly as NCCL does. The device is
the CPU, but the backend strings are the GPU's (``process_group_backend(cuda)``).

Each Python-level collective (torch.distributed.*) is logged to
``$ETT_COLLECTIVE_LOG/rank{r}.jsonl``: its name, the backend string asked for its group,
the device types of its tensors, whether that backend serves them, its thread and times.
DDP's gradient all-reduce runs in C++ and is not seen (it reduces device tensors).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from trainer import distributed as tdist
from trainer import init_stages

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
    "isend",
    "irecv",
)
# Object collectives pick their own device from the group (the CPU when it has gloo);
# barriers pick theirs too: neither can be misrouted by the caller.
DEVICE_AGNOSTIC = {
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "barrier",
    "monitored_barrier",
}
WORLD = "WORLD"

_asked: dict[Any, str] = {}  # group (WORLD for the default) -> the backend string asked for
_lock = threading.Lock()


def simulated(backend: str) -> str:
    """The same device map with NCCL swapped for gloo."""
    served = tdist.backend_devices(backend)
    return ",".join(f"{dev}:{'gloo' if b == 'nccl' else b}" for dev, b in served.items())


def _tensors(values: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, list | tuple):
            out += _tensors(value)
    return out


def _write(record: dict[str, Any]) -> None:
    path = os.path.join(os.environ["ETT_COLLECTIVE_LOG"], f"rank{os.environ['RANK']}.jsonl")
    with _lock, open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")


def _checked(name: str, fn: Any) -> Any:
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind_partial(*args, **kwargs).arguments
        group = bound.get("group")
        key = WORLD if group is None or group is dist.group.WORLD else group
        asked = _asked.get(key, "unknown")
        devices = sorted({t.device.type for t in _tensors(bound.values())})
        served = tdist.backend_devices(asked) if asked != "unknown" else {}
        routed = name in DEVICE_AGNOSTIC or all(d in served for d in devices)
        start = time.time()
        try:
            return fn(*args, **kwargs)
        finally:
            _write(
                {
                    "op": name,
                    "group": "WORLD" if key == WORLD else getattr(group, "group_name", "?"),
                    "asked": asked,
                    "devices": devices,
                    "routed": routed,
                    "thread": threading.current_thread().name,
                    "start": start,
                    "end": time.time(),
                }
            )

    return call


def install() -> None:
    """Patch the trainer's device choice and torch.distributed (see the module docstring)."""
    gpu_backend = tdist.process_group_backend(torch.device("cuda"))

    def select_device(choice: str) -> tuple[torch.device, str]:
        return torch.device("cpu"), gpu_backend

    init_stages.select_device = select_device
    original_init, original_new_group = dist.init_process_group, dist.new_group

    def init_process_group(backend: str | None = None, **kwargs: Any) -> None:
        asked = backend or gpu_backend
        original_init(backend=simulated(asked), **kwargs)
        _asked[WORLD] = asked

    new_group_sig = inspect.signature(original_new_group)

    def new_group(*args: Any, **kwargs: Any) -> Any:
        bound = new_group_sig.bind_partial(*args, **kwargs).arguments
        asked = bound.get("backend") or _asked[WORLD]  # torch: None inherits the default's
        group = original_new_group(**{**bound, "backend": simulated(asked)})
        _asked[group] = asked
        return group

    dist.init_process_group, dist.new_group = init_process_group, new_group
    for name in COLLECTIVES:
        setattr(dist, name, _checked(name, getattr(dist, name)))


if __name__ == "__main__":
    install()
    from trainer.train import main

    sys.exit(main(sys.argv[1:]))
