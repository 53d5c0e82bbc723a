"""What ``siq audit`` reads and writes: ledger files, Parquet tables, text files, on any
filesystem Hadoop reaches (local, HDFS, S3 with the cluster's connector)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def ledger_schema() -> Any:
    from pyspark.sql import types as T

    return T.StructType([
        T.StructField("queue", T.StringType()), T.StructField("epoch", T.StringType()),
        T.StructField("ticket", T.LongType()), T.StructField("task_id", T.StringType()),
        T.StructField("task_name", T.StringType()), T.StructField("slot_us", T.LongType()),
        T.StructField("start_us", T.LongType()), T.StructField("interval_us", T.LongType()),
        T.StructField("finish_us", T.LongType()), T.StructField("outcome", T.StringType()),
        T.StructField("deferrals", T.IntegerType()), T.StructField("host", T.StringType()),
        T.StructField("pid", T.IntegerType()), T.StructField("cost", T.IntegerType()),
        T.StructField("burst", T.IntegerType()), T.StructField("quota", T.LongType()),
        T.StructField("window_us", T.LongType()), T.StructField("concurrency", T.IntegerType()),
        T.StructField("lease_us", T.LongType()), T.StructField("lease_returned", T.BooleanType()),
        T.StructField("fair_key", T.StringType()), T.StructField("fair_tag", T.LongType()),
        T.StructField("fair_weight", T.IntegerType()), T.StructField("began_us", T.LongType()),
        T.StructField("v", T.ShortType()),
    ])  # fmt: skip


def read_ledger_files(spark: Any, paths: Sequence[str], fmt: str | None = None) -> Any:
    """One DataFrame of the ledger files in ``paths``, Parquet and JSON Lines mixed (each by
    its extension, or all as ``fmt``), read with :func:`ledger_schema`: a column an older
    schema version lacks (``cost``, before version 2; the limits and the lease, before
    version 3; the fair share, before version 4; the body's report, before version 5) reads
    as null."""
    frames = []
    for kind in ("parquet", "json"):
        chosen = [p for p in paths if (fmt or format_of(p)) == kind]
        if chosen:
            reader = spark.read.schema(ledger_schema())
            frames.append(reader.parquet(*chosen) if kind == "parquet" else reader.json(chosen))
    return frames[0] if len(frames) == 1 else frames[0].unionByName(frames[1])


def format_of(path: str) -> str:
    lowered = path.lower().rstrip("/")
    return "json" if lowered.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz", ".ndjson")) else "parquet"


def write_table(table: Any, path: str) -> None:
    """``table`` as Parquet at ``path``, replacing what was there."""
    table.write.mode("overwrite").parquet(path)


def read_table(spark: Any, path: str) -> Any:
    return spark.read.parquet(path)


def hadoop_path(spark: Any, path: str) -> tuple[Any, Any]:
    """(filesystem, path) of the Hadoop filesystem that holds ``path`` (local, HDFS, S3...)."""
    jvm = spark.sparkContext._jvm
    path_in_hadoop = jvm.org.apache.hadoop.fs.Path(path)
    return path_in_hadoop.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()), path_in_hadoop


def remove(spark: Any, path: str) -> None:
    """Delete ``path`` and all under it, on whatever filesystem holds it."""
    fs, path_in_hadoop = hadoop_path(spark, path)
    fs.delete(path_in_hadoop, True)


def write_text(spark: Any, path: str, text: str) -> None:
    """Write a small text file wherever the tables went (local path, or any Hadoop filesystem)."""
    if "://" not in path or path.startswith("file://"):
        local = Path(path.removeprefix("file://"))
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_text(text, encoding="utf-8")
        return
    fs, path_in_hadoop = hadoop_path(spark, path)
    stream = fs.create(path_in_hadoop, True)
    try:
        stream.write(bytearray(text.encode("utf-8")))
    finally:
        stream.close()
