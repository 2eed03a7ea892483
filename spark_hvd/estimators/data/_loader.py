"""The shard reader every rank trains from: Parquet shards of the Store -> NumPy batches.

Pure PyArrow + NumPy (no torch/TensorFlow import). The on-Store format is described in
:mod:`spark_hvd.estimators.data._format`; the reader is coded against a ``pyarrow.fs.FileSystem``,
a data path and the parsed ``_metadata.json`` dict, so it does not depend on the Store class::

    reader = ShardReader(store.filesystem, store.get_data_path(key), metadata,
                         rank=hvd.rank(), size=hvd.size(), batch_size=64)
    with reader:
        for epoch in range(epochs):
            for batch in reader.epoch(epoch):      # exactly reader.steps_per_epoch batches
                x, y = batch["features"], batch["label"]   # np.ndarray (64, *shape)

How it reads (``reader="arrow"``, the default):

* Rank ``r`` of ``size`` reads only its own files (``_format.files_of_rank``). The unit of
  reading is one Parquet row group; ``num_workers`` threads read and decode row groups
  (PyArrow releases the GIL) into a bounded in-order window, so decoding overlaps training.
  Results are consumed in a fixed order, so the batches do not depend on thread timing.
* Every epoch yields exactly ``steps_per_epoch`` full batches on every rank, so no rank waits
  in a collective for another that ran out of data: a rank whose rows run out starts another
  (reshuffled) pass over its data; rows left over when the steps are done are not used that
  epoch (the next epoch's shuffle picks a different subset).
* Shuffling (``shuffle=True``): the order of the rank's row groups is permuted with an RNG
  seeded by ``(seed, epoch, rank, pass)``, and rows are mixed in a shuffle buffer of
  ``shuffle_buffer_size`` rows (see :func:`default_shuffle_buffer_size`) seeded by
  ``(seed, epoch, rank)``. Same seed -> same batches; another epoch -> another order.
  ``shuffle=False`` reads files in order and rows in order (validation).
* Batches are dicts ``column -> np.ndarray`` of shape ``(batch_size, *shape)`` with the
  metadata dtype. Each batch is a fresh, writable array owned by the caller (one copy per row
  when the batch is assembled; the decode itself is zero-copy from Arrow where the type
  allows), so ``torch.from_numpy`` can wrap it without a copy or a read-only warning.
"""

from __future__ import annotations

import collections
import math
import threading
import weakref
from concurrent.futures import CancelledError, ThreadPoolExecutor
from typing import Iterator, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from spark_hvd.estimators.data import _format

__all__ = [
    "ShardReader", "EpochIterator", "ShardReadError", "default_steps_per_epoch",
    "default_shuffle_buffer_size", "iterate_once",
]

# Default shuffle buffer: at least this many rows (and 8 batches) ...
_SHUFFLE_BUFFER_MIN_ROWS = 10_000
# ... unless that would take more memory than this (large rows, e.g. images).
_SHUFFLE_BUFFER_MAX_BYTES = 256 << 20

_PETASTORM_ERROR = (
    "reader='petastorm' needs Petastorm, which cannot be imported here ({err}). Petastorm "
    "0.13 does not work with PyArrow >= 15 / NumPy 2 (the versions spark_hvd runs on); use "
    "the default reader='arrow', which reads the same shards.")


class ShardReadError(RuntimeError):
    """Reading or decoding a shard failed, or a shard does not match ``_metadata.json``
    (truncated or corrupt Store). The message names the file."""


class _ColumnSpec(NamedTuple):
    name: str
    dtype: np.dtype
    shape: tuple
    size: int          # prod(shape): values per row in the fixed_size_list


class _Unit(NamedTuple):
    """One row group of one of the rank's files: the unit of reading and caching."""
    file: int          # index into the rank's file list
    row_group: int
    rows: int


# ---------------------------------------------------------------------------------------------
# Metadata helpers
# ---------------------------------------------------------------------------------------------

def _split_meta(metadata: dict, split: str) -> dict:
    if split not in _format.SPLITS:
        raise ValueError(f"unknown split {split!r}: the splits are {list(_format.SPLITS)}")
    splits = metadata.get("splits") or {}
    info = splits.get(split)
    if info is None:
        if split == "val":
            raise ValueError(
                "no validation data was prepared for this data (metadata has no 'val' split): "
                "fit with validation=<fraction or column> to get one, or do not ask for 'val'")
        raise ValueError(f"the prepared data has no {split!r} split")
    return info


