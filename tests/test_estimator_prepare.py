"""prepare_data: DataFrame → Parquet shards in a Store, under classic and Spark Connect sessions.

Every supported type is written and read back with pyarrow and compared with the DataFrame;
every validation error is provoked; reuse, balance and the validation split are checked.
"""

import os
import subprocess
import sys
from decimal import Decimal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spark_hvd.estimators.data import _format
from spark_hvd.estimators.data._prepare import data_key_of, load_metadata, prepare_data
from spark_hvd.estimators.store import FilesystemStore, LocalStore

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["classic", "connect"])
def session(request):
    return request.getfixturevalue("spark" if request.param == "classic" else "connect")


@pytest.fixture
def store(tmp_path):
    return LocalStore(str(tmp_path / "store"))


def read_split(store, meta, split):
    """All rows of ``split`` as one table, plus the per-file tables."""
    paths = {"train": store.get_train_data_path, "val": store.get_val_data_path}
    base = paths[split](meta["data_key"])
    tables = []
    for rel in meta["splits"][split]["files"]:
        with store.open_input(store.join(base, rel)) as f:
            tables.append(pq.read_table(f))
    return pa.concat_tables(tables), tables


def prep(df, store, **kw):
    kw.setdefault("num_proc", 2)
    kw.setdefault("label_cols", [])
    kw.setdefault("verbose", 0)
    return prepare_data(df, store, **kw)


# -- every type round-trips --------------------------------------------------------------------

def _typed_df(session):
    from pyspark.ml.linalg import Vectors, VectorUDT
    from pyspark.sql import types as T
    schema = T.StructType([
        T.StructField("id", T.LongType()),
        T.StructField("b", T.BooleanType()),
        T.StructField("i8", T.ByteType()),
        T.StructField("i16", T.ShortType()),
        T.StructField("i32", T.IntegerType()),
        T.StructField("f32", T.FloatType()),
        T.StructField("f64", T.DoubleType()),
        T.StructField("dec", T.DecimalType(10, 2)),
        T.StructField("af", T.ArrayType(T.FloatType())),
        T.StructField("ad", T.ArrayType(T.DoubleType(), containsNull=False)),
        T.StructField("ai", T.ArrayType(T.IntegerType())),
        T.StructField("ab", T.ArrayType(T.BooleanType())),
        T.StructField("nested", T.ArrayType(T.ArrayType(T.FloatType()))),
        T.StructField("adec", T.ArrayType(T.DecimalType(6, 3))),
        T.StructField("vdense", VectorUDT()),
        T.StructField("vsparse", VectorUDT()),
    ])
    rows = []
    for k in range(12):
        rows.append((k, k % 2 == 0, k - 6, 300 * k, -(10 ** 6) * k, k / 4, k / 3,
                     Decimal(f"{k}.25"), [k + 0.5, -float(k)], [k / 7, 1.0, 2.0], [k, k * k],
                     [True, k % 3 == 0], [[float(k), 1.0, 2.0], [3.0, 4.0, -float(k)]],
                     [Decimal(f"{k}.125")],
                     Vectors.dense([k, 2.0 * k, 0.5]),
                     Vectors.sparse(5, {k % 5: float(k + 1)})))
    return session.createDataFrame(rows, schema), rows


EXPECTED = {
    "b": ("bool", [], "scalar"), "i8": ("int8", [], "scalar"), "i16": ("int16", [], "scalar"),
    "i32": ("int32", [], "scalar"), "f32": ("float32", [], "scalar"),
    "f64": ("float64", [], "scalar"), "dec": ("float64", [], "scalar"),
    "af": ("float32", [2], "array"), "ad": ("float64", [3], "array"),
    "ai": ("int32", [2], "array"), "ab": ("bool", [2], "array"),
    "nested": ("float32", [2, 3], "array"), "adec": ("float64", [1], "array"),
    "vdense": ("float32", [3], "vector"), "vsparse": ("float32", [5], "vector"),
}


