"""Where the estimators keep prepared data, checkpoints and logs: a directory tree under one
prefix, on a local disk, HDFS, or anything fsspec reaches (s3://, gs://, abfs://, ...).

    store = Store.create("/tmp/spark_hvd_store")   # LocalStore
    store = Store.create("hdfs://nn:8020/user/me")  # HDFSStore
    store = Store.create("s3://bucket/prefix")      # FilesystemStore (needs s3fs)
    store = Store.create("dbfs:/ml/store")          # DBFSLocalStore: /dbfs/ml/store (Databricks)

Layout under the prefix::

    intermediate/<data_key>/        prepared training data (see ``_format``)
    runs/<run_id>/checkpoints/      epoch-<n>.<ext>, written atomically
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
import uuid
from urllib.parse import urlparse

__all__ = ["Store", "LocalStore", "DBFSLocalStore", "HDFSStore", "FilesystemStore"]

DATA_DIR = "intermediate"
RUNS_DIR = "runs"
CHECKPOINTS_DIR = "checkpoints"
LOGS_DIR = "logs"

# Temporary files of atomic_writer: hidden (leading dot) and tagged, so listings can skip them.
_TMP_TAG = ".tmp-"
_CHECKPOINT_RE = re.compile(r"^epoch-(\d+)\.([A-Za-z0-9_.]+)$")


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

    Subclasses provide :attr:`filesystem` (a ``pyarrow.fs.FileSystem``) and :meth:`fs_path`
    (a Store path → that filesystem's path); every other operation is built on those two.
    Paths given to and returned by a Store are strings in the Store's own form (a local path
    for LocalStore, a full URL otherwise), as returned by the ``get_*`` methods and :meth:`join`.
    """

    def __init__(self, prefix_path: str):
        self._prefix = prefix_path.rstrip("/") or "/"
        self._fs = None
        self._save_runs = True

    @staticmethod
    def create(prefix_path: str, **kwargs) -> "Store":
        """The Store for ``prefix_path``, chosen by its scheme.

        ``dbfs:/...`` or a path under ``/dbfs`` → :class:`DBFSLocalStore` (Databricks' local DBFS
        mount, as in Horovod); any other path or ``file://`` → :class:`LocalStore`;
        ``hdfs://`` → :class:`HDFSStore`;
        anything else → :class:`FilesystemStore` (fsspec). ``kwargs`` go to that class
        (for fsspec: the filesystem's storage options, e.g. ``key=``/``secret=`` for s3).
        """
        if DBFSLocalStore.matches_dbfs(prefix_path):
            return DBFSLocalStore(prefix_path, **kwargs)
        scheme = _scheme(prefix_path)
        if scheme in ("", "file"):
            return LocalStore(prefix_path, **kwargs)
        if scheme == "hdfs":
            return HDFSStore(prefix_path, **kwargs)
        return FilesystemStore(prefix_path, **kwargs)

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

    def get_data_path(self, data_key: str) -> str:
        """Directory of the prepared data set ``data_key`` (``intermediate/<data_key>``)."""
        return self.join(self._prefix, DATA_DIR, data_key)

    def saving_runs(self) -> bool:
        """Whether fits write checkpoints and logs under ``runs/`` (Horovod's ``save_runs``)."""
        return self._save_runs

    def get_runs_path(self) -> str:
        """Directory holding every training run (``runs``)."""
        return self.join(self._prefix, RUNS_DIR)

    def get_run_path(self, run_id: str) -> str:
        """Directory of training run ``run_id`` (``runs/<run_id>``)."""
        return self.join(self.get_runs_path(), run_id)

    def get_checkpoint_path(self, run_id: str) -> str:
        """Directory of run ``run_id``'s checkpoints (``runs/<run_id>/checkpoints``)."""
        return self.join(self.get_run_path(run_id), CHECKPOINTS_DIR)

    def get_logs_path(self, run_id: str) -> str:
        """Directory of run ``run_id``'s logs (``runs/<run_id>/logs``)."""
        return self.join(self.get_run_path(run_id), LOGS_DIR)

    @staticmethod
    def get_checkpoint_filename(epoch: int, ext: str = "pt") -> str:
        """File name of the checkpoint after ``epoch``: ``epoch-<epoch, 5 digits>.<ext>``."""
        return f"epoch-{int(epoch):05d}.{ext.lstrip('.')}"

    def get_checkpoint_file(self, run_id: str, epoch: int, ext: str = "pt") -> str:
        """Full path of run ``run_id``'s checkpoint after ``epoch``
        (write it with :meth:`atomic_writer`)."""
        return self.join(self.get_checkpoint_path(run_id), self.get_checkpoint_filename(epoch, ext))

    def list_checkpoints(self, run_id: str) -> list[tuple[int, str]]:
        """``[(epoch, path), ...]`` of run ``run_id``'s checkpoints, sorted by epoch.

        Only files named ``epoch-<int>.<ext>`` count; temporary files of an interrupted write are
        never listed, so the last entry is always a complete checkpoint. Empty when the run has
        none (or does not exist).
        """
        directory = self.get_checkpoint_path(run_id)
        if not self.exists(directory):
            return []
        found = []
        for name in self.listdir(directory):
            m = _CHECKPOINT_RE.match(name)
            if m and not _is_temp(name):
                found.append((int(m.group(1)), self.join(directory, name)))
        return sorted(found)

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

    def read_bytes(self, path: str) -> bytes:
        """The whole content of file ``path``."""
        with self.filesystem.open_input_stream(self.fs_path(path)) as f:
            return f.read()

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


