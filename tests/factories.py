"""Small configs and datasets for tests: seconds to generate, seconds to train."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from infra.settings import JobConfig, dump_config, load_config

ROOT = Path(__file__).resolve().parents[1]


def tiny_config(tmp_path: Path, **sections: Any) -> JobConfig:
    """A job whose data, checkpoints and ledgers live under ``tmp_path``; ``sections``
    are merged over the tiny defaults (e.g. ``train={"steps": 30}``)."""
    base: dict[str, Any] = {
        "job_id": "tiny",
        "storage": {"root": f"file://{tmp_path}/store"},
        "data": {
            "url": f"file://{tmp_path}/data",
            "cat_vocab_sizes": [50, 20, 10],
            "item_vocab_size": 100,
            "max_history_len": 16,
            "batch_size": 64,
            "eval_batch_size": 256,
            "generator": {"rows": 4000, "holdout_rows": 1000, "shards": 4, "mean_history_len": 6},
        },
        "model": {"embedding_dim": 8, "dense_arch": [16, 8], "over_arch": [16, 8]},
        # Eager: each test has its own storage root, so compiling would start cold in every
        # trainer process (~50 s); tests/trainer/test_startup.py and test_compile_cache.py
        # cover the compiled default.
        "train": {"steps": 20, "eval_every": 0, "eval_rows": 512, "log_every": 5, "compile": False},
        # No in-memory tier unless a test turns it on: restores come from the durable
        # checkpoints the tests count on (tests/trainer/checkpoint/test_memory_tier.py).
        "checkpoint": {
            "mode": "async_staged",
            "every_steps": 5,
            "keep_latest_k": 3,
            "memory_tier": False,
        },
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db"},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return load_config(**base)


def write_dataset(config: JobConfig) -> dict[str, Any]:
    from trainer.data.synthetic import generate

    return generate(config.data, config.data.url)


def trainer_command(config_path: str | Path, nproc: int = 1) -> list[str]:
    """The command line of one single-node attempt, exactly as the orchestrator builds it."""
    from tasks.attempt import LaunchSpec

    return LaunchSpec(str(config_path), nproc=nproc).command()


def run_trainer(
    config: JobConfig,
    tmp_path: Path,
    nproc: int = 1,
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """One attempt under torchrun, as the orchestrator would launch it (no orchestrator:
    no control channel, no standby, no retries)."""
    path = tmp_path / f"{config.job_id}.yaml"
    dump_config(config, path)
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        trainer_command(path, nproc=nproc),
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(tmp_path),
    )


def checkpoint_tensors(ckpt_url: str) -> dict[str, Any]:
    """Every tensor of a DCP checkpoint, unsharded, in one process (public DCP API only)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from infra import storage

    with contextlib.ExitStack() as stack:
        path = storage.local_path(ckpt_url)
        if path is None:  # object storage: read a copy, as it is stored
            path = stack.enter_context(tempfile.TemporaryDirectory(prefix="ckpt-"))
            fs, root = storage.split(ckpt_url)
            fs.get(root.rstrip("/") + "/", path + "/", recursive=True)
        metadata = dcp.FileSystemReader(path).read_metadata()
        state = {
            key: torch.empty(meta.size, dtype=meta.properties.dtype)
            for key, meta in metadata.state_dict_metadata.items()
            if isinstance(meta, TensorStorageMetadata)
        }
        dcp.load(state, checkpoint_id=path, no_dist=True)
        return state


def assert_bit_identical(clean: JobConfig, faulted: JobConfig, steps: int) -> None:
    """Both jobs' anchors are at ``steps`` and hold exactly the same tensors."""
    import torch

    from infra.checkpoint_manifest import committed_checkpoints

    [a, b] = [committed_checkpoints(c.layout)[0] for c in (clean, faulted)]
    assert a.step == b.step == steps and a.manifest.anchor and b.manifest.anchor
    left, right = checkpoint_tensors(a.url), checkpoint_tensors(b.url)
    assert left.keys() == right.keys()
    assert any(k.startswith("optim.") for k in left), "optimizer state must be checkpointed"
    differing = [k for k in left if not torch.equal(left[k], right[k])]
    assert differing == [], f"not bit-identical: {differing[:5]}"


def resume_marks(config: JobConfig) -> list[tuple[int, int, bool]]:
    """(attempt, step, in_process) of every resume mark of rank 0, in order."""
    from infra.accounting.ledger_format import Mark
    from infra.accounting.ledger_read import read_events

    marks = [e for e in read_events(config.layout) if e.name == Mark.RESUME and e.rank == 0]
    return [(e.attempt, e.step, bool(e.attrs.get("in_process"))) for e in marks]


