"""What a checkpoint holds (trainer/checkpoint/state.py): tensors only, and loading it back
into the registered states puts model, optimizer and RNG exactly where they were."""

from __future__ import annotations

import copy

import torch

from tests.factories import HeldState
from trainer.checkpoint.state import CheckpointStates, tensors_only, train_states


def test_only_tensors_go_into_the_checkpoint() -> None:
    t = torch.ones(2)
    tree = {"a": t, "b": {"lr": 0.1, "c": t, "empty": {"x": "y"}}, "d": None, "e": {}}
    assert tensors_only(tree) == {"a": t, "b": {"c": t}}
    assert tensors_only(3.0) is None


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    loss = model(torch.rand(8, 4)).square().mean()  # draws from the RNG too
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def test_registered_states_round_trip_model_optimizer_and_rng() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    loader = HeldState({"shard_pos": 7})
    states = CheckpointStates(train_states(model, optimizer, loader, rank=3))
    _step(model, optimizer)
    tensors, rank_state = states.read()
    saved = copy.deepcopy(tensors)
    assert set(saved) == {"model", "optim", "rng_rank3"}
    assert rank_state == {"loader": {"shard_pos": 7}}  # JSON beside the step, not DCP
    assert all(
        isinstance(v, torch.Tensor) for s in saved["optim"]["state"].values() for v in s.values()
    )
    expected = torch.rand(5)  # what the RNG gives next, from the saved state

    _step(model, optimizer)  # everything moves on
    states.load(saved)
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved["model"][key]), key
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            assert torch.equal(value, saved["optim"]["state"][index][key]), (index, key)
    assert optimizer.state_dict()["param_groups"][0]["lr"] == 0.1  # from the config, kept
    assert torch.equal(torch.rand(5), expected)
