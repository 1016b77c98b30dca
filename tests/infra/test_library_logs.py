"""infra/library_logs.py: TorchRec's and FBGEMM's dumps only show at DEBUG."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

from infra.library_logs import quiet_library_dumps


@pytest.fixture
def root_stream() -> Iterator[io.StringIO]:
    """The root logger writing to a string, as trainer/train.py sets it up (basicConfig)."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    stream = io.StringIO()
    root.handlers = [logging.StreamHandler(stream)]
    try:
        yield stream
    finally:
        root.handlers, root.level = saved


def _emit() -> None:
    logging.getLogger("torchrec.distributed.planner.stats").info("# Parameter Info: ...")
    logging.info("[TBE=a30e] SplitTableBatchedEmbeddingBagsCodegen Arguments: {...}")
    logging.getLogger("torchrec.distributed.planner").warning("planner: no plan fits memory")
    logging.getLogger("trainer").info("step 5/20 loss 0.70")


def test_dumps_are_dropped_at_info(root_stream: io.StringIO) -> None:
    logging.getLogger().setLevel(logging.INFO)
    quiet_library_dumps()
    _emit()
    assert root_stream.getvalue().splitlines() == [
        "planner: no plan fits memory",  # a library's warning still shows
        "step 5/20 loss 0.70",
    ]


def test_dumps_show_at_debug_as_debug(root_stream: io.StringIO) -> None:
    logging.getLogger().setLevel(logging.DEBUG)
    root_stream.seek(0)
    logging.getLogger().handlers[0].setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    quiet_library_dumps()
    _emit()
    lines = root_stream.getvalue().splitlines()
    assert "DEBUG # Parameter Info: ..." in lines
    assert any(line.startswith("DEBUG [TBE=a30e]") for line in lines)
    assert "INFO step 5/20 loss 0.70" in lines