__all__ = [
    "assert_bit_identical",
    "checkpoint_tensors",
    "resume_marks",
    "run_trainer",
    "tiny_config",
    "trainer_command",
    "write_dataset",
]


class HeldState:
    """A checkpointable part that is a plain dict, for driving the Checkpointer directly:
    the test changes ``value`` (in place or by replacing it) between saves, as training
    changes its live state."""

    def __init__(self, value: dict[str, Any]) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return self.value


class PoolProcess:
    """``ett pool`` started as a user starts it (the installed script), its output in
    ``folder/pool.log``; for the tests and benchmarks of the agent pool. ``refill_delay_s``
    None: the command's default."""

    def __init__(
        self, folder: Path, env: dict[str, str], refill_delay_s: float | None = 0.0
    ) -> None:
        import sys

        self.socket = str(folder / "pool.sock")
        self.log = folder / "pool.log"
        ett = Path(sys.executable).with_name("ett")
        refill = [] if refill_delay_s is None else ["--refill-delay-s", str(refill_delay_s)]
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [str(ett), "pool", "--socket", self.socket, *refill],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def text(self) -> str:
        return self.log.read_text()

    def wait_for(self, needle: str, count: int = 1, timeout: float = 300) -> None:
        """Until the log says ``needle`` ``count`` times; AssertionError if the pool exits
        or ``timeout`` passes first."""
        import time

        deadline = time.monotonic() + timeout
        while self.text().count(needle) < count:
            assert self.proc.poll() is None, self.text()
            assert time.monotonic() < deadline, f"no {needle!r} x{count} in: {self.text()}"
            time.sleep(0.1)

    def claimed(self) -> list[int]:
        """The pids of the agents claimed so far, in claim order."""
        return [
            int(line.split("agent ")[-1].split()[0])
            for line in self.text().splitlines()
            if line.endswith(" claimed")
        ]

    def stop(self) -> int:
        """SIGTERM, as Ctrl-C or a service manager stops it; its exit code."""
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


def with_sections(config: JobConfig, **sections: dict[str, Any]) -> JobConfig:
    """``config`` with fields of some sections replaced, e.g.
    ``with_sections(c, launch={"nproc": 2})``."""
    return config.model_copy(
        update={k: getattr(config, k).model_copy(update=v) for k, v in sections.items()}
    )


def use_launcher(monkeypatch: Any, *launcher: str) -> None:
    """Every attempt the orchestrator launches in this test runs ``launcher`` (a stand-in for
    ``python -m trainer.launch``, e.g. tests/fake_trainer.py) instead of the trainer."""
    from tasks import orchestrator
    from tasks.attempt import LaunchSpec

    original = LaunchSpec.of

    def of(config: JobConfig, config_path: str, **seams: Any) -> LaunchSpec:
        return original(config, config_path, **{"launcher": launcher, **seams})

    monkeypatch.setattr(orchestrator.LaunchSpec, "of", staticmethod(of))


def per_global_batch(config: JobConfig) -> dict[int, tuple[int, float]]:
    """step -> (rows digest, mean loss) of its last execution, the ranks' shares together: the
    same rows per global batch give the same digest at any world size (issue 29). A step's
    last execution is rank 0's last, on its attempt's world size (its ``model_flops`` mark):
    a step redone on fewer ranks counts only the ranks that redid it."""
    from infra.accounting.ledger_read import read_events

    events = read_events(config.layout)
    world = {
        e.attempt: int(e.attrs["world_size"])
        for e in events
        if e.name == "model_flops" and e.rank == 0
    }
    last: dict[tuple[int, int], Any] = {}  # (step, rank) -> its last execution
    for e in sorted(events, key=lambda e: e.start):
        if e.name == "train_step" and "loss" in e.attrs and e.step is not None:
            last[(e.step, e.rank)] = e
    out: dict[int, tuple[int, float]] = {}
    for step in sorted({s for s, _ in last}):
        ranks = world.get(last[(step, 0)].attempt, 1)
        shares = [last[(step, r)].attrs for r in range(ranks)]
        digest = sum(a["rows_digest"] for a in shares) % 2**64
        out[step] = (digest, sum(a["loss"] for a in shares) / len(shares))
    return out


def assert_same_rows(clean: JobConfig, config: JobConfig, steps: int) -> None:
    """Every global batch's rows once: ``clean``'s digests, step for step, for steps 1 to
    ``steps`` (steps redone after a failure count once, as their last attempt ran them)."""
    want, got = per_global_batch(clean), per_global_batch(config)
    assert sorted(got) == list(range(1, steps + 1))
    assert {s: d for s, (d, _) in got.items()} == {s: d for s, (d, _) in want.items()}
