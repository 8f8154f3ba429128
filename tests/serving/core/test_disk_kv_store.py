"""The disk KV tier's store: page files, the index rebuilt from them, LRU by bytes, torn,
corrupt and foreign files, the disk full (no JAX, no engine)."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest

from serving.core.kv import disk_kv_store
from serving.core.kv.disk_kv_store import DiskKVStore, encode_page
from serving.core.kv.host_kv_cache import HostKVCache
from tests.support.disk_full import file_size_limit, no_space_on_write

MODEL, FORMAT = "tiny:abc|float32", "bfloat16"


def arrays(fill: float) -> dict[str, np.ndarray]:
    k = np.full((2, 1, 4, 8), fill, ml_dtypes.bfloat16)
    return {"k": k, "v": -k, "k_scale": np.full((2, 1, 4), fill, np.float32)}


FILE_BYTES = len(encode_page(b"\0" * 16, arrays(1), MODEL, FORMAT))


def key(i: int) -> bytes:
    return bytes([i]) * 16


def store(d, max_files: float = 10, **kw) -> DiskKVStore:
    return DiskKVStore(str(d), int(max_files * FILE_BYTES), kw.pop("model_id", MODEL),
                       kw.pop("kv_format", FORMAT), **kw)


def test_pages_round_trip_and_a_new_store_over_the_directory_finds_them(tmp_path):
    a = store(tmp_path)  # the writer thread
    for i in range(3):
        assert a.put(key(i), arrays(i))
    assert a.contains(key(2))  # queued or written: held either way
    a.close()
    assert (a.stores, a.bytes_written, a.usage_bytes) == (3, 3 * FILE_BYTES, 3 * FILE_BYTES)
    b = store(tmp_path, writer=False)  # a restarted server
    assert set(b.keys()) == {key(0), key(1), key(2)} and b.usage_bytes == 3 * FILE_BYTES
    got = b.read(key(1))
    assert list(got) == ["k", "v", "k_scale"] and got["k"].dtype == ml_dtypes.bfloat16
    for name, want in arrays(1).items():
        np.testing.assert_array_equal(got[name], want)
    assert (b.hits, b.reads, b.bytes_read) == (1, 1, FILE_BYTES) and b.read_seconds > 0
    assert b.read(key(9)) is None and b.misses == 1


def test_lru_by_bytes_removes_the_least_recently_used_files(tmp_path):
    s = store(tmp_path, max_files=3.5, writer=False)
    for i in range(3):
        s.put(key(i), arrays(i))
    assert s.read(key(0)) is not None  # 1 is now least recently used
    s.put(key(3), arrays(3))
    assert s.keys() == [key(2), key(0), key(3)] and s.evictions == 1
    assert not os.path.exists(s.path(key(1))) and s.usage_bytes == 3 * FILE_BYTES <= s.max_bytes
    assert not s.put(key(0), arrays(0))  # held: only touched
    assert s.keys()[-1] == key(0)
    # the bound holds across a restart too: a smaller bound drops the oldest files
    again = store(tmp_path, max_files=2, writer=False)
    assert len(again) == 2 and again.usage_bytes == 2 * FILE_BYTES


def test_torn_corrupt_and_foreign_files_are_ignored_and_counted(tmp_path):
    s = store(tmp_path, writer=False)
    for i in range(5):
        s.put(key(i), arrays(i))
    with open(s.path(key(0)), "r+b") as f:  # torn: cut short
        f.truncate(FILE_BYTES - 7)
    with open(s.path(key(1)), "wb") as f:  # not a page file at all
        f.write(b"garbage")
    with open(s.path(key(9)).replace(key(9).hex(), "not-hex"), "wb") as f:  # a name that is no key
        f.write(b"")
    mine = store(tmp_path, writer=False)  # a restart: the damaged files are counted and removed
    assert mine.corrupt_files == 3 and mine.foreign_files == 0
    assert set(mine.keys()) == {key(2), key(3), key(4)}
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(mine.path(key(i))) for i in (2, 3, 4))
    other = store(tmp_path, model_id="another model", writer=False)
    assert len(other) == 0 and other.foreign_files == 3 and other.read(key(2)) is None
    other_format = store(tmp_path, kv_format="int8", writer=False)
    assert len(other_format) == 0 and other_format.foreign_files == 3
    assert len(os.listdir(tmp_path)) == 3  # another server's files are left alone
    # a file damaged after start-up: its checksum fails at the read
    with open(mine.path(key(3)), "r+b") as f:
        f.seek(FILE_BYTES - 3)
        f.write(b"\xff\xfe\xfd")
    assert mine.read(key(3)) is None and mine.corrupt_files == 4 and key(3) not in mine
    assert mine.usage_bytes == FILE_BYTES * 2
    # another model's file under our name (copied in): foreign at the read, left alone
    data = encode_page(key(4), arrays(4), "another model", FORMAT)
    with open(mine.path(key(4)), "wb") as f:
        f.write(data)
    assert mine.read(key(4)) is None and mine.foreign_files == 1 and os.path.exists(mine.path(key(4)))
    np.testing.assert_array_equal(mine.read(key(2))["v"], arrays(2)["v"])


def test_the_disk_full_drops_pages_and_counts_them(tmp_path, monkeypatch):
    s = store(tmp_path, writer=False)
    with file_size_limit(FILE_BYTES // 2):  # below one page: the write fails with EFBIG
        assert s.put(key(0), arrays(0))
    assert s.dropped_pages == 1 and key(0) not in s and os.listdir(tmp_path) == []

    no_space_on_write(monkeypatch, disk_kv_store)
    w = store(tmp_path)  # through the writer thread
    for i in range(3):
        w.put(key(i), arrays(i))
    w.close()
    assert w.dropped_pages == 3 and len(w) == 0 and w.stores == 0
    monkeypatch.undo()
    s.put(key(1), arrays(1))  # room again: written
    assert s.stores == 1 and key(1) in s


def test_a_page_bigger_than_the_bound_is_dropped(tmp_path):
    s = store(tmp_path, max_files=0.5, writer=False)
    assert s.put(key(0), arrays(0)) and s.dropped_pages == 1 and len(s) == 0
    with pytest.raises(ValueError, match="max_bytes"):
        DiskKVStore(str(tmp_path), 0, MODEL, FORMAT)


def test_host_tier_evictions_spill_to_the_disk_store(tmp_path):
    s = store(tmp_path, writer=False)
    page_bytes = sum(a.nbytes for a in arrays(0).values()) - arrays(0)["k_scale"].nbytes
    host = HostKVCache(2 * page_bytes, spill=lambda k, entry: s.put(k, dict(entry)))
    for i in range(3):
        a = arrays(i)
        host.put(key(i), {"k": a["k"], "v": a["v"]})
    assert host.keys() == [key(1), key(2)] and s.keys() == [key(0)]
    np.testing.assert_array_equal(s.read(key(0))["k"], arrays(0)["k"])
