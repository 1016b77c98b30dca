"""What goes into a checkpoint, as tensors only, and the objects it is read from and loaded into.

DCP loads tensors with ``torch.load(weights_only=True)`` but unpickles any other object it
finds in a state dict, so nothing but tensors goes into the DCP part: optimizer
hyper-parameters come from the config, and the step and the data position are written as
this rank's JSON state (a part wrapped in ``RankState``).

The trainer hands the checkpointer its state once (``CheckpointStates``), as named objects
with ``state_dict()`` and ``load_state_dict()``, as torchtitan's ``CheckpointManager`` takes
its ``states``: every save reads them and every restore loads into them, so saving and
loading cannot disagree on what a checkpoint holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch

MODEL = "model"  # the part a warm start loads alone
LOADER = "loader"  # the data position, in this rank's JSON state


def rng_key(rank: int) -> str:
    """The key a rank's RNG state is saved under."""
    return f"rng_rank{rank}"


class Stateful(Protocol):
    """One part of training, as a (nested) dict: read by a save, filled back by a restore."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def tensors_only(tree: Any) -> Any:
    """The nested dict with every non-tensor leaf dropped (torch's optimizers keep ``step``
    as a tensor, so it still round-trips exactly)."""
    if isinstance(tree, torch.Tensor):
        return tree
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            kept = tensors_only(value)
            if isinstance(kept, torch.Tensor) or kept:
                out[key] = kept
        return out
    return None


class OptimizerTensors:
    """The optimizer's per-parameter tensors; its hyper-parameters come from the config."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        return tensors_only({"state": self.optimizer.state_dict()["state"]})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        full = self.optimizer.state_dict()
        for key, values in state.get("state", {}).items():
            full["state"][key].update(values)
        self.optimizer.load_state_dict(full)

    def prepare_load(self) -> None:
        """TorchRec's optimizers create their state at their first step, and DCP loads in
        place: the state must exist before a load reads into it (``init_state``, a step of
        zeros that the load then overwrites)."""
        init_state = getattr(self.optimizer, "init_state", None)
        if init_state is not None:
            init_state()


class RngState:
    """This process's random number generators (CPU, and CUDA when there is one)."""

    def state_dict(self) -> dict[str, Any]:
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])


class RankState:
    """A part saved in this rank's JSON state beside the step, not by DCP: small plain data
    that belongs to one rank and is never resharded (the data position)."""

    def __init__(self, part: Stateful) -> None:
        self.part = part

    def state_dict(self) -> dict[str, Any]:
        return self.part.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.part.load_state_dict(state)


def train_states(model: torch.nn.Module, optimizer: Any, loader: Stateful, rank: int) -> dict:
    """What the trainer's checkpoints hold, by the key each part is saved under."""
    return {
        MODEL: model,
        "optim": OptimizerTensors(optimizer),
        rng_key(rank): RngState(),
        LOADER: RankState(loader),
    }


class CheckpointStates:
    """The registered parts: those whose tensors DCP saves and loads, and those in this
    rank's JSON state (``RankState``). The objects are the live ones training changes in
    place, read at each save and filled at each restore."""

    def __init__(self, states: Mapping[str, Stateful]) -> None:
        for key, part in states.items():
            if not callable(getattr(part, "state_dict", None)):
                raise TypeError(
                    f"checkpoint state {key!r} has no state_dict(): {type(part).__name__}"
                )
        self.tensors = {k: p for k, p in states.items() if not isinstance(p, RankState)}
        self.rank = {k: p for k, p in states.items() if isinstance(p, RankState)}

    def read(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The state as of now: the tensors for DCP, and this rank's JSON state."""
        tensors = {key: part.state_dict() for key, part in self.tensors.items()}
        return tensors, {key: part.state_dict() for key, part in self.rank.items()}

    def buffers(self) -> list[str]:
        """The persistent buffers of the registered modules: state that a forward pass may
        change (BatchNorm's running statistics), unlike parameters and optimizer state,
        which change only in backward and the optimizer's step."""
        found = []
        for key, part in self.tensors.items():
            if not isinstance(part, torch.nn.Module):
                continue
            for prefix, module in part.named_modules():
                for name in module._buffers:
                    if name not in module._non_persistent_buffers_set:
                        found.append(f"{key}.{prefix}.{name}" if prefix else f"{key}.{name}")
        return found

    def load_target(self) -> dict[str, Any]:
        """The tensor state for DCP to fill in place (``load`` then hands it back)."""
        for part in self.tensors.values():
            prepare = getattr(part, "prepare_load", None)
            if prepare is not None:
                prepare()
        return {key: part.state_dict() for key, part in self.tensors.items()}

    def load(self, target: dict[str, Any], only: tuple[str, ...] | None = None) -> None:
        """Push a target filled by ``dcp.load`` back into the parts (``only``: those keys)."""
        for key, part in self.tensors.items():
            if only is None or key in only:
                part.load_state_dict(target[key])

    def load_rank_state(self, state: Mapping[str, Any]) -> None:
        """Put this rank's JSON parts back where a checkpoint's JSON state says."""
        for key, part in self.rank.items():
            part.load_state_dict(state[key])
