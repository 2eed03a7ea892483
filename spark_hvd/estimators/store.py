"""Where the estimators keep prepared data, checkpoints and logs: a directory tree under one
prefix, on a local disk, HDFS, or anything fsspec reaches (s3://, gs://, abfs://, ...). The
constructors, layout and methods are Horovod's (``horovod.spark.common.store``), so a Horovod
script's Store works unchanged.

    store = Store.create("/tmp/spark_hvd_store")   # LocalStore
    store = Store.create("hdfs://nn:8020/user/me")  # HDFSStore
    store = Store.create("s3://bucket/prefix")      # FilesystemStore (needs s3fs)
    store = Store.create("dbfs:/ml/store")          # DBFSLocalStore: /dbfs/ml/store (Databricks)
    store = LocalStore("/tmp/s", train_path="/data/train", val_path="/data/val",
                       save_runs=False)             # Horovod's keywords

Layout under the prefix (each part movable with Horovod's keywords)::

    intermediate_train_data.<data_key>/   prepared training shards + _metadata.json  (train_path)
    intermediate_val_data.<data_key>/     prepared validation shards                 (val_path)
    runs/<run_id>/checkpoints/            <checkpoint_filename>-<epoch>.<ext>, atomic (runs_path)
    runs/<run_id>/logs/

A Store is shipped to Spark executors and training ranks, so it pickles as its URL and options
only; the filesystem client is built lazily wherever it is first used.

Writes are atomic: ``atomic_writer`` writes a hidden temporary file next to the target and
renames it over the target on success, so a reader (or a resume after a crash) never sees a
half-written file. On object stores (s3, gs, ...) rename is copy + delete, so there the guarantee
is only the store's own per-object atomicity: the target object appears whole or not at all,
but a crash can leave the temporary object behind.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import os
import posixpath
import re
import shutil
import subprocess
import tempfile
import uuid
from urllib.parse import urlparse

__all__ = ["Store", "AbstractFilesystemStore", "LocalStore", "DBFSLocalStore", "HDFSStore",
           "FilesystemStore"]

# Horovod's default locations under the prefix.
TRAIN_DIR = "intermediate_train_data"
VAL_DIR = "intermediate_val_data"
TEST_DIR = "intermediate_test_data"
RUNS_DIR = "runs"
CHECKPOINTS_DIR = "checkpoints"
LOGS_DIR = "logs"
DEFAULT_CHECKPOINT_FILENAME = "epoch"

# Temporary files of atomic_writer: hidden (leading dot) and tagged, so listings can skip them.
_TMP_TAG = ".tmp-"


def _is_temp(name: str) -> bool:
    return name.startswith(".") and _TMP_TAG in name


def _scheme(url: str) -> str:
    """The URL scheme of ``url`` ('' for a plain path; Windows drive letters are no scheme)."""
    m = re.match(r"^([A-Za-z][A-Za-z0-9+.\-]*)://", url)
    if m:
        return m.group(1).lower()
    # fsspec chained URLs ("simplecache::s3://...") start with a protocol too.
    m = re.match(r"^([A-Za-z][A-Za-z0-9+.\-]*)::", url)
    return m.group(1).lower() if m else ""


class Store:
    """Base class: a directory tree under ``prefix_path`` with atomic writes.

    Subclasses provide :attr:`filesystem` (a ``pyarrow.fs.FileSystem``), :meth:`fs_path`
    (a Store path → that filesystem's path) and :meth:`get_full_path` (a path given by the user
    → a Store path); every other operation is built on those. Paths given to and returned by a
    Store are strings in the Store's own form (a local path for LocalStore, a full URL
    otherwise), as returned by the ``get_*`` methods and :meth:`join`.

    Every subclass takes Horovod's keywords:

    Keyword Args:
        train_path, val_path, test_path: where prepared training / validation / test data
            goes (default ``<prefix>/intermediate_train_data`` etc.); data set ``<key>`` is in
            ``<train_path>.<key>``. ``fit_on_parquet()`` reads ``train_path`` and ``val_path``
            themselves: point them at existing Parquet data to train on it.
        runs_path: where runs go (default ``<prefix>/runs``).
        save_runs: False writes no checkpoints or logs (a fit then cannot be resumed).
        storage_options: options of the fsspec filesystem (FilesystemStore only).
        checkpoint_filename: the name checkpoint files start with (default ``"epoch"``:
            ``epoch-00003.pt``).
    """

    def __init__(self, prefix_path: str, train_path: str | None = None,
                 val_path: str | None = None, test_path: str | None = None,
                 runs_path: str | None = None, save_runs: bool = True,
                 storage_options: dict | None = None, checkpoint_filename: str | None = None):
        self._prefix = prefix_path.rstrip("/") or "/"
        self._fs = None
        self._save_runs = bool(save_runs)
        self.storage_options = storage_options
        if checkpoint_filename is not None and (not checkpoint_filename
                                                or "/" in checkpoint_filename):
            raise ValueError(f"checkpoint_filename={checkpoint_filename!r}: give a file name "
                             "(no directories)")
        self.checkpoint_filename = checkpoint_filename or DEFAULT_CHECKPOINT_FILENAME
        self._checkpoint_re = re.compile(
            "^" + re.escape(self.checkpoint_filename) + r"-(\d+)\.([A-Za-z0-9_.]+)$")
        self._train_path = self._path_or_default(train_path, TRAIN_DIR)
        self._val_path = self._path_or_default(val_path, VAL_DIR)
        self._test_path = self._path_or_default(test_path, TEST_DIR)
        self._runs_path = self._path_or_default(runs_path, RUNS_DIR)

    def _path_or_default(self, path, default_name):
        if path is None:
            return self.join(self._prefix, default_name)
        return self.get_full_path(str(path)).rstrip("/") or "/"

    @staticmethod
    def create(prefix_path: str, *args, **kwargs) -> "Store":
        """The Store for ``prefix_path``, chosen by its scheme.

        ``dbfs:/...`` or a path under ``/dbfs`` → :class:`DBFSLocalStore` (Databricks' local DBFS
        mount, as in Horovod); any other path or ``file://`` → :class:`LocalStore`;
        ``hdfs://`` → :class:`HDFSStore`;
        anything else → :class:`FilesystemStore` (fsspec). ``args`` and ``kwargs`` go to that
        class: Horovod's keywords (``train_path``, ``save_runs``, ...) and its own (for fsspec:
        ``storage_options``, e.g. ``key=``/``secret=`` for s3).
        """
        if DBFSLocalStore.matches_dbfs(prefix_path):
            return DBFSLocalStore(prefix_path, *args, **kwargs)
        scheme = _scheme(prefix_path)
        if scheme in ("", "file"):
            return LocalStore(prefix_path, *args, **kwargs)
        if scheme == "hdfs":
            return HDFSStore(prefix_path, *args, **kwargs)
        return FilesystemStore(prefix_path, *args, **kwargs)

    # -- pickling: URL and options travel, the filesystem client is rebuilt lazily ----------

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_fs"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)

    def __repr__(self):
        return f"{type(self).__name__}({self._prefix!r})"

    def __eq__(self, other):
        return type(self) is type(other) and self.__getstate__() == other.__getstate__()

    def __hash__(self):
        return hash((type(self).__name__, self._prefix))

    # -- layout --------------------------------------------------------------------------

    @property
    def prefix_path(self) -> str:
        """The root of this Store (a local path or a URL)."""
        return self._prefix

    def join(self, path: str, *names: str) -> str:
        """``path`` with ``names`` appended, '/'-separated."""
        for name in names:
            path = path.rstrip("/") + "/" + name.lstrip("/")
        return path

    def get_full_path(self, path: str) -> str:
        """``path`` as a Store path (Horovod's name): a relative local path made absolute, a
        path without a scheme given this Store's."""
        raise NotImplementedError

    def get_localized_path(self, path: str) -> str:
        """``path`` as :attr:`fs` takes it (Horovod's name for :meth:`fs_path`)."""
        return self.fs_path(path)

    @staticmethod
    def _indexed(path: str, idx) -> str:
        return path if idx is None else f"{path}.{idx}"

    def get_train_data_path(self, idx=None) -> str:
        """``train_path``, or with ``idx`` (a data key, as ``util.prepare_data`` yields it)
        the directory of that prepared data set's training shards: ``<train_path>.<idx>``."""
        return self._indexed(self._train_path, idx)

    def get_val_data_path(self, idx=None) -> str:
        """``val_path``, or with ``idx`` ``<val_path>.<idx>`` (validation shards)."""
        return self._indexed(self._val_path, idx)

    def get_test_data_path(self, idx=None) -> str:
        """``test_path``, or with ``idx`` ``<test_path>.<idx>`` (nothing is written there by
        spark_hvd; Horovod has it too)."""
        return self._indexed(self._test_path, idx)

    def get_data_path(self, data_key: str) -> str:
        """Directory of prepared data set ``data_key``'s ``_metadata.json`` (its training
        shards' directory, ``<train_path>.<data_key>``)."""
        return self.get_train_data_path(data_key)

    def saving_runs(self) -> bool:
        """Whether fits write checkpoints and logs under ``runs/`` (Horovod's ``save_runs``)."""
        return self._save_runs

    def get_runs_path(self) -> str:
        """Directory holding every training run (``runs``)."""
        return self._runs_path

    def get_run_path(self, run_id: str) -> str:
        """Directory of training run ``run_id`` (``runs/<run_id>``)."""
        return self.join(self.get_runs_path(), run_id)

    def get_checkpoint_path(self, run_id: str) -> str | None:
        """Directory of run ``run_id``'s checkpoints (``runs/<run_id>/checkpoints``); None
        when the Store does not save runs."""
        if not self._save_runs:
            return None
        return self.join(self.get_run_path(run_id), CHECKPOINTS_DIR)

    def get_logs_subdir(self) -> str:
        """The name of a run's log directory (``logs``)."""
        return LOGS_DIR

    def get_logs_path(self, run_id: str) -> str | None:
        """Directory of run ``run_id``'s logs (``runs/<run_id>/logs``, TensorBoard's logdir
        of the run); None when the Store does not save runs."""
        if not self._save_runs:
            return None
        return self.join(self.get_run_path(run_id), self.get_logs_subdir())

    def get_checkpoint_filename(self) -> str:
        """The name every checkpoint file starts with (``checkpoint_filename``, default
        ``"epoch"``): the checkpoint after epoch 3 is ``<name>-00003.<ext>``."""
        return self.checkpoint_filename

    def get_checkpoint_file(self, run_id: str, epoch: int, ext: str = "pt") -> str:
        """Full path of run ``run_id``'s checkpoint after ``epoch``
        (write it with :meth:`atomic_writer`)."""
        if not self._save_runs:
            raise ValueError(f"{self!r} was made with save_runs=False: it keeps no checkpoints")
        name = f"{self.checkpoint_filename}-{int(epoch):05d}.{ext.lstrip('.')}"
        return self.join(self.get_checkpoint_path(run_id), name)

    def list_checkpoints(self, run_id: str) -> list[tuple[int, str]]:
        """``[(epoch, path), ...]`` of run ``run_id``'s checkpoints, sorted by epoch.

        Only files named ``<checkpoint_filename>-<int>.<ext>`` count; temporary files of an
        interrupted write are never listed, so the last entry is always a complete checkpoint.
        Empty when the run has none (or does not exist, or runs are not saved).
        """
        directory = self.get_checkpoint_path(run_id)
        if directory is None or not self.exists(directory):
            return []
        found = []
        for name in self.listdir(directory):
            m = self._checkpoint_re.match(name)
            if m and not _is_temp(name):
                found.append((int(m.group(1)), self.join(directory, name)))
        return sorted(found)

    def get_checkpoints(self, run_id: str, suffix: str | None = None) -> list[str]:
        """Paths of run ``run_id``'s checkpoints, oldest epoch first (Horovod's method); with
        ``suffix`` only those ending with it (``".pt"`` Torch, ``".keras"`` Keras)."""
        return [path for _, path in self.list_checkpoints(run_id)
                if suffix is None or path.endswith(suffix)]

    def get_local_output_dir_fn(self, run_id: str):
        """A function returning a context manager that yields a fresh local directory for
        run ``run_id``'s output, deleted on exit (Horovod's; copy it into the run with
        :meth:`sync_fn`)."""
        @contextlib.contextmanager
        def local_run_path():
            with tempfile.TemporaryDirectory(prefix=f"spark_hvd_{run_id}_") as directory:
                yield directory
        return local_run_path

    def sync_fn(self, run_id: str):
        """A picklable function ``fn(local_dir)`` that copies everything under ``local_dir``
        into ``runs/<run_id>/`` (each file atomically, overwriting)."""
        return _SyncToRun(self, run_id)

    def to_remote(self, run_id: str, dataset_idx=None):
        """A plain object with the paths and functions a training process needs (Horovod's
        RemoteStore): ``train_data_path``, ``val_data_path``, ``test_data_path``,
        ``saving_runs``, ``runs_path``, ``run_path``, ``checkpoint_path``, ``logs_path``,
        ``checkpoint_filename``, ``logs_subdir``, ``get_local_output_dir``, ``sync``, and
        ``store`` (this Store)."""
        return RemoteStore(
            train_data_path=self.get_train_data_path(dataset_idx),
            val_data_path=self.get_val_data_path(dataset_idx),
            test_data_path=self.get_test_data_path(dataset_idx),
            saving_runs=self.saving_runs(), runs_path=self.get_runs_path(),
            run_path=self.get_run_path(run_id), checkpoint_path=self.get_checkpoint_path(run_id),
            logs_path=self.get_logs_path(run_id),
            checkpoint_filename=self.get_checkpoint_filename(),
            logs_subdir=self.get_logs_subdir(),
            get_local_output_dir=self.get_local_output_dir_fn(run_id),
            sync=self.sync_fn(run_id), store=self)

    # -- filesystem ------------------------------------------------------------------------

    @property
    def filesystem(self):
        """The ``pyarrow.fs.FileSystem`` of this Store (built on first use); give it paths
        translated with :meth:`fs_path`."""
        if self._fs is None:
            self._fs = self._make_filesystem()
        return self._fs

    def _make_filesystem(self):
        raise NotImplementedError

    def fs_path(self, path: str) -> str:
        """``path`` (a Store path) as :attr:`filesystem` expects it."""
        raise NotImplementedError

    def _info(self, path: str):
        return self.filesystem.get_file_info(self.fs_path(path))

    def exists(self, path: str) -> bool:
        """True if a file or directory exists at ``path``."""
        import pyarrow.fs as pafs
        return self._info(path).type != pafs.FileType.NotFound

    def isdir(self, path: str) -> bool:
        """True if ``path`` is a directory."""
        import pyarrow.fs as pafs
        return self._info(path).type == pafs.FileType.Directory

    @property
    def fs(self):
        """This Store's filesystem as an ``fsspec`` filesystem (Horovod's ``store.fs``); give it
        paths translated with :meth:`get_localized_path`."""
        from fsspec.implementations.arrow import ArrowFSWrapper
        return ArrowFSWrapper(self.filesystem)

    def get_filesystem(self):
        """:attr:`fs` (Horovod's method)."""
        return self.fs

    def read_bytes(self, path: str) -> bytes:
        """The whole content of file ``path``."""
        with self.filesystem.open_input_stream(self.fs_path(path)) as f:
            return f.read()

    def read(self, path: str) -> bytes:
        """The whole content of file ``path`` (Horovod's name for :meth:`read_bytes`)."""
        return self.read_bytes(path)

    def get_parquet_dataset(self, path: str):
        """The Parquet data set (a directory of Parquet files, or one file) at ``path`` as a
        ``pyarrow.parquet.ParquetDataset``."""
        import pyarrow.parquet as pq
        return pq.ParquetDataset(self.fs_path(path), filesystem=self.filesystem)

    def is_parquet_dataset(self, path: str) -> bool:
        """Whether ``path`` holds a readable Parquet data set with at least one file."""
        try:
            return bool(self.get_parquet_dataset(path).files)
        except Exception:  # noqa: BLE001 - missing, not Parquet, unreadable: all mean no
            return False

    def write_bytes(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` atomically (parent directories are created)."""
        with self.atomic_writer(path) as f:
            f.write(data)

    def read_text(self, path: str, encoding: str = "utf-8") -> str:
        """The content of text file ``path``."""
        return self.read_bytes(path).decode(encoding)

    def write_text(self, path: str, text: str, encoding: str = "utf-8") -> None:
        """Write ``text`` to ``path`` atomically."""
        self.write_bytes(path, text.encode(encoding))

    def makedirs(self, path: str) -> None:
        """Create directory ``path`` and its parents (no error if it exists). On object stores
        directories are implicit, so this may do nothing."""
        self.filesystem.create_dir(self.fs_path(path), recursive=True)

    def listdir(self, path: str) -> list[str]:
        """Sorted names (not paths) of the entries of directory ``path``, temporary files of
        unfinished atomic writes excluded. FileNotFoundError if ``path`` does not exist."""
        import pyarrow.fs as pafs
        fs_path = self.fs_path(path)
        if self.filesystem.get_file_info(fs_path).type == pafs.FileType.NotFound:
            raise FileNotFoundError(f"no such directory in {self!r}: {path}")
        infos = self.filesystem.get_file_info(pafs.FileSelector(fs_path, recursive=False))
        names = (posixpath.basename(info.path.rstrip("/")) for info in infos)
        return sorted(n for n in names if n and not _is_temp(n))

    def delete(self, path: str) -> None:
        """Delete ``path``: a file, or a directory with everything under it. Nothing to do if it
        does not exist."""
        import pyarrow.fs as pafs
        fs_path = self.fs_path(path)
        kind = self.filesystem.get_file_info(fs_path).type
        if kind == pafs.FileType.Directory:
            self.filesystem.delete_dir(fs_path)
        elif kind != pafs.FileType.NotFound:
            self.filesystem.delete_file(fs_path)

    def open_input(self, path: str):
        """File ``path`` opened for random-access binary reading (what ``pyarrow.parquet``
        wants); close it, or use it as a context manager."""
        return self.filesystem.open_input_file(self.fs_path(path))

    @contextlib.contextmanager
    def atomic_writer(self, path: str):
        """Context manager yielding a binary writable file whose content appears at ``path``
        only when the block ends without an exception.

        The data goes to a hidden temporary file in the same directory, renamed over ``path``
        on success and removed on failure: no reader ever sees a partial ``path``. (On object
        stores rename is copy + delete: the target is still never partial, but a crash may
        leave the temporary object.)
        """
        parent, name = posixpath.split(self.fs_path(path))
        tmp = posixpath.join(parent, f".{name}{_TMP_TAG}{uuid.uuid4().hex}")
        fs = self.filesystem
        if parent:
            fs.create_dir(parent, recursive=True)
        out = fs.open_output_stream(tmp)
        try:
            yield out
            out.close()
            self._replace(tmp, self.fs_path(path))
        except BaseException:
            with contextlib.suppress(Exception):
                out.close()
            with contextlib.suppress(Exception):
                fs.delete_file(tmp)
            raise

    def _replace(self, tmp: str, target: str) -> None:
        """Rename filesystem path ``tmp`` over ``target``."""
        self.filesystem.move(tmp, target)


class RemoteStore:
    """What :meth:`Store.to_remote` returns: the run's paths and functions as attributes."""

    def __init__(self, **attributes):
        self.__dict__.update(attributes)

    def __repr__(self):
        return f"RemoteStore(run_path={self.run_path!r})"


class _SyncToRun:
    """:meth:`Store.sync_fn`'s function: copies a local directory tree into a run's directory
    (picklable: it carries the Store, which rebuilds its filesystem where it is called)."""

    def __init__(self, store: Store, run_id: str):
        self.store, self.run_id = store, run_id

    def __call__(self, local_dir: str) -> None:
        run_path = self.store.get_run_path(self.run_id)
        for directory, _, files in os.walk(local_dir):
            rel = os.path.relpath(directory, local_dir)
            for name in files:
                target = run_path if rel == "." else self.store.join(run_path, rel)
                with open(os.path.join(directory, name), "rb") as f:
                    self.store.write_bytes(self.store.join(target, name), f.read())


class AbstractFilesystemStore(Store):
    """Base of the Stores on a filesystem (Horovod's name): LocalStore, HDFSStore,
    FilesystemStore and DBFSLocalStore derive from it. A Store of your own derives from it and
    provides ``_make_filesystem``, ``fs_path`` and ``get_full_path``."""


class LocalStore(AbstractFilesystemStore):
    """A Store on a local (or network-mounted) directory: a plain path or a ``file://`` URL.

    Every executor must see the same directory at the same path (one machine, or a shared
    mount). Relative paths are made absolute on the machine that creates the Store. Atomic writes
    are fsync'ed before the rename, so a checkpoint survives a machine crash whole.
    """

    def __init__(self, prefix_path: str, *args, **kwargs):
        super().__init__(self.get_full_path(prefix_path), *args, **kwargs)

    def get_full_path(self, path: str) -> str:
        """``path`` as an absolute local path (``file://`` and ``~`` resolved)."""
        if _scheme(path) == "file":
            path = urlparse(path).path
        return os.path.abspath(os.path.expanduser(path))

    def _make_filesystem(self):
        import pyarrow.fs as pafs
        return pafs.LocalFileSystem()

    def fs_path(self, path: str) -> str:
        """``path`` without a ``file://`` scheme, absolute."""
        if path.startswith("file://"):
            path = urlparse(path).path
        return os.path.abspath(path)

    @contextlib.contextmanager
    def atomic_writer(self, path: str):
        """See :meth:`Store.atomic_writer`; locally the rename is ``os.replace`` (atomic on
        POSIX) after an fsync of the data."""
        target = self.fs_path(path)
        parent, name = os.path.split(target)
        os.makedirs(parent, exist_ok=True)
        tmp = os.path.join(parent, f".{name}{_TMP_TAG}{uuid.uuid4().hex}")
        f = open(tmp, "wb")
        try:
            yield f
            f.flush()
            os.fsync(f.fileno())
            f.close()
            os.replace(tmp, target)
        except BaseException:
            f.close()
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise

    def delete(self, path: str) -> None:
        """Delete file or directory tree ``path`` (nothing to do if it does not exist)."""
        target = self.fs_path(path)
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)
        elif os.path.lexists(target):
            os.remove(target)


class DBFSLocalStore(LocalStore):
    """A LocalStore on Databricks' DBFS through its local mount, ``/dbfs`` (as Horovod's).

    ``prefix_path`` may be ``dbfs:/p``, ``/dbfs/p``, ``file:/dbfs/p`` or ``file:///dbfs/p``:
    all mean ``/dbfs/p``, which every Databricks driver and executor sees. Raises ValueError
    for a path outside ``/dbfs`` and where the mount is missing (not on Databricks: use a
    shared directory, ``hdfs://`` or an fsspec URL such as ``s3://`` instead).
    """

    MOUNT = "/dbfs"

    def __init__(self, prefix_path: str, *args, **kwargs):
        path = self.normalize_databricks_path(prefix_path)
        if not (path + "/").startswith(self.MOUNT + "/"):
            raise ValueError(f"DBFSLocalStore({prefix_path!r}): not a DBFS path; give dbfs:/..., "
                             f"{self.MOUNT}/..., file:{self.MOUNT}/... or file://{self.MOUNT}/...")
        if not os.path.isdir(self.MOUNT):
            raise ValueError(f"DBFSLocalStore({prefix_path!r}): the DBFS mount {self.MOUNT} is "
                             "missing on this machine (it exists on Databricks); use a shared "
                             "directory, hdfs:// or an fsspec URL (s3://, abfs://, ...) instead")
        super().__init__(path, *args, **kwargs)

    def get_full_path(self, path: str) -> str:
        """``path`` (any DBFS spelling, or a local path) as a path under the mount."""
        return super().get_full_path(self.normalize_databricks_path(path))

    @classmethod
    def matches_dbfs(cls, path: str) -> bool:
        """Whether ``path`` names a DBFS location (``dbfs:/...`` or under the mount)."""
        return cls.normalize_databricks_path(path).startswith(cls.MOUNT + "/")

    @classmethod
    def normalize_databricks_path(cls, path: str) -> str:
        """``path`` as a path under the local mount: ``dbfs:/p`` → ``/dbfs/p``."""
        if path.startswith("dbfs:/") and not path.startswith("dbfs://"):
            return cls.MOUNT + "/" + path[len("dbfs:/"):].lstrip("/")
        for prefix in (f"file://{cls.MOUNT}/", f"file:{cls.MOUNT}/"):
            if path.startswith(prefix):
                return cls.MOUNT + "/" + path[len(prefix):]
        return path

    # Horovod's spelling of the same method.
    normalize_datbricks_path = normalize_databricks_path


class HDFSStore(AbstractFilesystemStore):
    """A Store on HDFS through ``pyarrow.fs.HadoopFileSystem`` (libhdfs over JNI).

    ``prefix_path`` is ``hdfs://namenode:port/path``, or ``hdfs:///path`` or ``/path`` for the
    cluster's default filesystem (``fs.defaultFS`` of the Hadoop configuration); ``host`` and
    ``port`` override the URL's. Horovod's ``driver`` argument is accepted: PyArrow has only
    libhdfs now. Paths without a scheme given to the Store (``train_path=``, ...) are on the
    same namenode. Needs, on the driver and
    every executor: Java (``JAVA_HOME``), libhdfs (``ARROW_LIBHDFS_DIR`` or
    ``$HADOOP_HOME/lib/native``) and the Hadoop jars on ``CLASSPATH`` (when unset it is filled
    from ``hadoop classpath --glob`` if the ``hadoop`` command is on PATH).

    HDFS rename does not replace an existing file, so an atomic write over an existing path
    deletes the old file just before the rename: a crash between the two leaves the path missing
    (never partial).
    """

    def __init__(self, prefix_path: str, host: str | None = None, port: int | None = None,
                 user: str | None = None, kerb_ticket: str | None = None,
                 driver: str = "libhdfs", extra_conf: dict | None = None, *args, **kwargs):
        scheme = _scheme(prefix_path)
        if scheme == "":
            prefix_path = "hdfs://" + prefix_path   # "/user/me" -> "hdfs:///user/me"
        elif scheme != "hdfs":
            raise ValueError(f"HDFSStore needs an hdfs:// URL or an HDFS path, got "
                             f"{prefix_path!r}")
        parsed = urlparse(prefix_path)
        if not parsed.path:
            raise ValueError(f"HDFSStore({prefix_path!r}): the URL has no path")
        # "hdfs://nn:8020" of the prefix: the namenode other paths without a scheme are on.
        self._url_prefix = prefix_path[:len(prefix_path) - len(parsed.path)]
        super().__init__(prefix_path, *args, **kwargs)
        self._host = host if host is not None else (parsed.hostname or "default")
        self._port = port if port is not None else (parsed.port or 0)
        self._user = user
        self._kerb_ticket = kerb_ticket
        self._extra_conf = dict(extra_conf or {})
        problems = hdfs_environment_problems()
        if problems:
            raise RuntimeError(
                f"HDFSStore({prefix_path!r}) cannot reach HDFS from this machine:\n  - "
                + "\n  - ".join(problems)
                + "\nSet these on the driver and on every executor (spark.executorEnv.*), "
                "or use a Store on another filesystem.")

    def _make_filesystem(self):
        import pyarrow.fs as pafs
        _fill_hadoop_classpath()
        try:
            return pafs.HadoopFileSystem(self._host, self._port, user=self._user,
                                         kerb_ticket=self._kerb_ticket,
                                         extra_conf=self._extra_conf or None)
        except OSError as e:
            problems = hdfs_environment_problems()
            hint = ("; ".join(problems)) if problems else "check the namenode address"
            raise OSError(f"cannot connect to HDFS at {self._prefix}: {e} ({hint})") from e

    def get_full_path(self, path: str) -> str:
        """``path`` as an ``hdfs://`` URL on this Store's namenode."""
        if _scheme(path) == "hdfs":
            return path
        if _scheme(path):
            raise ValueError(f"HDFSStore: {path!r} is not on HDFS")
        return self._url_prefix + "/" + path.lstrip("/")

    def fs_path(self, path: str) -> str:
        """The path part of an ``hdfs://`` URL (what HadoopFileSystem takes)."""
        if path.startswith("hdfs://"):
            return urlparse(path).path or "/"
        return path

    def _replace(self, tmp: str, target: str) -> None:
        import pyarrow.fs as pafs
        if self.filesystem.get_file_info(target).type == pafs.FileType.File:
            self.filesystem.delete_file(target)
        self.filesystem.move(tmp, target)


def _fill_hadoop_classpath() -> None:
    # libhdfs finds the Hadoop classes only through CLASSPATH (wildcards are not expanded).
    if os.environ.get("CLASSPATH") or not shutil.which("hadoop"):
        return
    try:
        out = subprocess.run(["hadoop", "classpath", "--glob"], capture_output=True, text=True,
                             timeout=60, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return
    if out:
        os.environ["CLASSPATH"] = out


def hdfs_environment_problems() -> list[str]:
    """What is missing on this machine for ``pyarrow.fs.HadoopFileSystem`` (empty if nothing)."""
    problems = []
    java_home = os.environ.get("JAVA_HOME")
    if not (java_home and os.path.isdir(java_home)) and not ctypes.util.find_library("jvm"):
        problems.append("Java not found: set JAVA_HOME to a JDK/JRE directory")
    dirs = [os.environ.get("ARROW_LIBHDFS_DIR"),
            os.path.join(os.environ["HADOOP_HOME"], "lib", "native")
            if os.environ.get("HADOOP_HOME") else None]
    has_lib = any(d and os.path.exists(os.path.join(d, "libhdfs.so")) for d in dirs)
    if not has_lib and not ctypes.util.find_library("hdfs"):
        problems.append("libhdfs.so not found: set ARROW_LIBHDFS_DIR to the directory holding "
                        "it, or HADOOP_HOME to a Hadoop installation (lib/native/libhdfs.so)")
    if not os.environ.get("CLASSPATH") and not shutil.which("hadoop"):
        problems.append("the Hadoop jars are not on CLASSPATH: export "
                        "CLASSPATH=$(hadoop classpath --glob), or put the hadoop command on PATH")
    return problems


class FilesystemStore(AbstractFilesystemStore):
    """A Store on any fsspec filesystem: ``s3://``, ``gs://``, ``abfs://``, ``memory://``,
    ``file://`` (a plain local path too, as in Horovod), chained URLs such as
    ``simplecache::s3://...``.

    ``storage_options`` (Horovod's dict keyword, or loose keyword arguments) go to the fsspec
    filesystem, e.g. ``FilesystemStore("s3://bucket/x", storage_options={"key": ...})`` or
    ``FilesystemStore("s3://bucket/x", key=..., secret=...)``; they are
    pickled with the Store, so prefer credentials from the environment on shared clusters.
    The protocol's implementation package (s3fs, gcsfs, adlfs, ...) must be installed on the
    driver and every executor. Horovod's other keywords (``train_path``, ``save_runs``, ...)
    are those of :class:`Store`.

    ``memory://`` lives inside one Python process: it works for a Store used in one process,
    but not across Spark's Python workers (data prepared there is invisible to the driver).
    """

    def __init__(self, prefix_path: str, train_path: str | None = None,
                 val_path: str | None = None, test_path: str | None = None,
                 runs_path: str | None = None, save_runs: bool = True,
                 storage_options: dict | None = None, checkpoint_filename: str | None = None,
                 **more_storage_options):
        if not _scheme(prefix_path):
            prefix_path = _local_uri(prefix_path)
        protocol = _scheme(prefix_path)
        _check_fsspec_protocol(protocol, prefix_path)
        self._protocol = protocol
        options = dict(storage_options or {})
        options.update(more_storage_options)
        super().__init__(prefix_path, train_path=train_path, val_path=val_path,
                         test_path=test_path, runs_path=runs_path, save_runs=save_runs,
                         storage_options=options, checkpoint_filename=checkpoint_filename)
        self._storage_options = options
        self._root = None  # the prefix as the fsspec filesystem spells it

    def get_full_path(self, path: str) -> str:
        """``path`` as a URL: kept if it has a protocol, else on this Store's protocol (a
        ``file://`` URL of the absolute path for a local Store)."""
        if _scheme(path):
            return path
        if self._protocol == "file":
            return _local_uri(path)
        return f"{self._protocol}://{path.lstrip('/')}"

    @property
    def fs(self):
        """The fsspec filesystem (Horovod's ``store.fs``)."""
        return self.fsspec_filesystem

    def __getstate__(self):
        state = super().__getstate__()
        state["_root"] = None
        return state

    def _fsspec(self):
        import fsspec.core
        fs, root = fsspec.core.url_to_fs(self._prefix, **self._storage_options)
        self._root = root.rstrip("/") or "/"
        return fs

    @property
    def fsspec_filesystem(self):
        """The underlying ``fsspec.AbstractFileSystem``."""
        return self.filesystem.handler.fs

    def _make_filesystem(self):
        import pyarrow.fs as pafs
        return pafs.PyFileSystem(pafs.FSSpecHandler(self._fsspec()))

    def fs_path(self, path: str) -> str:
        """``path`` (a URL under the prefix) as a path of the fsspec filesystem."""
        fs = self.filesystem  # sets self._root
        if path == self._prefix or path.startswith(self._prefix + "/"):
            rel = path[len(self._prefix):].lstrip("/")
            return self._root.rstrip("/") + "/" + rel if rel else self._root
        return fs.handler.fs._strip_protocol(path)


def _local_uri(path: str) -> str:
    return "file://" + os.path.abspath(os.path.expanduser(path))


def _check_fsspec_protocol(protocol: str, url: str) -> None:
    """Fail early, naming the package to install, if fsspec cannot handle ``protocol``."""
    try:
        import fsspec
        from fsspec.registry import known_implementations
    except ImportError:
        raise ImportError(f"a Store for {url!r} needs fsspec: pip install fsspec") from None
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        raise ValueError(
            f"unknown filesystem protocol {protocol!r} in {url!r}: fsspec has no implementation "
            f"registered for it. Install the package that provides it (and registers it with "
            f"fsspec), or check the URL. Known protocols: "
            f"{', '.join(sorted(known_implementations))}") from None
    except ImportError as e:
        impl = known_implementations.get(protocol, {})
        package = impl.get("class", "").split(".")[0] or "its fsspec implementation"
        raise ImportError(
            f"a Store for {url!r} needs the fsspec implementation of {protocol!r}, which is not "
            f"installed: pip install {package} (on the driver and every executor). "
            f"({impl.get('err') or e})") from None
