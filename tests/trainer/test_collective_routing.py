"""Every collective the trainer issues runs on a group whose backend serves its tensors.

NCCL has no CPU implementation: a collective on CPU tensors over an NCCL-only group fails
at run time, so a GPU job would die at its first evaluation (or preemption check). Two
ranks train here with the backend strings the trainer asks for on a GPU, NCCL swapped for
gloo per device (tests/trainer/collective_routing.py): a group asked for as "nccl" serves
no CPU tensor here either, so a misrouted collective fails this test on a CPU machine.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from infra.settings import dump_config
from tasks.attempt import LaunchSpec
from tests.factories import ROOT, tiny_config, write_dataset
from trainer.distributed import backend_devices, process_group_backend


def test_gpu_default_group_serves_cpu_tensors() -> None:
    served = backend_devices(process_group_backend(torch.device("cuda")))
    assert served == {"cpu": "gloo", "cuda": "nccl"}
    assert backend_devices(process_group_backend(torch.device("cpu"))) == {
        "cpu": "gloo",
        "cuda": "gloo",
    }


def _overlaps(records: list[dict]) -> list[tuple[dict, dict]]:
    """Pairs of calls on one group from two threads whose times overlap."""
    out = []
    by_group: dict[str, list[dict]] = {}
    for r in records:
        by_group.setdefault(r["group"], []).append(r)
    for calls in by_group.values():
        calls.sort(key=lambda r: r["start"])
        for a, b in zip(calls, calls[1:], strict=False):
            if a["thread"] != b["thread"] and b["start"] < a["end"]:
                out.append((a, b))
    return out


@pytest.mark.slow
def test_trainer_collectives_are_routed_to_a_backend_for_their_device(tmp_path: Path) -> None:
    config = tiny_config(
        tmp_path,
        job_id="routing",
        train={"steps": 12, "eval_every": 6, "eval_rows": 512, "log_every": 6},
        checkpoint={"mode": "async_staged", "every_steps": 5},
    )
    write_dataset(config)
    path = tmp_path / "routing.yaml"
    dump_config(config, path)
    program = ("-m", "tests.trainer.collective_routing")  # the trainer, with collectives logged
    command = LaunchSpec(str(path), nproc=2, program=program).command()
    logs = tmp_path / "collectives"
    logs.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "ETT_COLLECTIVE_LOG": str(logs),
    }
    result = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    for rank in (0, 1):
        records = [json.loads(x) for x in (logs / f"rank{rank}.jsonl").read_text().splitlines()]
        asked = {r["group"]: r["asked"] for r in records}
        assert asked["WORLD"] == "cpu:gloo,cuda:nccl", asked  # the GPU string was simulated
        misrouted = [r for r in records if not r["routed"]]
        assert misrouted == [], misrouted[:5]
        # The collectives that motivated this: evaluation's gather of CPU predictions...
        gathers = [r for r in records if r["op"] == "all_gather" and r["devices"] == ["cpu"]]
        assert len(gathers) >= 4, "evaluation gathers probs and labels at steps 6 and 12"
        # ...checkpoint collectives on their own group, off the training thread...
        ckpt = [r for r in records if r["thread"].startswith("ckpt-commit")]
        assert ckpt and all(r["group"] != "WORLD" for r in ckpt)
        # ...and the rank balancing's exchange on a group of its own (its first exchange
        # runs on an init thread while the model is sharded on WORLD).
        data = [r for r in records if r["group"] not in ("WORLD", *(c["group"] for c in ckpt))]
        lengths = [r for r in data if r["op"] == "all_gather"]
        assert len(lengths) == 12, "the lengths of every step's batch are exchanged"
        assert any(r["op"] == "all_to_all_single" for r in data), "rows moved at some step"
        assert any(r["thread"].startswith("init-") for r in data)
        assert _overlaps(records) == [], "two threads used one group at the same time"
