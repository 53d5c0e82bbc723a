"""siq_celery: one start interval shared by every worker of a queue, on every host.

The core (:class:`IntervalQueue`) works standalone on Redis, SQLite or memory; the Celery
integration builds on it.
"""

from .backends import Backend, ModelBackend, backend_from_url, register_backend
from .client.combined import CombinedQueue
from .client.queue import IntervalQueue
from .client.waiting import DuplicateTaskError, SlotTimeoutError
from .errors import (
    ConfigurationError,
    CorruptStateError,
    IntervalMismatchError,
    InvalidIntervalError,
    InvalidQueueNameError,
    LostDeliveriesError,
    MissingDependencyError,
    QueueExistsError,
    QueueNotFoundError,
    SiqError,
    StoreUnavailableError,
    UnknownBackendError,
)
from .intervals import format_interval, parse_interval
from .limits import Limit
from .tasks.task import IntervalTask
from .types import ClaimResult, Decision, QueueState, QueueStatus, Ticket, Verdict

__version__ = "0.1.0"

__all__ = [
    "Backend", "ModelBackend", "backend_from_url", "register_backend",
    "ConfigurationError", "CorruptStateError", "IntervalMismatchError", "InvalidIntervalError",
    "InvalidQueueNameError", "LostDeliveriesError", "MissingDependencyError", "QueueExistsError", "QueueNotFoundError",
    "SiqError", "StoreUnavailableError", "UnknownBackendError", "DuplicateTaskError", "SlotTimeoutError",
    "format_interval", "parse_interval", "Limit", "IntervalQueue", "CombinedQueue", "IntervalTask",
    "ClaimResult", "Decision", "QueueState", "QueueStatus", "Ticket", "Verdict",
]  # fmt: skip
