"""Petastorm's side of ``benchmarks/estimator.py``'s loader benchmark.

Not meant to be run by hand: the benchmark starts it with the Python of the Petastorm venv
(``petastorm_env.py``) and one JSON argument::

    {"files": [absolute Parquet paths], "batch_size": 128, "expected_rows": 200000,
     "columns": [{"name": "features", "dtype": "float32", "shape": [784]}, ...],
     "runs": [{"label": "...", "workers": 2, "shuffle_row_groups": false}, ...],
     "warmup": true}

Every run is one pass of ``make_batch_reader(file_urls, num_epochs=1, ...)`` over the files,
each Petastorm batch (one row group) turned into NumPy arrays of the benchmark's shapes and cut
into ``batch_size``-row batches that own their memory (what ``ShardReader`` yields; the last
partial batch is dropped). A run whose pass returns fewer rows than the files hold (Petastorm's
0-rows thread-pool bug) is reported as an error, never as a fast number. Results are single lines
``@@BENCH {json}`` on stdout. Only the standard library, NumPy and Petastorm are imported.
"""

import json
import sys
import time
import warnings

MARK = "@@BENCH "


def emit(**record):
    sys.stdout.write(MARK + json.dumps(record) + "\n")
    sys.stdout.flush()


def to_numpy(values, dtype, shape):
    import numpy as np
    values = np.asarray(values)
    if values.dtype == object:          # list columns may come back as arrays of arrays
        values = np.stack(list(values)) if len(values) else values
    return np.ascontiguousarray(values, dtype=dtype).reshape((len(values),) + tuple(shape))


def batches(chunks, names, batch_size):
    """Fixed-size batches (fresh arrays) from variable-size chunks; drops the last partial."""
    import numpy as np
    carry = None
    for chunk in chunks:
        n = len(chunk[names[0]])
        start = 0
        if carry is not None:
            take = min(batch_size - len(carry[names[0]]), n)
            carry = {c: np.concatenate([carry[c], chunk[c][:take]]) for c in names}
            start = take
            if len(carry[names[0]]) == batch_size:
                yield carry
                carry = None
        while start + batch_size <= n:
            yield {c: chunk[c][start:start + batch_size].copy() for c in names}
            start += batch_size
        if start < n:
            carry = {c: chunk[c][start:].copy() for c in names}


def one_pass(plan, run, files):
    from petastorm import make_batch_reader
    specs = plan["columns"]
    names = [c["name"] for c in specs]
    urls = ["file://" + f for f in files]
    raw_rows = [0]

    def chunks(reader):
        for batch in reader:
            fields = batch._asdict()
            missing = [n for n in names if n not in fields]
            if missing:
                raise RuntimeError(f"Petastorm's batch has no column(s) {missing} (fields "
                                   f"{sorted(fields)}); it omits column types it cannot map")
            data = {c["name"]: to_numpy(fields[c["name"]], c["dtype"], c["shape"])
                    for c in specs}
            raw_rows[0] += len(data[names[0]])
            yield data

    t0 = time.perf_counter()
    rows = count = 0
    shapes = None
    with make_batch_reader(urls, schema_fields=names, num_epochs=1,
                           workers_count=run["workers"],
                           shuffle_row_groups=run["shuffle_row_groups"]) as reader:
        for batch in batches(chunks(reader), names, plan["batch_size"]):
            if shapes is None:
                shapes = {k: [list(v.shape), str(v.dtype)] for k, v in batch.items()}
            rows += len(batch[names[0]])
            count += 1
    seconds = time.perf_counter() - t0
    return {"rows": rows, "raw_rows": raw_rows[0], "batches": count, "seconds": seconds,
            "shapes": shapes}


def main():
    warnings.simplefilter("ignore")
    plan = json.loads(sys.argv[1])
    import numpy
    import petastorm
    import pyarrow
    emit(kind="versions", petastorm=petastorm.__version__, pyarrow=pyarrow.__version__,
         numpy=numpy.__version__)
    if plan.get("warmup"):   # imports, Petastorm's first reader, the page cache: not counted
        try:
            one_pass(plan, plan["runs"][0], plan["files"][:1])
        except Exception as e:  # noqa: BLE001 - reported by the timed run too
            emit(kind="warmup_error", error=f"{type(e).__name__}: {e}")
    for run in plan["runs"]:
        try:
            result = one_pass(plan, run, plan["files"])
        except Exception as e:  # noqa: BLE001
            emit(kind="result", label=run["label"], error=f"{type(e).__name__}: {e}")
            continue
        if result["raw_rows"] != plan["expected_rows"]:
            emit(kind="result", label=run["label"], error=(
                f"Petastorm returned {result['raw_rows']} rows, the files hold "
                f"{plan['expected_rows']}"), **result)
            continue
        emit(kind="result", label=run["label"], **result)


if __name__ == "__main__":
    main()
