"""The ``siq`` command: operate interval queues in a state store.

    siq --url redis://localhost:6379/0 status [QUEUE...] [--json]
    siq --url ... pause QUEUE | resume QUEUE | reset QUEUE [--yes]
    siq --url ... set-interval QUEUE 250ms | set-interval QUEUE --clear
    siq --url ... set-limits QUEUE [--burst N] [--quota 100/1m|none] [--concurrency N|none]
                             [--margin 5ms|none] | --clear
    siq --url ... export [QUEUE...] --out ledger.parquet [--since 2h --until ...]
    siq --url ... exporter [PATTERN...] [--port 9808] [--max-queues 1000] [--fair-top 10]
    siq --url ... top [PATTERN]
    siq audit LEDGER... --out DIR [--master local[*]] [--tolerance 1ms]
    siq demo [--workers 3 --concurrency 2 --tasks 60 --interval 100ms --out siq-demo.png]

``--url`` defaults to ``$SIQ_URL``. Errors are one line on stderr and a non-zero exit.
"""

from .main import QUEUE_COMMANDS, main, siq, version_option
from .options import SiqGroup, StoreOptions, one_line_errors
from .status import status_rows

__all__ = [
    "QUEUE_COMMANDS",
    "SiqGroup",
    "StoreOptions",
    "main",
    "one_line_errors",
    "siq",
    "status_rows",
    "version_option",
]
