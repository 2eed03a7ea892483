"""Store: layout, atomic writes, pickling, dispatch by URL scheme, and clear errors.

Runs every behaviour on a LocalStore, a FilesystemStore over fsspec's memory filesystem and one
over fsspec's local filesystem (no Spark needed).
"""

import os
import pickle
import uuid

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from spark_hvd.estimators.store import (DBFSLocalStore, FilesystemStore, HDFSStore, LocalStore,
                                        Store)


@pytest.fixture(params=["local", "memory", "fsspec-file"])
def store(request, tmp_path):
    if request.param == "local":
        yield LocalStore(str(tmp_path / "store"))
    elif request.param == "memory":
        s = FilesystemStore(f"memory://spark-hvd-test-{uuid.uuid4().hex}")
        yield s
        s.delete(s.prefix_path)
    else:
        yield FilesystemStore(f"file://{tmp_path}/store")


def _names_on_disk(store, path):
    """Every entry of a directory, temporary files included (listdir hides them)."""
    infos = store.filesystem.get_file_info(pafs.FileSelector(store.fs_path(path)))
    return sorted(os.path.basename(i.path.rstrip("/")) for i in infos)


def test_create_dispatches_by_scheme(tmp_path):
    assert type(Store.create(str(tmp_path))) is LocalStore
    assert type(Store.create(f"file://{tmp_path}")) is LocalStore
    assert Store.create(f"file://{tmp_path}").prefix_path == str(tmp_path)
    assert type(Store.create("memory://x")) is FilesystemStore
    rel = Store.create("relative/dir")
    assert rel.prefix_path == os.path.join(os.getcwd(), "relative/dir")


def test_layout(store):
    p = store.prefix_path
    assert store.get_train_data_path() == f"{p}/intermediate_train_data"
    assert store.get_train_data_path("k1") == f"{p}/intermediate_train_data.k1"
    assert store.get_val_data_path("k1") == f"{p}/intermediate_val_data.k1"
    assert store.get_test_data_path(0) == f"{p}/intermediate_test_data.0"
    assert store.get_data_path("k1") == store.get_train_data_path("k1")
    assert store.get_runs_path() == f"{p}/runs"
    assert store.get_run_path("r1") == f"{p}/runs/r1"
    assert store.get_checkpoint_path("r1") == f"{p}/runs/r1/checkpoints"
    assert store.get_logs_subdir() == "logs"
    assert store.get_logs_path("r1") == f"{p}/runs/r1/logs"
    assert store.get_checkpoint_filename() == "epoch"
    assert store.get_checkpoint_file("r1", 3, "ckpt") == f"{p}/runs/r1/checkpoints/epoch-00003.ckpt"
    assert store.saving_runs()


def test_read_write_list_delete(store):
    d = store.get_data_path("key")
    f = store.join(d, "sub", "a.bin")
    assert not store.exists(f)
    store.write_bytes(f, b"\x00\x01abc")
    assert store.exists(f) and store.read_bytes(f) == b"\x00\x01abc"
    store.write_text(store.join(d, "b.txt"), "héllo")
    assert store.read_text(store.join(d, "b.txt")) == "héllo"
    store.write_bytes(f, b"new")  # overwrite
    assert store.read_bytes(f) == b"new"
    assert store.listdir(d) == ["b.txt", "sub"]
    assert store.isdir(store.join(d, "sub")) and not store.isdir(f)
    store.makedirs(store.get_logs_path("r"))
    store.makedirs(store.get_logs_path("r"))  # exists: fine
    with pytest.raises(FileNotFoundError):
        store.listdir(store.join(d, "nope"))
    store.delete(d)
    assert not store.exists(d) and not store.exists(f)
    store.delete(d)  # already gone: fine


def test_open_input_reads_parquet(store):
    path = store.join(store.get_data_path("k"), "t.parquet")
    table = pa.table({"x": [1, 2, 3]})
    with store.atomic_writer(path) as f:
        pq.write_table(table, f)
    with store.open_input(path) as f:
        assert pq.read_table(f).equals(table)


