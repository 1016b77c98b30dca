"""Which job a start runs (tasks/job_identity.py): a new id unless asked otherwise, an
unfinished job continued when named or resumed, a finished one refused with nothing written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flows.run_names import train_run_name_of
from infra import storage
from infra.accounting.ledger import Ledger
from infra.accounting.ledger_format import Mark
from infra.settings import JOB_ID_PATTERN, JobConfig, new_job_id
from tasks.job_identity import JobFinished, NothingToResume, finished, resolve
from tests.factories import tiny_config

NEW_ID = re.compile(r"train-\d{8}-\d{6}-[0-9a-f]{4}")


def _config(tmp_path: Path, job_id: str | None = None) -> JobConfig:
    config = tiny_config(tmp_path, job_id=job_id)
    storage.configure(config.storage)
    return config


def _ran(config: JobConfig, job_id: str, end: bool) -> None:
    """A job with one attempt in its ledger: trained to its end (``job_end``) or not."""
    layout = config.model_copy(update={"job_id": job_id}).layout
    with Ledger(layout, attempt=0, rank=0, role="trainer") as ledger:
        ledger.mark(Mark.CHECKPOINT_COMMITTED, step=5)
        if end:
            ledger.mark(Mark.JOB_END, step=20)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_new_id_is_readable_unique_and_valid() -> None:
    # two starts in the same second: 16 random bits apart (equal once in 65,536 runs)
    ids = {new_job_id("train", when=1796459652.0) for _ in range(2)}
    assert len(ids) == 2
    assert all(NEW_ID.fullmatch(i) and re.fullmatch(JOB_ID_PATTERN, i) for i in ids)
    # a flow run names its job from its own start and id: the same every time it asks
    made = new_job_id("train", when=1796459652.0, salt="3f9a0c")
    assert made == new_job_id("train", when=1796459652.0, salt="3f9a0c")
    assert made == "train-20261205-083412-3f9a"
    # a deployment's name may hold what an id may not
    spaced = new_job_id("my train/v2", when=1796459652.0, salt="3f9a")
    assert spaced == "my-train-v2-20261205-083412-3f9a"


def test_no_job_id_is_a_new_job_named_after_the_start(tmp_path: Path) -> None:
    config = _config(tmp_path)
    assert config.job_id is None
    first = resolve(config, "train").job_id
    second = resolve(config, "train").job_id
    assert first != second and NEW_ID.fullmatch(first or "") and NEW_ID.fullmatch(second or "")
    assert (
        resolve(config, "nightly", when=0.0, salt="ab12").job_id == "nightly-19700101-000000-ab12"
    )
    with pytest.raises(ValueError, match="no id yet"):
        _ = config.layout  # never a folder for an id not given yet


def test_an_unfinished_job_named_is_continued(tmp_path: Path) -> None:
    config = _config(tmp_path, "mine")
    _ran(config, "mine", end=False)
    assert not finished(config.layout)
    assert resolve(config, "train").job_id == "mine"
    assert resolve(config, "train", resume=True).job_id == "mine"


def test_a_finished_job_is_refused_in_one_line_and_nothing_is_written(tmp_path: Path) -> None:
    config = _config(tmp_path, "done")
    _ran(config, "done", end=True)
    before = _files(tmp_path)
    with pytest.raises(JobFinished) as refused:
        resolve(config, "train")
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("job done is finished")
    assert "leave job_id out (or pass a new one) to start a new job" in message
    assert _files(tmp_path) == before


def test_resume_continues_the_newest_unfinished_job_of_its_name(tmp_path: Path) -> None:
    config = _config(tmp_path)
    with pytest.raises(NothingToResume, match="no unfinished train job under .* to resume"):
        resolve(config, "train", resume=True)
    _ran(config, "train-20261201-100000-aaaa", end=False)  # older, unfinished
    _ran(config, "train-20261202-100000-bbbb", end=False)  # the newest unfinished
    _ran(config, "train-20261203-100000-cccc", end=True)  # newer, but finished
    _ran(config, "train-zzz", end=False)  # named by hand: not one `train` started
    _ran(config, "nightly-20261204-100000-dddd", end=False)  # another name's
    assert resolve(config, "train", resume=True).job_id == "train-20261202-100000-bbbb"


def test_the_run_is_named_after_its_job() -> None:
    assert train_run_name_of("dep-1a2b") == "train-dep-1a2b"
    assert train_run_name_of("train-20261205-083412-3f9a") == "train-20261205-083412-3f9a"
