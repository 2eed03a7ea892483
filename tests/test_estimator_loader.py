"""Tests of the shard loader (spark_hvd.estimators.loader) on shards written here with PyArrow
in the ``_format`` encoding: scalars primitive, arrays/vectors ``fixed_size_list``."""

from __future__ import annotations

import collections
import gc
import json
import os
import sys
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from spark_hvd.estimators.data import _format
from spark_hvd.estimators.loader import (
    ShardReader, ShardReadError, default_shuffle_buffer_size, default_steps_per_epoch,
    iterate_once,
)

pytestmark = pytest.mark.timeout(60)

# name -> (dtype, shape, kind)
COLUMNS = {
    "id": ("int64", (), "scalar"),
    "x": ("float32", (4,), "vector"),
    "img": ("float64", (2, 3), "array"),
    "flag": ("bool", (), "scalar"),
    "mask": ("bool", (3,), "array"),
    "small": ("int8", (), "scalar"),
    "pair": ("int32", (2,), "array"),
}


def column_values(name, ids):
    """Every column is a function of the row id, so a batch can be checked row by row."""
    if name == "id":
        return ids
    dtype, shape, _ = COLUMNS[name]
    size = int(np.prod(shape)) if shape else 1
    base = ids.reshape((-1,) + (1,) * len(shape)) if shape else ids
    if dtype == "bool":
        grid = np.arange(size).reshape(shape) if shape else 0
        return ((base + grid) % 2 == 0).astype(bool)
    if dtype == "int8":
        return (ids % 100).astype(np.int8)
    grid = np.arange(size).reshape(shape) if shape else 0
    return (base * 10 + grid).astype(dtype)


def arrow_column(name, ids, nullable=True):
    dtype, shape, _ = COLUMNS[name]
    values = column_values(name, ids)
    if not shape:
        return pa.array(values)
    flat = pa.array(values.reshape(-1))
    element = pa.field("element", flat.type, nullable=nullable)
    return pa.FixedSizeListArray.from_arrays(flat, type=pa.list_(element, int(np.prod(shape))))


def write_data(root, file_rows=(10, 10, 10, 10), val_rows=None, row_group_size=4,
               nullable=True):
    """Write train (and val) shards plus _metadata.json under ``root``; ids are global."""
    fs = pafs.LocalFileSystem()
    data_path = str(root)
    splits = {}
    start = 0
    for split, rows in (("train", file_rows), ("val", val_rows)):
        if rows is None:
            splits[split] = None
            continue
        split_dir = os.path.join(data_path, split)
        os.makedirs(split_dir, exist_ok=True)
        files = []
        for i, n in enumerate(rows):
            ids = np.arange(start, start + n, dtype=np.int64)
            start += n
            arrays = [arrow_column(c, ids, nullable) for c in COLUMNS]
            # Non-nullable fields are a valid variant of the encoding (and decode faster).
            schema = pa.schema([pa.field(c, a.type, nullable=nullable)
                                for c, a in zip(COLUMNS, arrays)])
            table = pa.Table.from_arrays(arrays, schema=schema)
            rel = _format.part_file(i)
            pq.write_table(table, os.path.join(split_dir, rel), row_group_size=row_group_size)
            files.append(rel)
        splits[split] = {"dir": split_dir, "files": files, "rows": list(rows),
                         "total_rows": sum(rows)}
    metadata = {
        "format_version": _format.FORMAT_VERSION, "data_key": "test",
        "feature_cols": ["x", "img"], "label_cols": ["id"], "sample_weight_col": None,
        "columns": {c: {"dtype": d, "shape": list(s), "kind": k}
                    for c, (d, s, k) in COLUMNS.items()},
        "splits": splits,
    }
    with open(os.path.join(data_path, _format.METADATA_FILE), "w") as f:
        json.dump(metadata, f)
    return fs, data_path, metadata


def check_batch(batch, batch_size, columns=tuple(COLUMNS)):
    assert list(batch) == list(columns)
    ids = batch["id"]
    for c in columns:
        dtype, shape, _ = COLUMNS[c]
        arr = batch[c]
        assert arr.shape == (batch_size,) + shape, c
        assert arr.dtype == np.dtype(dtype), c
        assert arr.flags.writeable and arr.flags.c_contiguous, c
        np.testing.assert_array_equal(arr, column_values(c, ids), err_msg=c)


