"""The SparkSession of ``siq audit``: its master and its ``--conf`` settings."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any


def spark_session(master: str | None = None, app_name: str = "siq audit", conf: dict[str, str] | None = None) -> Any:
    """A session for the audit (``master=None``: whatever spark-submit configured);
    ``conf``: Spark settings, applied last."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.appName(app_name)
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.ui.showConsoleProgress", "false")  # siq audit prints its own progress
    )
    if master and master.startswith("local"):
        # One machine: executors run this Python (with siq_celery and Celery installed), and
        # a few shuffle partitions do, not the cluster default of 200.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        builder = (
            builder.master(master)
            .config("spark.ui.enabled", "false")
            .config("spark.driver.memory", "2g")
            .config("spark.sql.shuffle.partitions", "8")
        )
    elif master:
        builder = builder.master(master)
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def spark_conf(settings: Sequence[str]) -> dict[str, str]:
    """Spark settings given as spark-submit's ``--conf KEY=VALUE``, by key; ValueError
    naming the first that has no ``=``."""
    bad = [item for item in settings if "=" not in item]
    if bad:
        raise ValueError(f"--conf takes KEY=VALUE, not {bad[0]!r}")
    return dict(item.split("=", 1) for item in settings)
