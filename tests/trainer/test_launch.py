"""The launcher's own departures from torchrun that need no process to check."""

from __future__ import annotations

import time

from torch.distributed.elastic.rendezvous import dynamic_rendezvous

from trainer import launch


def test_a_single_node_joins_without_the_random_delay_but_keeps_the_fixed_back_off(
    monkeypatch,
):
    """torchrun sleeps a random 0-0.3 s (a range) before a node's first join: for one node
    that is Time to Start for nothing. Its fixed back-off between retries (a number) must
    stay, or a failing join would spin."""
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    # Patched by the launcher for the rest of its process: restored after this test.
    monkeypatch.setattr(dynamic_rendezvous, "_delay", dynamic_rendezvous._delay)
    launch._no_join_jitter()
    dynamic_rendezvous._delay(seconds=(0.2, 0.3))
    assert slept == []
    dynamic_rendezvous._delay(seconds=1)
    assert slept == [1]