def test_every_type_round_trips(session, store):
    df, rows = _typed_df(session)
    features = [c for c in df.columns if c not in ("id", "f64")]
    meta = prep(df, store, feature_cols=features, label_cols=["f64"], sample_weight_col="id",
                num_proc=2, partitions_per_process=2)
    assert meta["format_version"] == _format.FORMAT_VERSION
    assert meta["feature_cols"] == features and meta["label_cols"] == ["f64"]
    assert meta["sample_weight_col"] == "id"
    assert meta["splits"]["val"] is None
    cols = meta["columns"]
    assert cols["id"] == {"dtype": "int64", "shape": [], "kind": "scalar"}
    for name, (dtype, shape, kind) in EXPECTED.items():
        assert cols[name] == {"dtype": dtype, "shape": shape, "kind": kind}, name
    assert load_metadata(store, meta["data_key"]) == meta  # the JSON file, written last
    with pytest.raises(FileNotFoundError, match="no prepared data 'nokey'"):
        load_metadata(store, "nokey")

    table, parts = read_split(store, meta, "train")
    assert len(parts) == 4 and meta["splits"]["train"]["rows"] == [t.num_rows for t in parts]
    assert table.num_rows == len(rows) == meta["splits"]["train"]["total_rows"]
    assert table.column_names == list(cols)  # the weight column too; nothing else
    for name, (dtype, shape, kind) in EXPECTED.items():
        field = table.schema.field(name)
        if shape:
            assert pa.types.is_fixed_size_list(field.type)
            assert field.type.list_size == np.prod(shape)
            assert field.type.value_type == pa.from_numpy_dtype(dtype)
        else:
            assert field.type == pa.from_numpy_dtype(dtype)

    by_id = {r[0]: r for r in rows}
    names = [f.name for f in df.schema.fields]
    ids = table.column("id").to_pylist()
    assert sorted(ids) == sorted(by_id)
    for name in EXPECTED:
        got = table.column(name)
        dtype, shape, kind = EXPECTED[name]
        for pos, id_ in enumerate(ids):
            want = by_id[id_][names.index(name)]
            if kind == "vector":
                want = want.toArray()
            elif name in ("dec",):
                want = float(want)
            elif name == "adec":
                want = [float(x) for x in want]
            want = np.asarray(want, dtype=dtype)
            value = got[pos].as_py()
            value = np.asarray(value, dtype=dtype).reshape(shape)
            np.testing.assert_array_equal(value, want, err_msg=f"{name} id={id_}")


def test_fsspec_filesystem_store(spark, tmp_path):
    # A Store Spark's own writer knows nothing about: the tasks write through fsspec.
    store = FilesystemStore(f"file://{tmp_path}/fsspec-store")
    df = spark.range(50).selectExpr("id", "array(cast(id as float), 1.0f) as x")
    meta = prep(df, store, feature_cols=["x"], label_cols=["id"])
    table, _ = read_split(store, meta, "train")
    assert sorted(table.column("id").to_pylist()) == list(range(50))
    assert os.path.exists(f"{tmp_path}/fsspec-store/intermediate_train_data.{meta['data_key']}"
                          "/_metadata.json")


# -- layout: balance, empty partitions, row groups ---------------------------------------------