def ids_of(batches):
    return np.concatenate([b["id"] for b in batches])


@pytest.fixture
def data(tmp_path):
    return write_data(tmp_path)


def wait_for_threads(baseline, timeout=5.0):
    deadline = time.monotonic() + timeout
    while threading.active_count() > baseline and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.02)
    return threading.active_count()


# ---------------------------------------------------------------------------------------------

def test_default_steps_per_epoch(data):
    _, _, meta = data
    assert default_steps_per_epoch(meta, "train", 4, 2) == 40 // 8
    assert default_steps_per_epoch(meta, "train", 7, 3) == 40 // 21
    assert default_steps_per_epoch(meta, "train", 64, 4) == 1     # never 0


def test_default_shuffle_buffer_size():
    assert default_shuffle_buffer_size(3140, 32, 1_000_000) == 10_000
    assert default_shuffle_buffer_size(3140, 4096, 1_000_000) == 8 * 4096
    assert default_shuffle_buffer_size(600_000, 32, 1_000_000) == (256 << 20) // 600_000
    assert default_shuffle_buffer_size(16, 32, 500) == 500         # whole rank's data
    assert default_shuffle_buffer_size(16, 32, 5) == 32            # at least one batch


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("nullable", [True, False])
def test_batches_shapes_dtypes(tmp_path, shuffle, num_workers, nullable):
    fs, path, meta = write_data(tmp_path, nullable=nullable)
    with ShardReader(fs, path, meta, batch_size=4, shuffle=shuffle,
                     num_workers=num_workers) as reader:
        assert reader.steps_per_epoch == 10 and reader.rows == 40
        batches = list(reader.epoch(0))
    assert len(batches) == 10
    for b in batches:
        check_batch(b, 4)
    # One pass exactly: every row once.
    assert sorted(ids_of(batches)) == list(range(40))


def test_column_subset(data):
    fs, path, meta = data
    with ShardReader(fs, path, meta, batch_size=5, columns=["pair", "id"]) as reader:
        batches = list(reader.epoch(0))
    for b in batches:
        check_batch(b, 5, columns=("pair", "id"))


def test_ranks_read_disjoint_files_and_cover_all_rows(data):
    fs, path, meta = data
    seen = []
    for rank in range(2):
        with ShardReader(fs, path, meta, rank=rank, size=2, batch_size=5, shuffle=False) as r:
            assert r.files == ["part-%05d.parquet" % i for i in (rank, rank + 2)]
            assert r.rows == 20 and r.steps_per_epoch == 4
            ids = ids_of(list(r.epoch(0)))
        # Files i % 2 == rank hold ids [10 i, 10 i + 10).
        assert set(ids // 10 % 2) == {rank}
        seen.append(set(ids))
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] == set(range(40))


def test_equal_steps_with_unbalanced_files(tmp_path):
    fs, path, meta = write_data(tmp_path, file_rows=(30, 5, 7, 3))
    counts = []
    for rank in range(2):
        for shuffle in (False, True):
            with ShardReader(fs, path, meta, rank=rank, size=2, batch_size=4,
                             shuffle=shuffle) as r:
                assert r.steps_per_epoch == 45 // 8
                batches = list(r.epoch(0))
            counts.append(len(batches))
            for b in batches:
                check_batch(b, 4)
    assert counts == [5] * 4


def test_wrap_around_when_steps_exceed_data(data):
    fs, path, meta = data
    with ShardReader(fs, path, meta, rank=1, size=4, batch_size=4, steps_per_epoch=7,
                     shuffle=False) as r:
        assert r.rows == 10
        ids = ids_of(list(r.epoch(0)))
    # Rank 1 owns file 1 (ids 10..19); 28 rows = 2.8 passes in order.
    np.testing.assert_array_equal(ids, np.tile(np.arange(10, 20), 3)[:28])

    with ShardReader(fs, path, meta, rank=1, size=4, batch_size=4, steps_per_epoch=7) as r:
        batches = list(r.epoch(0))
    assert len(batches) == 7
    for b in batches:
        check_batch(b, 4)
    counts = collections.Counter(ids_of(batches).tolist())
    assert set(counts) == set(range(10, 20))    # every row used, each 2 or 3 times
    assert set(counts.values()) <= {2, 3, 4}


