"""siq_celery's data pipeline on Spark (needs ``pip install 'siq_celery[spark]'``).

* :mod:`siq_celery.spark.audit`: ``siq audit``, proving from a ledger that the interval held.
* :func:`submit_dataframe`: one interval task per row, published from the executors.
* :func:`interval_map`: a function per row, each call taking its turn in an interval queue.
"""

from __future__ import annotations

from .jobs import interval_map, submit_dataframe

__all__ = ["interval_map", "submit_dataframe"]
