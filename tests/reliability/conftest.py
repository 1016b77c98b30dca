"""One small data set for every fault test (seconds to write, read by every attempt)."""

from __future__ import annotations

import pytest

from tests.factories import tiny_config, write_dataset


@pytest.fixture(scope="session")
def data_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    config = tiny_config(tmp_path_factory.mktemp("fault-data"))
    write_dataset(config)
    return config.data.url
