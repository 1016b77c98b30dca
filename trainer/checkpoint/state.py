"""What goes into a checkpoint, as tensors only, and the objects it is read from.

DCP loads tensors with ``torch.load(weights_only=True)`` but unpickles any other object it
finds in a state dict, so nothing but tensors goes into the DCP part: optimizer
hyper-parameters come from the config, and the step and data position are written as JSON.

The trainer hands the checkpointer its state once, as named objects with ``state_dict()``
(as torchtitan's ``CheckpointManager`` takes ``states``); every save reads them. The same
names serve restore, so saving and loading cannot disagree on what a checkpoint holds.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class Stateful(Protocol):
    """What a save reads: the state of one part of training, as a (nested) dict."""

    def state_dict(self) -> dict[str, Any]: ...


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


def tensor_states(model: torch.nn.Module, optimizer: Any, rank: int) -> dict[str, Any]:
    """The parts whose tensors go to DCP, by the key each is saved under."""
    return {"model": model, "optim": OptimizerTensors(optimizer), f"rng_rank{rank}": RngState()}


def app_state(model: torch.nn.Module, optimizer: Any, rank: int) -> dict[str, Any]:
    """The live state dict handed to DCP for load (filled in place)."""
    return {key: part.state_dict() for key, part in tensor_states(model, optimizer, rank).items()}


def apply_loaded(model: torch.nn.Module, optimizer: Any, state: dict[str, Any], rank: int) -> None:
    """Push a state dict filled in place by ``dcp.load`` back into model, optimizer, RNG."""
    for key, part in tensor_states(model, optimizer, rank).items():
        part.load_state_dict(state[key])
