"""What goes into a checkpoint, as tensors only.

DCP loads tensors with ``torch.load(weights_only=True)`` but unpickles any other object it
finds in a state dict, so nothing but tensors goes into the DCP part: optimizer
hyper-parameters come from the config, and the step and data position are written as JSON.
"""

from __future__ import annotations

from typing import Any

import torch


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


def app_state(model: torch.nn.Module, optimizer: Any, rank: int) -> dict[str, Any]:
    """The live state dict handed to DCP for save and (in place) for load."""
    return {
        "model": model.state_dict(),
        "optim": tensors_only({"state": optimizer.state_dict()["state"]}),
        f"rng_rank{rank}": rng_state(),
    }


def rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def apply_loaded(model: torch.nn.Module, optimizer: Any, state: dict[str, Any], rank: int) -> None:
    """Push a state dict filled in place by ``dcp.load`` back into model, optimizer, RNG."""
    model.load_state_dict(state["model"])
    full = optimizer.state_dict()
    for key, values in state["optim"].get("state", {}).items():
        full["state"][key].update(values)
    optimizer.load_state_dict(full)
    rng = state[f"rng_rank{rank}"]
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
