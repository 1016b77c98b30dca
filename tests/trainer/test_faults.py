"""The slow-host fault: ``ETT_FAULT_STEP_DELAY_S`` is read once, and a value that is not a
usable number is ignored (with a warning), never a reason for a rank to fail."""

from __future__ import annotations

import logging

import pytest

from trainer.faults import ENV_STEP_DELAY, FaultInjector


@pytest.mark.parametrize(
    ("value", "delay"), [("0.25", 0.25), ("", 0.0), ("-1", 0.0), ("fast", 0.0)]
)
def test_the_step_delay_comes_from_the_environment(
    value: str, delay: float, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(ENV_STEP_DELAY, value)
    with caplog.at_level(logging.WARNING, logger="trainer.faults"):
        injector = FaultInjector((), attempt=0, rank=0)
    assert injector.step_delay_s == delay
    assert (ENV_STEP_DELAY in caplog.text) == (value == "fast")


def test_without_the_variable_steps_are_not_delayed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_STEP_DELAY, raising=False)
    assert FaultInjector((), attempt=0, rank=0).step_delay_s == 0.0
