"""How attempts and steps are spelled in run names, the same in Prefect and in MLflow:
``<job>-attempt-0``, ``publish-<job>-step-600``. Every run name that shows an attempt or a
step is made with these, so the two UIs never spell one run two ways."""

from __future__ import annotations


def attempt_label(number: int) -> str:
    """``attempt-<n>``: an attempt's part of a run name."""
    return f"attempt-{number}"


def step_label(step: int | str) -> str:
    """``step-<n>``: a step's part of a run name (a checkpoint's, an anchor's)."""
    return f"step-{step}"


def attempt_run_name(job_id: str, number: int) -> str:
    """``<job>-attempt-<n>``: an attempt's task run in Prefect and its nested run in MLflow."""
    return f"{job_id}-{attempt_label(number)}"


def publish_run_name(job_id: str, step: int | str) -> str:
    """``publish-<job>-step-<n>``: the publish flow run in Prefect and its run in MLflow."""
    return f"publish-{job_id}-{step_label(step)}"