def test_balanced_files_and_row_groups(spark, store):
    df = spark.range(0, 1000, 1, 3).selectExpr("id", "cast(id as double) as y")
    meta = prep(df, store, feature_cols=["id"], label_cols=["y"], num_proc=3,
                partitions_per_process=2, row_group_size=64)
    train = meta["splits"]["train"]
    assert train["files"] == [_format.part_file(i) for i in range(6)]
    assert sum(train["rows"]) == train["total_rows"] == 1000
    assert max(train["rows"]) - min(train["rows"]) <= 6, train["rows"]
    base = store.get_data_path(meta["data_key"])
    with store.open_input(store.join(base, train["files"][0])) as f:
        pf = pq.ParquetFile(f)
        assert pf.metadata.num_row_groups == -(-train["rows"][0] // 64)
    assert {n for n in os.listdir(base) if n.startswith(".")} == set()  # no temp files left


def test_more_files_than_rows_writes_empty_shards(spark, store):
    df = spark.range(3).selectExpr("cast(id as float) as x")
    meta = prep(df, store, feature_cols=["x"], num_proc=2, partitions_per_process=4)
    train = meta["splits"]["train"]
    assert len(train["files"]) == 8 and train["total_rows"] == 3
    table, parts = read_split(store, meta, "train")
    assert all(t.schema.field("x").type == pa.float32() for t in parts)
    assert sorted(table.column("x").to_pylist()) == [0.0, 1.0, 2.0]


# -- validation split ----------------------------------------------------------------------------

def _val_ids(store, meta):
    return sorted(read_split(store, meta, "val")[0].column("id").to_pylist())


def test_validation_fraction(spark, tmp_path):
    df = spark.range(0, 1000, 1, 2).selectExpr("id", "cast(id as float) as x")
    a = prep(df, LocalStore(str(tmp_path / "a")), feature_cols=["x", "id"], validation=0.2,
             random_seed=7)
    val, train = a["splits"]["val"], a["splits"]["train"]
    assert 140 < val["total_rows"] < 260 and val["total_rows"] + train["total_rows"] == 1000
    assert val["files"] == [_format.part_file(i) for i in range(2)]
    store_a = LocalStore(str(tmp_path / "a"))
    train_ids = set(read_split(store_a, a, "train")[0].column("id").to_pylist())
    assert not train_ids & set(_val_ids(store_a, a))  # a row is in exactly one split
    # Same seed → same split; another seed → another split.
    b = prep(df, LocalStore(str(tmp_path / "b")), feature_cols=["x", "id"], validation=0.2,
             random_seed=7)
    c = prep(df, LocalStore(str(tmp_path / "c")), feature_cols=["x", "id"], validation=0.2,
             random_seed=8)
    assert a["data_key"] == b["data_key"] != c["data_key"]
    assert _val_ids(store_a, a) == _val_ids(LocalStore(str(tmp_path / "b")), b)
    assert _val_ids(store_a, a) != _val_ids(LocalStore(str(tmp_path / "c")), c)


@pytest.mark.parametrize("kind, session_kind", [("boolean", "classic"), ("int", "connect")])
def test_validation_column(request, store, kind, session_kind):
    session = request.getfixturevalue("spark" if session_kind == "classic" else "connect")
    flag = "id % 4 = 0" if kind == "boolean" else "cast(id % 4 = 0 as int)"
    df = session.range(40).selectExpr("id", "cast(id as double) as x", f"{flag} as is_val")
    meta = prep(df, store, feature_cols=["x"], label_cols=["id"], validation="is_val")
    assert _val_ids(store, meta) == list(range(0, 40, 4))
    assert meta["splits"]["train"]["total_rows"] == 30
    assert "is_val" not in meta["columns"]
    assert "is_val" not in read_split(store, meta, "train")[0].column_names


# -- reuse --------------------------------------------------------------------------------------

def test_reuse_writes_nothing(session, store, capsys):
    df = session.range(30).selectExpr("id", "cast(id as float) as x")
    meta = prep(df, store, feature_cols=["x"], label_cols=["id"], validation=0.3)
    base = store.get_data_path(meta["data_key"])
    stamps = {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns
              for d, _, fs in os.walk(base) for f in fs}
    again = prep(df, store, feature_cols=["x"], label_cols=["id"], validation=0.3, verbose=1)
    assert again == meta
    assert f"reusing prepared data {meta['data_key']}" in capsys.readouterr().err
    assert stamps == {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns
                      for d, _, fs in os.walk(base) for f in fs}
    # Another DataFrame gets another key (and its own files).
    other = session.range(31).selectExpr("id", "cast(id as float) as x")
    key2 = prep(other, store, feature_cols=["x"], label_cols=["id"], validation=0.3)["data_key"]
    assert key2 != meta["data_key"]
    assert store.listdir(store.prefix_path) == sorted(
        f"intermediate_{split}_data.{key}" for split in ("train", "val")
        for key in (meta["data_key"], key2))


def test_data_key_depends_on_every_input(spark):
    df = spark.range(5).selectExpr("id", "cast(id as float) as x")
    cols = [(f.name, f.dataType) for f in df.schema.fields]
    base = dict(columns=cols, validation=0.3, num_files=2, random_seed=0,
                vector_dtype="float32")
    key = data_key_of(df, **base)
    assert key == data_key_of(spark.range(5).selectExpr("id", "cast(id as float) as x"), **base)
    variants = [dict(columns=cols[::-1]), dict(validation=None), dict(validation="v"),
                dict(num_files=3), dict(random_seed=1), dict(vector_dtype="float64")]
    keys = {data_key_of(df, **{**base, **v}) for v in variants}
    keys.add(data_key_of(spark.range(6).selectExpr("id", "cast(id as float) as x"), **base))
    assert key not in keys and len(keys) == len(variants) + 1


# -- errors -------------------------------------------------------------------------------------

def test_missing_columns(spark, store):
    df = spark.range(3).selectExpr("id", "id as y")
    with pytest.raises(ValueError, match=r"\['nope'\] not found.*\['id', 'y'\]"):
        prep(df, store, feature_cols=["id", "nope"], label_cols=["y"])
    with pytest.raises(ValueError, match="'vcol'.*not found"):
        prep(df, store, feature_cols=["id"], validation="vcol")


@pytest.mark.parametrize("expr, match", [
    ("cast(id as string)", "type string.*StringIndexer"),
    ("map('a', id)", "type map<string,bigint>.*fixed numeric columns"),
    ("named_struct('a', id)", "type struct<a:bigint>.*select its fields"),
    ("cast(cast(id as string) as binary)", "type binary"),
    ("array(named_struct('a', id))", "type array<struct<a:bigint>>: arrays of struct"),
    ("array(array(cast(id as string)))", "type array<array<string>>: arrays of string"),
    ("current_date()", "type date.*unix_date"),
    ("current_timestamp()", "type timestamp.*unix_seconds"),
])
def test_unsupported_types(spark, store, expr, match):
    df = spark.range(3).selectExpr("id", f"{expr} as bad")
    with pytest.raises(ValueError, match=f"feature column 'bad' has {match}"):
        prep(df, store, feature_cols=["id", "bad"])


def test_sample_weight_must_be_numeric_scalar(spark, store):
    df = spark.range(3).selectExpr("id", "array(1.0, 2.0) as w")
    with pytest.raises(ValueError, match="sample weight column 'w'.*numeric scalar"):
        prep(df, store, feature_cols=["id"], sample_weight_col="w")


def test_nulls_are_counted(session, store):
    df = session.range(10).selectExpr(
        "id", "if(id < 3, null, cast(id as double)) as x", "if(id = 9, null, id) as y",
        "if(id = 0, null, 1.0) as w", "if(id = 5, array(1.0, null), array(1.0, 2.0)) as a",
        "if(id = 5, array(array(1.0), null), array(array(1.0), array(2.0))) as nested")
    with pytest.raises(ValueError, match=r"null values.*'x': 3 of 10 rows, 'y': 1 of 10 rows, "
                                         r"'w': 1 of 10 rows.*fillna.*na.drop"):
        prep(df, store, feature_cols=["id", "x"], label_cols=["y"], sample_weight_col="w")
    with pytest.raises(ValueError, match="'a' has null elements inside its arrays in 1 of 10"):
        prep(df, store, feature_cols=["a"])
    with pytest.raises(ValueError, match="'nested' has null elements inside its arrays in 1 of"):
        prep(df, store, feature_cols=["nested"])


def test_variable_length_arrays(spark, store):
    df = spark.range(10).selectExpr(
        "id", "sequence(0, id % 3) as a",
        "array(sequence(0, 1), sequence(0, id % 2 + 1)) as nested",
        "array_remove(array(1.0d), 1.0d) as empty")
    with pytest.raises(ValueError, match="'a' has arrays of varying length: lengths from 1 to 3"):
        prep(df, store, feature_cols=["a"])
    with pytest.raises(ValueError, match="'nested' has arrays of varying length at nesting "
                                         "level 2: lengths from 2 to 3"):
        prep(df, store, feature_cols=["nested"])
    with pytest.raises(ValueError, match="'empty' has empty arrays"):
        prep(df, store, feature_cols=["empty"])


def test_variable_length_vectors(spark, store):
    from pyspark.ml.linalg import Vectors
    df = spark.createDataFrame([(Vectors.dense([1.0, 2.0]),), (Vectors.sparse(3, {0: 1.0}),)],
                               ["v"])
    with pytest.raises(ValueError, match="'v' has vectors of varying length: lengths from 2 to 3"):
        prep(df, store, feature_cols=["v"], num_proc=1)


def test_empty_dataframe(session, store):
    with pytest.raises(ValueError, match="DataFrame is empty"):
        prep(session.range(0).selectExpr("id"), store, feature_cols=["id"])


@pytest.mark.parametrize("bad", [0, 0.0, 1.0, 1.5, -0.1, True])
def test_bad_validation_fraction(spark, store, bad):
    with pytest.raises(ValueError, match="validation"):
        prep(spark.range(5), store, feature_cols=["id"], validation=bad)


def test_bad_validation_column(spark, store):
    df = spark.range(8).selectExpr(
        "id", "cast(id as string) as s", "if(id = 1, null, true) as n", "id % 3 as three",
        "false as none", "true as all", "id < 7 as most")
    cases = [("s", "validation column 's' has type string.*boolean"),
             ("n", "validation column 'n' has nulls in 1 of 8 rows"),
             ("three", "'three' has 2 rows with values other than 0 .* and 1"),
             ("none", "'none' marks no rows for validation"),
             ("all", "'all' marks every row for validation"),
             ("most", "only 1 training rows for num_proc=2")]
    for col, match in cases:
        with pytest.raises(ValueError, match=match):
            prep(df, store, feature_cols=["id"], validation=col)


def test_too_few_rows_and_empty_splits(spark, store):
    with pytest.raises(ValueError, match="only 3 rows for num_proc=4"):
        prep(spark.range(3), store, feature_cols=["id"], num_proc=4)
    # A random split that leaves the validation side empty: nothing is left behind.
    with pytest.raises(ValueError, match="validation split is empty"):
        prep(spark.range(3), store, feature_cols=["id"], num_proc=1, validation=0.01)
    assert not store.exists(store.prefix_path) or store.listdir(store.prefix_path) == []
    with pytest.raises(ValueError, match="training split is empty|only 0 training rows"):
        prep(spark.range(3), store, feature_cols=["id"], num_proc=1, validation=0.99)


def test_module_imports_no_framework():
    code = ("import sys, spark_hvd.estimators.data._prepare, spark_hvd.estimators.store; "
            "bad = [m for m in ('torch', 'tensorflow', 'keras') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