class LocalStore(Store):
    """A Store on a local (or network-mounted) directory: a plain path or a ``file://`` URL.

    Every executor must see the same directory at the same path (one machine, or a shared
    mount). Relative paths are made absolute on the machine that creates the Store. Atomic writes
    are fsync'ed before the rename, so a checkpoint survives a machine crash whole.
    """

    def __init__(self, prefix_path: str):
        if _scheme(prefix_path) == "file":
            prefix_path = urlparse(prefix_path).path
        super().__init__(os.path.abspath(os.path.expanduser(prefix_path)))

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

    def __init__(self, prefix_path: str):
        path = self.normalize_databricks_path(prefix_path)
        if not (path + "/").startswith(self.MOUNT + "/"):
            raise ValueError(f"DBFSLocalStore({prefix_path!r}): not a DBFS path; give dbfs:/..., "
                             f"{self.MOUNT}/..., file:{self.MOUNT}/... or file://{self.MOUNT}/...")
        if not os.path.isdir(self.MOUNT):
            raise ValueError(f"DBFSLocalStore({prefix_path!r}): the DBFS mount {self.MOUNT} is "
                             "missing on this machine (it exists on Databricks); use a shared "
                             "directory, hdfs:// or an fsspec URL (s3://, abfs://, ...) instead")
        super().__init__(path)

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


class HDFSStore(Store):
    """A Store on HDFS through ``pyarrow.fs.HadoopFileSystem`` (libhdfs over JNI).

    ``prefix_path`` is ``hdfs://namenode:port/path``, or ``hdfs:///path`` for the cluster's
    default filesystem (``fs.defaultFS`` of the Hadoop configuration). Needs, on the driver and
    every executor: Java (``JAVA_HOME``), libhdfs (``ARROW_LIBHDFS_DIR`` or
    ``$HADOOP_HOME/lib/native``) and the Hadoop jars on ``CLASSPATH`` (when unset it is filled
    from ``hadoop classpath --glob`` if the ``hadoop`` command is on PATH).

    HDFS rename does not replace an existing file, so an atomic write over an existing path
    deletes the old file just before the rename: a crash between the two leaves the path missing
    (never partial).
    """

    def __init__(self, prefix_path: str, host: str | None = None, port: int | None = None,
                 user: str | None = None, kerb_ticket: str | None = None,
                 extra_conf: dict | None = None):
        parsed = urlparse(prefix_path)
        if parsed.scheme != "hdfs":
            raise ValueError(f"HDFSStore needs an hdfs:// URL, got {prefix_path!r}")
        super().__init__(prefix_path)
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


class FilesystemStore(Store):
    """A Store on any fsspec filesystem: ``s3://``, ``gs://``, ``abfs://``, ``memory://``,
    ``file://``, chained URLs such as ``simplecache::s3://...``.

    ``storage_options`` (keyword arguments) go to the fsspec filesystem, e.g.
    ``FilesystemStore("s3://bucket/x", key=..., secret=..., client_kwargs={...})``; they are
    pickled with the Store, so prefer credentials from the environment on shared clusters.
    The protocol's implementation package (s3fs, gcsfs, adlfs, ...) must be installed on the
    driver and every executor.

    ``memory://`` lives inside one Python process: it works for a Store used in one process,
    but not across Spark's Python workers (data prepared there is invisible to the driver).
    """

    def __init__(self, prefix_path: str, **storage_options):
        protocol = _scheme(prefix_path)
        if not protocol:
            raise ValueError(f"FilesystemStore needs a URL with a protocol (s3://..., "
                             f"memory://...), got {prefix_path!r}; use LocalStore for a path")
        _check_fsspec_protocol(protocol, prefix_path)
        super().__init__(prefix_path)
        self._storage_options = storage_options
        self._root = None  # the prefix as the fsspec filesystem spells it

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