def test_atomic_writer_leaves_nothing_on_error(store):
    d = store.get_checkpoint_path("run")
    target = store.join(d, "epoch-00001.pt")
    with pytest.raises(RuntimeError, match="boom"):
        with store.atomic_writer(target) as f:
            f.write(b"half")
            raise RuntimeError("boom")
    assert not store.exists(target)
    assert _names_on_disk(store, d) == []
    # An existing file is left untouched by a failed overwrite.
    store.write_bytes(target, b"good")
    with pytest.raises(RuntimeError):
        with store.atomic_writer(target) as f:
            f.write(b"bad")
            raise RuntimeError("boom")
    assert store.read_bytes(target) == b"good"
    assert _names_on_disk(store, d) == ["epoch-00001.pt"]


def test_atomic_writer_invisible_until_done(store):
    target = store.join(store.prefix_path, "x", "file.bin")
    with store.atomic_writer(target) as f:
        f.write(b"partial")
        assert not store.exists(target)
        assert store.listdir(store.join(store.prefix_path, "x")) == []  # temp hidden
    assert store.read_bytes(target) == b"partial"
    assert _names_on_disk(store, store.join(store.prefix_path, "x")) == ["file.bin"]


def test_list_checkpoints_ignores_temp_and_other_files(store):
    assert store.list_checkpoints("run") == []
    for epoch in (10, 2, 1):
        store.write_bytes(store.get_checkpoint_file("run", epoch), b"c")
    d = store.get_checkpoint_path("run")
    store.write_bytes(store.join(d, "epoch-7.pt"), b"c")  # unpadded names count too
    store.write_bytes(store.join(d, "notes.txt"), b"x")
    store.write_bytes(store.join(d, "epoch-x.pt"), b"x")
    # A half-written checkpoint of a crashed writer: a temp file next to the targets.
    with store.filesystem.open_output_stream(store.fs_path(d) + "/.epoch-00011.pt.tmp-abc") as f:
        f.write(b"half")
    assert [e for e, _ in store.list_checkpoints("run")] == [1, 2, 7, 10]
    assert store.list_checkpoints("run")[-1][1] == store.get_checkpoint_file("run", 10)


def test_pickle_round_trip(store):
    store.write_bytes(store.join(store.prefix_path, "a"), b"1")
    assert store.filesystem is not None  # built: must not be pickled
    clone = pickle.loads(pickle.dumps(store))
    assert clone == store and clone._fs is None
    assert clone.get_data_path("k") == store.get_data_path("k")
    assert clone.read_bytes(store.join(store.prefix_path, "a")) == b"1"


def test_filesystem_types(tmp_path):
    assert isinstance(LocalStore(str(tmp_path)).filesystem, pafs.LocalFileSystem)
    fs = FilesystemStore("memory://x").filesystem
    assert isinstance(fs, pafs.PyFileSystem) and isinstance(fs.handler, pafs.FSSpecHandler)
    assert FilesystemStore(f"file://{tmp_path}").fs_path(f"file://{tmp_path}/a/b") == \
        f"{tmp_path}/a/b"


def test_storage_options_travel_with_pickle():
    s = FilesystemStore("memory://opts", skip_instance_cache=True)
    assert pickle.loads(pickle.dumps(s))._storage_options == {"skip_instance_cache": True}


def test_unknown_protocol_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown filesystem protocol 'nosuchfs'"):
        Store.create("nosuchfs://bucket/x")


def test_missing_fsspec_implementation_names_the_package():
    pytest.importorskip("fsspec")
    try:
        import s3fs  # noqa: F401
        pytest.skip("s3fs is installed")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="pip install s3fs"):
        Store.create("s3://bucket/prefix")