def default_steps_per_epoch(metadata: dict, split: str, batch_size: int, num_proc: int) -> int:
    """Steps (batches per rank) of one epoch: ``max(1, total_rows // (batch_size * num_proc))``.

    Horovod's rule: one epoch is about one pass over the split's rows summed over all ranks,
    counting full batches only; at least one step so that a tiny split still trains.
    """
    if batch_size < 1 or num_proc < 1:
        raise ValueError(f"batch_size and num_proc must be >= 1, got {batch_size}, {num_proc}")
    total = int(_split_meta(metadata, split)["total_rows"])
    return max(1, total // (batch_size * num_proc))


def _row_bytes(specs) -> int:
    return sum(s.dtype.itemsize * s.size for s in specs)


def default_shuffle_buffer_size(row_bytes: int, batch_size: int, rank_rows: int) -> int:
    """Default shuffle-buffer size in rows.

    ``max(8 * batch_size, min(10_000, rows fitting in 256 MiB))``, capped at the rank's rows
    (no point buffering more than there is) and never below one batch. 10k rows mix well for
    typical tabular/MNIST-sized rows; the 256 MiB cap keeps large rows (images) affordable.
    """
    rows_in_cap = max(1, _SHUFFLE_BUFFER_MAX_BYTES // max(1, row_bytes))
    size = max(8 * batch_size, min(_SHUFFLE_BUFFER_MIN_ROWS, rows_in_cap))
    return max(batch_size, min(size, max(1, rank_rows)))


def _join(base: str, rel: str) -> str:
    return base.rstrip("/") + "/" + rel


# ---------------------------------------------------------------------------------------------
# Reader
# ---------------------------------------------------------------------------------------------

class ShardReader:
    """Reads this rank's Parquet shards of one split and yields fixed-size NumPy batches.

    Args:
        filesystem: ``pyarrow.fs.FileSystem`` holding the data (``store.filesystem``).
        data_path: base path of the prepared data (``store.fs_path(store.get_data_path(key))``);
            the files of a split whose metadata names its ``dir`` are read from there.
        metadata: the parsed ``_metadata.json`` dict.
        split: ``"train"`` or ``"val"``.
        rank, size: this rank and the number of ranks; rank ``r`` reads files ``i % size == r``.
        batch_size: rows per batch (every batch is full).
        columns: columns to read (default: every column in the metadata).
        steps_per_epoch: batches per epoch on every rank (default
            :func:`default_steps_per_epoch` with ``num_proc=size``).
        shuffle: shuffle row-group order and rows (``False``: file order, row order).
        shuffle_buffer_size: rows in the shuffle buffer (default
            :func:`default_shuffle_buffer_size`); raised to ``batch_size`` if smaller.
        seed: base seed; batches are a deterministic function of (seed, epoch, rank).
        inmemory_cache_all: keep every decoded row group in memory once read, so later
            passes and epochs never touch the files.
        num_workers: reader threads (0: read in the consumer's thread).
        reader: ``"arrow"`` (default) or ``"petastorm"`` (Petastorm's ``make_batch_reader``
            on this rank's files, if Petastorm can be imported; row-group order then follows
            Petastorm's pool and is not reproducible with ``num_workers > 1``; a pass that
            returns fewer rows than the shards hold raises :class:`ShardReadError`).

    Use as a context manager (or call :meth:`close`) to stop reader threads of iterators
    that were not run to the end; an abandoned iterator also stops them when collected.
    """

    def __init__(self, filesystem: pafs.FileSystem, data_path: str, metadata: dict,
                 split: str = "train", rank: int = 0, size: int = 1, batch_size: int = 32,
                 columns=None, steps_per_epoch: int | None = None, shuffle: bool = True,
                 shuffle_buffer_size: int | None = None, seed: int = 0,
                 inmemory_cache_all: bool = False, num_workers: int = 2,
                 reader: str = "arrow"):
        if not isinstance(filesystem, pafs.FileSystem):
            raise TypeError(f"filesystem must be a pyarrow.fs.FileSystem, got {type(filesystem)}")
        version = metadata.get("format_version")
        if version != _format.FORMAT_VERSION:
            raise ValueError(f"prepared data has format_version {version!r}; this spark_hvd "
                             f"reads format_version {_format.FORMAT_VERSION}")
        if not 0 <= rank < size:
            raise ValueError(f"rank must be in [0, size), got rank={rank} size={size}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if reader not in ("arrow", "petastorm"):
            raise ValueError(f"reader must be 'arrow' or 'petastorm', got {reader!r}")
        if seed is None:
            seed = 0

        split_info = _split_meta(metadata, split)
        all_columns = metadata.get("columns") or {}
        if columns is None:
            columns = list(all_columns)
        elif isinstance(columns, str):
            columns = [columns]
        columns = list(columns)
        unknown = [c for c in columns if c not in all_columns]
        if unknown:
            raise ValueError(f"unknown column(s) {unknown}: the prepared data has columns "
                             f"{sorted(all_columns)}")
        if not columns:
            raise ValueError("no columns to read")
        if len(set(columns)) != len(columns):
            raise ValueError(f"duplicate column names in {columns}")

        self._specs = []
        for name in columns:
            info = all_columns[name]
            dtype = np.dtype(info["dtype"])
            shape = tuple(int(d) for d in info.get("shape") or ())
            self._specs.append(_ColumnSpec(name, dtype, shape, math.prod(shape)))

        files = list(split_info["files"])
        rows = [int(r) for r in split_info["rows"]]
        if len(rows) != len(files):
            raise ValueError(f"metadata of split {split!r} lists {len(files)} files but "
                             f"{len(rows)} row counts")
        self._fs = filesystem
        self._data_path = data_path
        self._split = split
        self._rank, self._size = rank, size
        self._files = _format.files_of_rank(files, rank, size)
        self._file_rows = _format.files_of_rank(rows, rank, size)
        # Each split names its directory (format 2); data_path is the fallback.
        split_dir = split_info.get("dir") or data_path
        self._paths = [_join(split_dir, f) for f in self._files]
        self._rows = sum(self._file_rows)
        self._batch_size = batch_size
        self._columns = columns
        self._steps = (default_steps_per_epoch(metadata, split, batch_size, size)
                       if steps_per_epoch is None else int(steps_per_epoch))
        if self._steps < 1:
            raise ValueError(f"steps_per_epoch must be >= 1, got {steps_per_epoch}")
        self._shuffle = bool(shuffle)
        if shuffle_buffer_size is None:
            shuffle_buffer_size = default_shuffle_buffer_size(
                _row_bytes(self._specs), batch_size, self._rows)
        self._buffer_rows = max(batch_size, int(shuffle_buffer_size))
        self._seed = int(seed)
        self._cache_all = bool(inmemory_cache_all)
        self._cache: dict = {}               # (file, row_group) -> decoded columns
        self._num_workers = int(num_workers)
        self._reader = reader
        # Coalesced column-chunk reads save round trips on remote filesystems (HDFS, S3).
        self._pre_buffer = not isinstance(filesystem, pafs.LocalFileSystem)
        self._iterators = weakref.WeakSet()  # live epoch iterators, stopped by close()
        self._closed = False

        if reader == "petastorm":
            try:
                import petastorm  # noqa: F401
            except Exception as e:  # noqa: BLE001 - old Petastorm fails with odd errors
                raise ImportError(_PETASTORM_ERROR.format(err=f"{type(e).__name__}: {e}")) from e
            self._units = None
        else:
            # Footers are read once, up front: a Store whose shards do not match the metadata
            # fails here on every rank, before training starts.
            self._footers, self._units = self._read_footers()

    # -- public properties ---------------------------------------------------------------------

    @property
    def steps_per_epoch(self) -> int:
        """Batches every epoch yields (the same on every rank)."""
        return self._steps

    @property
    def rows(self) -> int:
        """Rows of the split this rank owns (the sum over its files)."""
        return self._rows

    @property
    def batch_size(self) -> int:
        """Rows per batch."""
        return self._batch_size

    @property
    def columns(self) -> list:
        """The columns every batch holds, in order."""
        return list(self._columns)

    @property
    def files(self) -> list:
        """This rank's shard files, relative to the data path."""
        return list(self._files)

    @property
    def shuffle_buffer_size(self) -> int:
        """Rows in the shuffle buffer (used only with ``shuffle=True``)."""
        return self._buffer_rows

    def __repr__(self):
        return (f"ShardReader(split={self._split!r}, rank={self._rank}/{self._size}, "
                f"files={len(self._files)}, rows={self._rows}, batch_size={self._batch_size}, "
                f"steps_per_epoch={self._steps}, shuffle={self._shuffle}, reader={self._reader!r})")

    # -- iteration -------------------------------------------------------------------------------

    def epoch(self, n: int) -> "EpochIterator":
        """Iterator over exactly ``steps_per_epoch`` full batches of epoch ``n``.

        Each batch is a dict ``column -> np.ndarray (batch_size, *shape)``. The iterator is
        also a context manager; closing it (or dropping it) stops its reader threads.
        """
        if self._closed:
            raise RuntimeError("ShardReader is closed")
        if self._rows == 0:
            raise ValueError(
                f"rank {self._rank} of {self._size} owns no rows of split {self._split!r} "
                f"(files {self._files} are empty), so it cannot produce {self._steps} batches; "
                f"prepare the data with fewer empty partitions or use fewer processes")
        it = EpochIterator(self, int(n), steps=self._steps, passes=None, drop_last=True,
                           shuffle=self._shuffle)
        self._iterators.add(it)
        return it

    def _iterate_once(self) -> "EpochIterator":
        # Every row of this rank once, in order; the last batch may be short.
        it = EpochIterator(self, 0, steps=None, passes=1, drop_last=False, shuffle=False)
        self._iterators.add(it)
        return it

    def close(self):
        """Stop the reader threads of every iterator still running and drop the cache."""
        self._closed = True
        for it in list(self._iterators):
            it.close()
        self._cache.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- reading (arrow) --------------------------------------------------------------------------

    def _read_footers(self):
        footers, units = [], []
        for i, (path, expected) in enumerate(zip(self._paths, self._file_rows)):
            try:
                with self._fs.open_input_file(path) as f:
                    footer = pq.ParquetFile(f).metadata
            except Exception as e:  # noqa: BLE001
                raise ShardReadError(f"cannot read shard {path}: {type(e).__name__}: {e} "
                                     f"(truncated or corrupt Store?)") from e
            if footer.num_rows != expected:
                raise ShardReadError(
                    f"shard {path} has {footer.num_rows} rows but _metadata.json says "
                    f"{expected}: the Store is truncated or corrupt; prepare the data again")
            names = set(footer.schema.to_arrow_schema().names)
            missing = [c for c in self._columns if c not in names]
            if missing:
                raise ShardReadError(f"shard {path} lacks column(s) {missing} listed in "
                                     f"_metadata.json: the Store is corrupt")
            footers.append(footer)
            units.extend(_Unit(i, g, footer.row_group(g).num_rows)
                         for g in range(footer.num_row_groups))
        return footers, units

    def _read_unit(self, unit: _Unit, open_files: dict) -> dict:
        """Read and decode one row group (runs in a reader thread)."""
        path = self._paths[unit.file]
        try:
            pf = open_files.get(path)
            if pf is None:
                # One open file per thread: concurrent reads on one ParquetFile are not
                # documented thread-safe; the cached footer saves re-reading it.
                pf = pq.ParquetFile(self._fs.open_input_file(path),
                                    metadata=self._footers[unit.file],
                                    pre_buffer=self._pre_buffer)
                open_files[path] = pf
            table = pf.read_row_group(unit.row_group, columns=self._columns, use_threads=False)
            if table.num_rows != unit.rows:
                raise ShardReadError(f"row group {unit.row_group} of shard {path} has "
                                     f"{table.num_rows} rows, its footer says {unit.rows}")
            return {s.name: self._decode(table.column(s.name), s, path) for s in self._specs}
        except ShardReadError:
            raise
        except Exception as e:  # noqa: BLE001 - re-raised in the consumer with the file name
            raise ShardReadError(f"reading row group {unit.row_group} of shard {path} failed: "
                                 f"{type(e).__name__}: {e}") from e

    @staticmethod
    def _decode(column: pa.ChunkedArray, spec: _ColumnSpec, path: str) -> np.ndarray:
        arr = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
        if arr.null_count:
            raise ShardReadError(f"column {spec.name!r} of shard {path} has {arr.null_count} "
                                 f"nulls; training columns cannot have nulls (data given to "
                                 f"fit_on_parquet: fill or drop them first; prepared data has "
                                 f"none, so a corrupt Store)")
        if not spec.shape:
            values = arr.to_numpy(zero_copy_only=False)
        else:
            t = arr.type
            if pa.types.is_fixed_size_list(t):
                if t.list_size != spec.size:
                    raise ShardReadError(
                        f"column {spec.name!r} of shard {path} has {t.list_size} values per row, "
                        f"metadata shape {list(spec.shape)} needs {spec.size}")
            elif not (pa.types.is_list(t) or pa.types.is_large_list(t)):
                raise ShardReadError(f"column {spec.name!r} of shard {path} has type {t}, "
                                     f"expected fixed_size_list of {spec.size} values")
            flat = arr.flatten()      # honours slice offsets, unlike .values
            if len(flat) != len(arr) * spec.size or flat.null_count:
                raise ShardReadError(f"column {spec.name!r} of shard {path}: rows do not all "
                                     f"hold {spec.size} non-null values")
            values = flat.to_numpy(zero_copy_only=False).reshape((len(arr),) + spec.shape)
        if values.dtype != spec.dtype:
            values = values.astype(spec.dtype)
        return values

    def _unit_order(self, epoch: int, pass_: int, shuffle: bool) -> list:
        if not shuffle:
            return self._units
        rng = np.random.default_rng([self._seed, epoch, self._rank, pass_, 0])
        return [self._units[i] for i in rng.permutation(len(self._units))]

    def _arrow_chunks(self, epoch: int, passes, shuffle: bool, state: "_PipelineState"):
        """Decoded row groups in read order, pass after pass; reading runs ``num_workers``
        row groups ahead in threads."""
        def unit_sequence():
            pass_ = 0
            while passes is None or pass_ < passes:
                for unit in self._unit_order(epoch, pass_, shuffle):
                    yield unit
                pass_ += 1

        units = unit_sequence()
        # A window of 2 row groups per worker keeps every worker busy while the consumer
        # works on the current one, and bounds memory to a few row groups.
        window = max(1, 2 * self._num_workers)
        pending = collections.deque()
        sync_files: dict = {}
        executor = None
        if self._num_workers:
            local = threading.local()

            def read(unit):
                files = getattr(local, "files", None)
                if files is None:
                    files = local.files = {}
                return self._read_unit(unit, files)

            executor = ThreadPoolExecutor(self._num_workers,
                                          thread_name_prefix="spark_hvd-loader")
            state.executor = executor

        def fill():
            while len(pending) < window:
                unit = next(units, None)
                if unit is None:
                    return
                key = (unit.file, unit.row_group)
                cached = self._cache.get(key)
                if cached is not None or executor is None:
                    pending.append((unit, None, cached))
                else:
                    pending.append((unit, executor.submit(read, unit), None))

        try:
            fill()
            while pending:
                unit, future, data = pending.popleft()
                fill()
                if data is None:
                    if future is None:
                        data = self._read_unit(unit, sync_files)
                    else:
                        try:
                            data = future.result()
                        except CancelledError:
                            # close() from another thread while this one waited.
                            raise RuntimeError("the ShardReader iterator was closed") from None
                    if self._cache_all:
                        self._cache[(unit.file, unit.row_group)] = data
                yield data
        finally:
            for _, future, _ in pending:
                if future is not None:
                    future.cancel()
            state.shutdown(wait=False)

    # -- reading (petastorm) ----------------------------------------------------------------------

    def _url(self, path: str) -> str:
        if "://" in path:
            return path
        if isinstance(self._fs, pafs.LocalFileSystem):
            return "file://" + path
        return f"{self._fs.type_name}://{path}"

    def _petastorm_chunks(self, epoch: int, passes, shuffle: bool, state: "_PipelineState"):
        from petastorm import make_batch_reader

        urls = [self._url(p) for p in self._paths]
        names = [s.name for s in self._specs]
        pass_ = 0
        while passes is None or pass_ < passes:
            seed = int(np.random.default_rng(
                [self._seed, epoch, self._rank, pass_, 0]).integers(2**31))
            reader = make_batch_reader(urls, schema_fields=names,
                                       workers_count=max(1, self._num_workers),
                                       shuffle_row_groups=shuffle, seed=seed, num_epochs=1)
            state.petastorm_reader = reader
            got = 0
            try:
                for batch in reader:
                    fields = batch._asdict()
                    missing = [n for n in names if n not in fields]
                    if missing:
                        # Petastorm 0.13 infers its schema from the Parquet files and drops
                        # fixed_size_list columns (our array and vector encoding).
                        raise ShardReadError(
                            f"reader='petastorm' returned no column(s) {missing}: Petastorm's "
                            "make_batch_reader cannot read array or vector columns of "
                            "prepared data; use reader='arrow' (the default)")
                    data = {s.name: self._from_petastorm(fields[s.name], s) for s in self._specs}
                    got += len(data[names[0]])
                    yield data
            finally:
                state.shutdown(wait=True)
            # Petastorm's thread pool can end a pass silently with rows missing (0 rows with
            # PyArrow >= 15); training on it would hang the other ranks in a collective.
            if got != self._rows:
                raise ShardReadError(
                    f"Petastorm returned {got} rows in pass {pass_} of epoch {epoch} on rank "
                    f"{self._rank}, but its shards hold {self._rows} (a known Petastorm thread "
                    f"pool bug); use reader='arrow'")
            pass_ += 1

    @staticmethod
    def _from_petastorm(values, spec: _ColumnSpec) -> np.ndarray:
        values = np.asarray(values)
        if values.dtype == object:      # list columns may come back as arrays of arrays
            values = np.stack(list(values)) if len(values) else values
        n = len(values)
        return np.ascontiguousarray(values, dtype=spec.dtype).reshape((n,) + spec.shape)

    # -- batching ---------------------------------------------------------------------------------

    def _batches(self, chunks, epoch: int, steps, drop_last: bool, shuffle: bool):
        if shuffle:
            return self._shuffled_batches(chunks, epoch, steps)
        return self._sequential_batches(chunks, steps, drop_last)

    def _sequential_batches(self, chunks, steps, drop_last: bool):
        """Rows in read order, cut into batches (copies: every batch owns its memory)."""
        b = self._batch_size
        names = [s.name for s in self._specs]
        pieces = collections.deque()   # [chunk, offset, rows left]
        have = 0
        emitted = 0
        while steps is None or emitted < steps:
            while have < b:
                chunk = next(chunks, None)
                if chunk is None:
                    break
                n = len(chunk[names[0]])
                if n:
                    pieces.append([chunk, 0, n])
                    have += n
            if have == 0 or (have < b and drop_last):
                return
            want = min(b, have)
            parts = []       # (chunk, start, stop)
            while want:
                piece = pieces[0]
                chunk, off, left = piece
                k = min(want, left)
                parts.append((chunk, off, off + k))
                want -= k
                have -= k
                if k == left:
                    pieces.popleft()
                else:
                    piece[1] += k
                    piece[2] -= k
            if len(parts) == 1:
                chunk, lo, hi = parts[0]
                batch = {c: chunk[c][lo:hi].copy() for c in names}
            else:
                batch = {c: np.concatenate([ch[c][lo:hi] for ch, lo, hi in parts])
                         for c in names}
            yield batch
            emitted += 1

    def _shuffled_batches(self, chunks, epoch: int, steps):
        """Rows mixed in a shuffle buffer.

        The buffer holds up to ``S`` rows, compact in ``[0, n)``. When it is full, a random
        half of it (whole batches) is emitted in random order and the kept rows are moved
        into the holes; new rows are appended. Once it holds every row the epoch still needs,
        those are drawn at random and the epoch ends. This equals the classic one-row-at-a-time
        shuffle buffer drawn in blocks, with per-batch NumPy gathers instead of per-row work.
        """
        b = self._batch_size
        S = self._buffer_rows
        rng = np.random.default_rng([self._seed, epoch, self._rank, 0, 1])
        buf = {s.name: np.empty((S,) + s.shape, dtype=s.dtype) for s in self._specs}
        names = list(buf)
        n = 0
        chunk, off, left = None, 0, 0
        emitted = 0
        half = max(b, (S // 2) // b * b)
        while emitted < steps:
            need = (steps - emitted) * b
            if n >= need or n == S:
                k = need if n >= need else min(half, need)
                perm = rng.permutation(n)
                out = perm[:k]
                for i in range(0, k, b):
                    idx = out[i:i + b]
                    yield {c: buf[c].take(idx, axis=0) for c in names}
                    emitted += 1
                if emitted >= steps:
                    return
                # Compact: kept rows sitting at or after n - k move into the emitted holes.
                keep = perm[k:]
                movers = keep[keep >= n - k]
                holes = out[out < n - k]
                if len(holes):
                    for c in names:
                        arr = buf[c]
                        arr[holes] = arr[movers]
                n -= k
                continue
            if left == 0:
                chunk = next(chunks, None)
                if chunk is None:   # only when passes are limited; not used by epoch()
                    return
                off, left = 0, len(chunk[names[0]])
                continue
            m = min(S - n, left)
            for c in names:
                buf[c][n:n + m] = chunk[c][off:off + m]
            n += m
            off += m
            left -= m


class _PipelineState:
    """The resources of one running epoch iterator. Kept apart from the iterator object so
    that the generator does not reference the iterator (no cycle): dropping the iterator
    frees it at once and its finalizer stops the threads."""

    def __init__(self):
        self.executor = None
        self.petastorm_reader = None
        self._lock = threading.Lock()

    def shutdown(self, wait: bool):
        with self._lock:
            # The executor stays referenced: a later shutdown(wait=True) (close() after the
            # generator's own non-waiting shutdown) must still join its threads.
            executor = self.executor
            reader, self.petastorm_reader = self.petastorm_reader, None
        if executor is not None:
            executor.shutdown(wait=wait, cancel_futures=True)
        if reader is not None:
            try:
                reader.stop()
                reader.join()
            except Exception:  # noqa: BLE001 - best effort while shutting down
                pass


def _finalize(gen, state: _PipelineState):
    try:
        gen.close()
    except Exception:  # noqa: BLE001 - never raise from a finalizer
        pass
    state.shutdown(wait=False)


class EpochIterator:
    """Iterator over one epoch's batches (see :meth:`ShardReader.epoch`).

    ``close()`` (or leaving a ``with`` block, or dropping the iterator) stops its reader
    threads; reader errors are raised from ``next()`` as :class:`ShardReadError`."""

    def __init__(self, reader: ShardReader, epoch: int, steps, passes, drop_last: bool,
                 shuffle: bool):
        self._state = _PipelineState()
        make_chunks = (reader._petastorm_chunks if reader._reader == "petastorm"
                       else reader._arrow_chunks)
        chunks = make_chunks(epoch, passes, shuffle, self._state)
        self._gen = reader._batches(chunks, epoch, steps, drop_last, shuffle)
        self._length = steps
        self._finalizer = weakref.finalize(self, _finalize, self._gen, self._state)

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        if not self._finalizer.alive:
            raise StopIteration
        try:
            return next(self._gen)
        except StopIteration:
            self.close()
            raise
        except BaseException:
            self.close()
            raise

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError("this iterator has no fixed length")
        return self._length

    def close(self, wait: bool = True):
        """Stop reading: cancel queued row groups and join the reader threads."""
        self._finalizer.detach()
        try:
            self._gen.close()
        except ValueError:   # running in another thread: stopping the executor ends it
            pass
        self._state.shutdown(wait=wait)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def iterate_once(filesystem: pafs.FileSystem, data_path: str, metadata: dict,
                 split: str = "train", columns=None, batch_size: int = 1024,
                 rank: int = 0, size: int = 1, num_workers: int = 2):
    """Yield every row of ``split`` owned by ``rank`` of ``size`` exactly once, in file and
    row order, as dict batches of ``batch_size`` rows (the last batch may be shorter).
    For evaluation and tests; ``size=1`` reads every file."""
    reader = ShardReader(filesystem, data_path, metadata, split=split, rank=rank, size=size,
                         batch_size=batch_size, columns=columns, shuffle=False,
                         num_workers=num_workers)
    with reader, reader._iterate_once() as it:
        yield from it
