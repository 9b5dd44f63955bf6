"""The local-directory file store: what the gateway's /v1/files and batch outputs rely on."""
from __future__ import annotations

import pytest

from kvgate.gateway.batches.file_store import LocalFileStore


def test_put_get_open_list_delete(tmp_path):
    store = LocalFileStore(tmp_path / "files")
    assert store.list() == [] and not (tmp_path / "files").exists()  # nothing stored, nothing created
    a = store.put(b'{"x": 1}\n', "a.jsonl", "batch")
    b = store.put(b"hello", "b.txt", "batch_output")
    assert a.id.startswith("file-") and a.id != b.id and a.bytes == 9 and a.object == "file"
    assert store.get(a.id) == a
    with store.open(a.id) as f:
        assert f.read() == b'{"x": 1}\n'
    assert {f.id for f in store.list()} == {a.id, b.id}
    assert store.delete(a.id) is True and store.delete(a.id) is False
    assert store.get(a.id) is None and store.open(a.id) is None
    assert [f.id for f in store.list()] == [b.id]


def test_a_put_with_an_id_replaces_that_file(tmp_path):
    store = LocalFileStore(tmp_path)
    first = store.put(b"one", "out.jsonl", "batch_output", file_id="file-fixed")
    second = store.put(b"two!", "out.jsonl", "batch_output", file_id="file-fixed")
    assert first.id == second.id == "file-fixed" and second.bytes == 4
    assert [f.id for f in store.list()] == ["file-fixed"]
    with store.open("file-fixed") as f:
        assert f.read() == b"two!"


@pytest.mark.parametrize("bad", ["../etc/passwd", "file-../../x", "file-a/b", "batch_1", "file-"])
def test_ids_that_are_not_file_ids_find_nothing_and_cannot_be_written(tmp_path, bad):
    store = LocalFileStore(tmp_path)
    assert store.get(bad) is None and store.open(bad) is None and store.delete(bad) is False
    with pytest.raises(ValueError, match="file id"):
        store.put(b"x", "x", "batch", file_id=bad)