def test_hdfs_store_without_hadoop_is_a_clear_error(monkeypatch, tmp_path):
    for var in ("HADOOP_HOME", "ARROW_LIBHDFS_DIR", "CLASSPATH", "JAVA_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no hadoop, no java
    monkeypatch.setattr("ctypes.util.find_library", lambda name: None)
    with pytest.raises(RuntimeError) as e:
        Store.create("hdfs://namenode:8020/user/me")
    msg = str(e.value)
    assert "JAVA_HOME" in msg and "libhdfs" in msg and "CLASSPATH" in msg


def test_hdfs_store_paths(monkeypatch):
    monkeypatch.setattr("spark_hvd.estimators.store.hdfs_environment_problems", lambda: [])
    s = HDFSStore("hdfs://nn:8020/user/me")
    assert (s._host, s._port) == ("nn", 8020)
    assert s.fs_path(s.get_data_path("k")) == "/user/me/intermediate_train_data.k"
    assert pickle.loads(pickle.dumps(s)) == s
    # Horovod's forms: a plain path is on the default namenode, other paths on the prefix's.
    assert HDFSStore("/user/me").prefix_path == "hdfs:///user/me"
    s = HDFSStore("hdfs://nn:8020/user/me", train_path="/data/train", driver="libhdfs")
    assert s.get_train_data_path() == "hdfs://nn:8020/data/train"
    with pytest.raises(ValueError, match="needs an hdfs:// URL"):
        HDFSStore("s3://bucket/x")


def test_dbfs_paths_need_the_databricks_mount():
    # This machine has no /dbfs: every DBFS spelling is refused with what to use instead,
    # rather than creating a local "dbfs:" directory or a /dbfs tree outside Databricks.
    if os.path.isdir("/dbfs"):
        pytest.skip("this machine has a /dbfs mount")
    for path in ("dbfs:/ml/store", "/dbfs/ml/store", "file:/dbfs/ml/store",
                 "file:///dbfs/ml/store"):
        with pytest.raises(ValueError, match=r"DBFS mount /dbfs is missing.*hdfs://"):
            Store.create(path)
    with pytest.raises(ValueError, match="not a DBFS path"):
        DBFSLocalStore("/tmp/store")


def test_dbfs_store_maps_every_spelling_to_the_mount(tmp_path):
    class MountedHere(DBFSLocalStore):  # the mount's location is the only thing moved
        MOUNT = str(tmp_path / "dbfs")

    os.makedirs(MountedHere.MOUNT)
    root = f"{MountedHere.MOUNT}/ml/store"
    for path in ("dbfs:/ml/store", "dbfs:/ml/store/", root, f"file:{root}", f"file://{root}"):
        store = MountedHere(path)
        assert store.prefix_path == root, path
    assert MountedHere.normalize_datbricks_path("dbfs:/a/b") == f"{MountedHere.MOUNT}/a/b"
    assert not MountedHere.matches_dbfs("dbfs://workspace/a")  # fsspec's dbfs:// protocol
    store = MountedHere("dbfs:/ml/store")
    store.write_text(store.join(store.get_run_path("r1"), "note.txt"), "kept")
    assert open(f"{root}/runs/r1/note.txt").read() == "kept"


def test_horovod_module_paths():
    import spark_hvd.estimators as est
    from spark_hvd.spark.common import backend, store
    assert (store.Store, store.LocalStore, store.DBFSLocalStore, store.HDFSStore,
            store.FilesystemStore) == (Store, LocalStore, DBFSLocalStore, HDFSStore,
                                       FilesystemStore)
    assert backend.SparkBackend is est.SparkBackend
    pytest.importorskip("torch")
    import spark_hvd.spark.torch as hvd_torch
    assert (hvd_torch.TorchEstimator, hvd_torch.TorchModel) == (est.TorchEstimator,
                                                                 est.TorchModel)
    pytest.importorskip("tensorflow")
    import spark_hvd.spark.keras as hvd_keras
    assert (hvd_keras.KerasEstimator, hvd_keras.KerasModel) == (est.KerasEstimator,
                                                                est.KerasModel)


# -- Horovod's constructor keywords and methods -------------------------------------------------

def test_horovod_keywords_move_each_part(tmp_path):
    store = Store.create(str(tmp_path / "s"), train_path=str(tmp_path / "tr"),
                         val_path=str(tmp_path / "va"), test_path="rel-test",
                         runs_path=str(tmp_path / "r"), checkpoint_filename="ckpt")
    assert type(store) is LocalStore
    assert store.get_train_data_path() == str(tmp_path / "tr")
    assert store.get_train_data_path("k") == f"{tmp_path}/tr.k"
    assert store.get_val_data_path(3) == f"{tmp_path}/va.3"
    assert store.get_test_data_path() == os.path.join(os.getcwd(), "rel-test")
    assert store.get_run_path("x") == f"{tmp_path}/r/x"
    assert store.get_checkpoint_filename() == "ckpt"
    for epoch in (0, 1):
        store.write_bytes(store.get_checkpoint_file("x", epoch, "pt"), b"c")
    store.write_bytes(store.join(store.get_checkpoint_path("x"), "epoch-00005.pt"), b"other")
    assert [e for e, _ in store.list_checkpoints("x")] == [0, 1]
    assert store.get_checkpoints("x") == [store.get_checkpoint_file("x", e) for e in (0, 1)]
    assert store.get_checkpoints("x", suffix=".keras") == []
    assert pickle.loads(pickle.dumps(store)) == store


def test_save_runs_false_keeps_no_runs(store):
    hvd_style = type(store)(store.prefix_path, save_runs=False)
    assert not hvd_style.saving_runs()
    assert hvd_style.get_checkpoint_path("r") is None and hvd_style.get_logs_path("r") is None
    assert hvd_style.list_checkpoints("r") == [] and hvd_style.get_checkpoints("r") == []
    with pytest.raises(ValueError, match="save_runs=False"):
        hvd_style.get_checkpoint_file("r", 1)


def test_read_exists_and_parquet_datasets(store):
    d = store.get_train_data_path("k")
    assert not store.is_parquet_dataset(d)
    for i in range(2):
        with store.atomic_writer(store.join(d, f"part-{i}.parquet")) as f:
            pq.write_table(pa.table({"x": [i, i + 10]}), f)
    store.write_text(store.join(d, "_metadata.json"), "{}")     # skipped by Parquet readers
    assert store.exists(d) and store.is_parquet_dataset(d)
    assert sorted(store.get_parquet_dataset(d).read().column("x").to_pylist()) == [0, 1, 10, 11]
    assert store.read(store.join(d, "_metadata.json")) == b"{}"
    assert not store.is_parquet_dataset(store.join(d, "_metadata.json"))
    assert store.fs.exists(store.get_localized_path(d))


def test_local_output_dir_sync_and_to_remote(store):
    remote = store.to_remote("run1", "k")
    assert remote.train_data_path == store.get_train_data_path("k")
    assert remote.val_data_path == store.get_val_data_path("k")
    assert remote.run_path == store.get_run_path("run1")
    assert remote.checkpoint_filename == store.get_checkpoint_filename()
    assert remote.logs_subdir == "logs" and remote.saving_runs
    with remote.get_local_output_dir() as local:
        os.makedirs(os.path.join(local, "logs"))
        with open(os.path.join(local, "logs", "events"), "w") as f:
            f.write("e1")
        with open(os.path.join(local, "top.txt"), "w") as f:
            f.write("t")
        sync = pickle.loads(pickle.dumps(remote.sync))   # travels to the ranks
        sync(local)
    assert not os.path.exists(local)
    assert store.read_text(store.join(store.get_logs_path("run1"), "events")) == "e1"
    assert store.read_text(store.join(store.get_run_path("run1"), "top.txt")) == "t"


def test_filesystem_store_takes_local_paths_and_storage_options(tmp_path):
    # Horovod's FilesystemStore is its store for local paths too (LocalStore is its alias).
    fs_store = FilesystemStore(str(tmp_path / "fss"), storage_options={"auto_mkdir": True})
    assert fs_store.prefix_path == f"file://{tmp_path}/fss"
    assert fs_store.storage_options == {"auto_mkdir": True}
    fs_store.write_text(fs_store.join(fs_store.get_run_path("r"), "a.txt"), "x")
    assert open(tmp_path / "fss" / "runs" / "r" / "a.txt").read() == "x"
    assert fs_store.get_train_data_path() == f"file://{tmp_path}/fss/intermediate_train_data"
    assert FilesystemStore("memory://m", val_path="memory://v/d").get_val_data_path() == \
        "memory://v/d"
    assert fs_store.fs is fs_store.fsspec_filesystem


def test_abstract_filesystem_store_and_backend_classes():
    from spark_hvd.spark.common.backend import Backend, SparkBackend
    from spark_hvd.spark.common.store import AbstractFilesystemStore
    for cls in (LocalStore, HDFSStore, FilesystemStore, DBFSLocalStore):
        assert issubclass(cls, AbstractFilesystemStore) and issubclass(cls, Store)
    assert issubclass(SparkBackend, Backend)
    with pytest.raises(NotImplementedError):
        Backend().num_processes()
