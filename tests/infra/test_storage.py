"""Storage helpers over local disk and memory:// (S3 is covered against moto elsewhere)."""

from __future__ import annotations

import pytest

from infra import storage


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


def test_retries_then_names_the_operation() -> None:
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("reset")
        return "ok"

    assert storage.with_retries("op", flaky, retries=3, backoff_s=0.001) == "ok"
    with pytest.raises(storage.StorageError, match="upload s3://b/k: failed after 2 tries"):
        storage.with_retries(
            "upload s3://b/k", lambda: (_ for _ in ()).throw(OSError("down")), 1, 0.001
        )
    with pytest.raises(FileNotFoundError):
        storage.with_retries("read", lambda: (_ for _ in ()).throw(FileNotFoundError("x")))


def test_metadata_calls_ride_out_a_blip(monkeypatch) -> None:
    """The checkpoint commit polls exists/glob; one dropped connection must not fail it."""
    storage.write_text("memory://blip/a/_done.rank000.json", "{}")
    fs, _ = storage.split("memory://blip")
    calls = {"exists": 0, "glob": 0}

    def flaky(name: str, real):  # noqa: ANN001, ANN202 - wraps an fsspec method
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls[name] += 1
            if calls[name] == 1:
                raise ConnectionResetError("connection reset by peer")
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(fs, "exists", flaky("exists", fs.exists))
    monkeypatch.setattr(fs, "glob", flaky("glob", fs.glob))
    monkeypatch.setattr(storage, "_retry", {"retries": 2, "backoff_s": 0.001})
    assert storage.exists("memory://blip/a/_done.rank000.json")
    assert storage.glob("memory://blip/a/_done.rank*.json") == [
        "memory://blip/a/_done.rank000.json"
    ]
    assert calls == {"exists": 2, "glob": 2}
