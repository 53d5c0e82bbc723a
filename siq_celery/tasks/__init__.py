"""The Celery side: :class:`~siq_celery.IntervalTask` (task.py), what its publish does
(publish.py: a ticket in the headers, an ETA on the store's clock) and what a worker does
before its body (gate.py: wait, hold, defer, report), the worker's signal handlers and
upkeep thread, parked tasks and their release, the nodes' declarations, the app's
settings and state. Importing it installs nothing (task.install, at an interval task's
first bind)."""