def test_batch_larger_than_rank_rows(data):
    fs, path, meta = data
    with ShardReader(fs, path, meta, rank=0, size=4, batch_size=25, steps_per_epoch=2) as r:
        batches = list(r.epoch(3))
    assert len(batches) == 2
    for b in batches:
        check_batch(b, 25)


def test_shuffle_is_deterministic_per_seed_and_differs_per_epoch(tmp_path):
    fs, path, meta = write_data(tmp_path, file_rows=(50, 50, 50, 50), row_group_size=10)

    def run(seed, epoch, workers=2, buffer=None):
        with ShardReader(fs, path, meta, batch_size=8, seed=seed, num_workers=workers,
                         shuffle_buffer_size=buffer) as r:
            return ids_of(list(r.epoch(epoch)))

    a = run(1, 0)
    np.testing.assert_array_equal(a, run(1, 0))
    np.testing.assert_array_equal(a, run(1, 0, workers=0))   # independent of thread timing
    assert not np.array_equal(a, run(1, 1))
    assert not np.array_equal(a, run(2, 0))
    # 200 rows, 25 steps of 8: one pass, every row exactly once, not in file order.
    assert sorted(a) == list(range(200))
    assert not np.array_equal(a, np.arange(200))
    # A small buffer still mixes rows across row groups and never repeats one in a pass.
    small = run(1, 0, buffer=16)
    assert sorted(small) == list(range(200))
    assert not np.array_equal(small, a)
    assert len(set(small[:8] // 10)) > 1


def test_shuffle_uses_different_subsets_when_data_exceeds_steps(tmp_path):
    fs, path, meta = write_data(tmp_path, file_rows=(40, 40), row_group_size=5)
    with ShardReader(fs, path, meta, batch_size=4, steps_per_epoch=5,
                     shuffle_buffer_size=8) as r:
        e0, e1 = (set(ids_of(list(r.epoch(e)))) for e in (0, 1))
    assert len(e0) == len(e1) == 20
    assert e0 != e1


def test_no_shuffle_keeps_file_and_row_order(tmp_path):
    fs, path, meta = write_data(tmp_path, file_rows=(7, 9, 5), row_group_size=3)
    with ShardReader(fs, path, meta, batch_size=3, shuffle=False) as r:
        assert r.steps_per_epoch == 7
        first = ids_of(list(r.epoch(0)))
        second = ids_of(list(r.epoch(1)))
    np.testing.assert_array_equal(first, np.arange(21))
    np.testing.assert_array_equal(second, first)


def test_row_group_larger_than_shuffle_buffer(tmp_path):
    fs, path, meta = write_data(tmp_path, file_rows=(100,), row_group_size=100)
    with ShardReader(fs, path, meta, batch_size=4, shuffle_buffer_size=8) as r:
        batches = list(r.epoch(0))
    assert len(batches) == 25
    assert sorted(ids_of(batches)) == list(range(100))


def test_validation_split_and_iterate_once(tmp_path):
    fs, path, meta = write_data(tmp_path, file_rows=(10, 10), val_rows=(3, 4))
    with ShardReader(fs, path, meta, split="val", batch_size=2, shuffle=False) as r:
        assert r.rows == 7 and r.steps_per_epoch == 3
        np.testing.assert_array_equal(ids_of(list(r.epoch(0))), np.arange(20, 26))
    batches = list(iterate_once(fs, path, meta, "val", batch_size=3))
    assert [len(b["id"]) for b in batches] == [3, 3, 1]
    np.testing.assert_array_equal(ids_of(batches), np.arange(20, 27))
    check_batch(batches[-1], 1)
    rank1 = list(iterate_once(fs, path, meta, "train", batch_size=4, rank=1, size=2))
    np.testing.assert_array_equal(ids_of(rank1), np.arange(10, 20))


def test_inmemory_cache_all_survives_deleted_files(tmp_path):
    fs, path, meta = write_data(tmp_path, file_rows=(10, 10), row_group_size=3)
    with ShardReader(fs, path, meta, batch_size=4, steps_per_epoch=6,
                     inmemory_cache_all=True) as r:
        assert len(list(r.epoch(0))) == 6     # 24 rows > 20: every row group was read
        for f in meta["splits"]["train"]["files"]:
            os.remove(os.path.join(path, "train", f))
        for epoch in (1, 2):
            batches = list(r.epoch(epoch))
            assert len(batches) == 6
            for b in batches:
                check_batch(b, 4)
    # Without the cache the deleted files are needed again.
    write_data(tmp_path, file_rows=(10, 10), row_group_size=3)
    with ShardReader(fs, path, meta, batch_size=4, steps_per_epoch=6) as r:
        list(r.epoch(0))
        for f in meta["splits"]["train"]["files"]:
            os.remove(os.path.join(path, "train", f))
        with pytest.raises(ShardReadError, match="part-0000"):
            list(r.epoch(1))


def corrupt_data_pages(file_path):
    """Overwrite the first data page (right after the 'PAR1' magic), keeping the footer."""
    with open(file_path, "r+b") as f:
        f.seek(4)
        f.write(b"\xff" * 64)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_reader_thread_error_surfaces_with_file_name(data, num_workers):
    fs, path, meta = data
    baseline = threading.active_count()
    r = ShardReader(fs, path, meta, batch_size=4, shuffle=False, num_workers=num_workers)
    corrupt_data_pages(os.path.join(path, "train", "part-00002.parquet"))
    it = r.epoch(0)
    got = []
    with pytest.raises(ShardReadError, match=r"train/part-00002\.parquet"):
        for b in it:
            got.append(b)
    assert len(got) == 5        # the 20 rows of files 0 and 1 came first
    r.close()
    assert wait_for_threads(baseline) == baseline


def test_abandoned_iterator_stops_its_threads(tmp_path):
    fs, path, meta = write_data(tmp_path, file_rows=(200, 200), row_group_size=10)
    baseline = threading.active_count()
    r = ShardReader(fs, path, meta, batch_size=4, num_workers=3)

    for _ in r.epoch(0):        # broken out of: the iterator is dropped
        break
    assert wait_for_threads(baseline) == baseline

    it = r.epoch(1)             # explicit close
    next(it)
    assert threading.active_count() > baseline
    it.close()
    assert threading.active_count() == baseline
    with pytest.raises(StopIteration):
        next(it)

    with r.epoch(2) as it:      # context manager
        next(it)
    assert threading.active_count() == baseline

    it = r.epoch(3)             # closing the reader closes live iterators
    next(it)
    r.close()
    assert threading.active_count() == baseline
    with pytest.raises(RuntimeError, match="closed"):
        r.epoch(4)


def test_petastorm_missing_gives_clear_error(data, monkeypatch):
    fs, path, meta = data
    monkeypatch.setitem(sys.modules, "petastorm", None)     # import fails like here
    with pytest.raises(ImportError, match=r"(?s)Petastorm.*PyArrow >= 15.*reader='arrow'"):
        ShardReader(fs, path, meta, reader="petastorm")


class FakePetastorm:
    """Stands in for ``petastorm.make_batch_reader``: reads the URLs with PyArrow, returns
    namedtuple batches with list columns as arrays of arrays (as Petastorm does), and can
    imitate its thread-pool bug of ending a pass with no rows."""

    def __init__(self, lose_rows=False):
        self.lose_rows = lose_rows
        self.readers = []

    def make_batch_reader(self, urls, schema_fields, workers_count, shuffle_row_groups,
                          seed, num_epochs):
        assert num_epochs == 1 and all(u.startswith("file://") for u in urls)
        fake = self

        class Reader:
            stopped = False

            def __iter__(self):
                if fake.lose_rows:
                    return
                Batch = collections.namedtuple("Batch", schema_fields)
                for url in urls:
                    table = pq.read_table(url[len("file://"):], columns=schema_fields)
                    cols = {}
                    for c in schema_fields:
                        values = table.column(c).to_pylist()
                        cols[c] = (np.array([np.array(v) for v in values] + [None],
                                            dtype=object)[:-1]
                                   if isinstance(values[0], list) else np.array(values))
                    yield Batch(**cols)

            def stop(self):
                self.stopped = True

            def join(self):
                pass

        reader = Reader()
        self.readers.append(reader)
        return reader


def test_petastorm_path_with_fake_module(data, monkeypatch):
    fs, path, meta = data
    fake = FakePetastorm()
    module = type(sys)("petastorm")
    module.make_batch_reader = fake.make_batch_reader
    monkeypatch.setitem(sys.modules, "petastorm", module)
    with ShardReader(fs, path, meta, batch_size=4, steps_per_epoch=15, shuffle=False,
                     reader="petastorm") as r:
        batches = list(r.epoch(0))
    assert len(batches) == 15
    for b in batches:
        check_batch(b, 4)
    np.testing.assert_array_equal(ids_of(batches), np.tile(np.arange(40), 2)[:60])
    assert all(rd.stopped for rd in fake.readers)

    fake.lose_rows = True
    with ShardReader(fs, path, meta, batch_size=4, reader="petastorm") as r:
        with pytest.raises(ShardReadError, match="Petastorm returned 0 rows"):
            list(r.epoch(0))

    # Real Petastorm leaves out fixed_size_list columns: a clear error, not a KeyError.
    fake.lose_rows = False
    real_make = fake.make_batch_reader

    def without_arrays(urls, schema_fields, **kwargs):
        reader = real_make(urls, schema_fields, **kwargs)
        batches = list(reader)
        first = batches[0]._asdict()
        dropped = [n for n, v in first.items() if np.asarray(v).ndim > 1 or
                   (np.asarray(v).dtype == object)]
        assert dropped, "the test data should have an array column"
        Slim = collections.namedtuple("Slim", [n for n in first if n not in dropped])
        return iter([Slim(**{n: b._asdict()[n] for n in Slim._fields}) for b in batches])
    module.make_batch_reader = without_arrays
    with ShardReader(fs, path, meta, batch_size=4, reader="petastorm") as r:
        with pytest.raises(ShardReadError, match="cannot read array or vector columns"):
            list(r.epoch(0))


def test_unknown_column(data):
    fs, path, meta = data
    with pytest.raises(ValueError, match=r"unknown column\(s\) \['nope'\]"):
        ShardReader(fs, path, meta, columns=["x", "nope"])


def test_missing_validation_split(data):
    fs, path, meta = data
    with pytest.raises(ValueError, match="no validation data was prepared"):
        ShardReader(fs, path, meta, split="val")
    with pytest.raises(ValueError, match="no validation data was prepared"):
        default_steps_per_epoch(meta, "val", 4, 1)
    with pytest.raises(ValueError, match="unknown split 'test'"):
        ShardReader(fs, path, meta, split="test")


def test_shard_row_count_mismatch_names_file(data):
    fs, path, meta = data
    bad = json.loads(json.dumps(meta))
    bad["splits"]["train"]["rows"][3] = 12
    with pytest.raises(ShardReadError, match=r"part-00003\.parquet has 10 rows .* says 12"):
        ShardReader(fs, path, bad, rank=1, size=2)
    # Rank 0 does not own file 3, so it is unaffected.
    ShardReader(fs, path, bad, rank=0, size=2).close()


def test_truncated_or_missing_shard_names_file(data):
    fs, path, meta = data
    target = os.path.join(path, "train/part-00001.parquet")
    with open(target, "r+b") as f:
        f.truncate(100)
    with pytest.raises(ShardReadError, match=r"part-00001\.parquet"):
        ShardReader(fs, path, meta)
    os.remove(target)
    with pytest.raises(ShardReadError, match=r"part-00001\.parquet"):
        ShardReader(fs, path, meta)


def test_bad_arguments(data):
    fs, path, meta = data
    with pytest.raises(ValueError, match="rank"):
        ShardReader(fs, path, meta, rank=2, size=2)
    with pytest.raises(ValueError, match="reader"):
        ShardReader(fs, path, meta, reader="torch")
    with pytest.raises(ValueError, match="format_version"):
        ShardReader(fs, path, dict(meta, format_version=99))
    with pytest.raises(TypeError, match="FileSystem"):
        ShardReader(path, path, meta)


def test_rank_without_rows(tmp_path):
    fs, path, meta = write_data(tmp_path, file_rows=(10, 0))
    r = ShardReader(fs, path, meta, rank=1, size=2, batch_size=2)
    with pytest.raises(ValueError, match="owns no rows"):
        r.epoch(0)
    assert list(iterate_once(fs, path, meta, rank=1, size=2)) == []
