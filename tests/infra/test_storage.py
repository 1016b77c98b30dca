"""Storage helpers over local disk and memory://, and S3 (moto) behind a cuttable proxy."""

from __future__ import annotations

import urllib.parse
import uuid

import pytest

from infra import storage
from infra.settings import StorageConfig
from tests.tcp_proxy import TcpProxy


@pytest.mark.parametrize("root", ["file", "memory"])
def test_write_read_list_remove(tmp_path, root: str) -> None:
    base = f"file://{tmp_path}/s" if root == "file" else "memory://bucket/storage-test"
    url = storage.join(base, "a", "b.txt")
    storage.write_text(url, "hello")
    assert storage.read_text(url) == "hello"
    assert storage.exists(url) and storage.size(url) == 5
    assert storage.listdir(storage.join(base, "a")) == ["b.txt"]
    assert storage.glob(storage.join(base, "a", "*.txt")) == [url]
    storage.remove(storage.join(base, "a"), recursive=True)
    assert not storage.exists(url)
    assert storage.listdir(storage.join(base, "a")) == []


def test_local_write_is_atomic_rename(tmp_path) -> None:
    url = f"file://{tmp_path}/x.bin"
    storage.write_bytes(url, b"1" * 10)
    storage.write_bytes(url, b"2" * 3)
    assert storage.read_bytes(url) == b"222"
    assert [p.name for p in tmp_path.iterdir()] == ["x.bin"]  # no temp files left behind


def _fresh_s3fs() -> None:
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # a cached instance keeps its old endpoint


@pytest.mark.parametrize("retries", [0, 2])
def test_botocore_retries_are_the_only_layer(s3_server: str, retries: int) -> None:
    """A read during an outage is tried ``retries + 1`` times (botocore's retries, configured
    from StorageConfig), then fails as a StorageError that names the URL. aiohttp may open a
    second connection within one try after a reset, hence the range."""
    port = urllib.parse.urlsplit(s3_server).port
    assert port is not None
    proxy = TcpProxy(("127.0.0.1", port)).start()
    url = f"s3://ett/storage-test/{uuid.uuid4().hex[:8]}/x.txt"
    try:
        storage.configure(StorageConfig(s3_endpoint_url=proxy.url, retries=retries))
        storage.write_text(url, "hello")
        assert storage.read_text(url) == "hello"
        with proxy.outage(), pytest.raises(storage.StorageError) as err:
            storage.read_text(url)
        assert retries + 1 <= proxy.refused <= 2 * (retries + 1)
        assert url in str(err.value) and f"at most {retries + 1} tries" in str(err.value)
        assert storage.read_text(url) == "hello"  # the outage is over: nothing was lost
    finally:
        storage.configure(None)
        proxy.close()
        _fresh_s3fs()


def test_endpoint_comes_from_the_aws_environment(
    s3_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no endpoint in the config, botocore reads AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL
    itself (the s3_server fixture sets the former)."""
    storage.configure(None)
    url = f"s3://ett/storage-test/{uuid.uuid4().hex[:8]}/env.txt"
    _fresh_s3fs()
    storage.write_text(url, "via AWS_ENDPOINT_URL_S3")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    _fresh_s3fs()
    try:
        assert storage.read_text(url) == "via AWS_ENDPOINT_URL_S3"
    finally:
        _fresh_s3fs()
