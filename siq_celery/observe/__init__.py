"""What people and monitoring read of the store: the Prometheus collector and its HTTP
server (``siq exporter``, a worker's ``siq_metrics_port``), ``siq top``, ``siq export``
of the ledger, and the readings they share (drain time, what holds a queue)."""
