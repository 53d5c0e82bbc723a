"""One error hierarchy: every error siq_celery raises on purpose is a :class:`SiqError`.

Messages name the queue (and the key, where state is involved) and say what to do.
"""

from __future__ import annotations

import re


class SiqError(Exception):
    """Base class of every error raised by siq_celery."""


class ConfigurationError(SiqError, ValueError):
    """A setting, URL or argument is not usable (raised before anything is written)."""


class InvalidIntervalError(ConfigurationError):
    """An interval or rate that cannot be parsed or is out of range."""


class InvalidQueueNameError(ConfigurationError):
    """A queue name that is empty, too long, or contains characters that break keys."""


class UnknownBackendError(ConfigurationError):
    """A state-store URL whose scheme no registered backend handles."""


class MissingDependencyError(ConfigurationError, ImportError):
    """An optional dependency is needed for the chosen feature (the message says which extra)."""


class QueueExistsError(SiqError):
    """``ensure(..., fail_if_exists=True)`` found state for the queue already."""


class QueueNotFoundError(SiqError, LookupError):
    """An operation that needs existing state (pause, status, ...) found none."""


class IntervalMismatchError(SiqError):
    """``ensure(interval=...)`` differs from the interval stored for the queue.

    ``ensure`` only checks: use ``declare()`` when the code's interval should take
    effect (what a worker does at start), or ``set_interval()`` for an override.
    """


class CorruptStateError(SiqError):
    """The store holds a value that is not what siq_celery wrote (say, text where a number
    belongs). Nothing is started from corrupt state."""

    def __init__(self, queue: str, key: str, field: str, value: object) -> None:
        self.queue, self.key, self.field, self.value = queue, key, field, value
        super().__init__(
            f"queue {queue!r}: field {field!r} of {key!r} holds {value!r}, not a valid value; "
            f"nothing was started. Inspect it, then start the queue's state afresh with "
            f"`celery -A APP siq reset {queue} --interval INTERVAL --yes` (or `siq --url URL reset ...`, "
            f"or IntervalQueue({queue!r}, url=..., interval=...).reset())."
        )


class StoreUnavailableError(SiqError, ConnectionError):
    """The state store could not be reached. Nothing starts unauthorized (fail closed)."""


class LostDeliveriesError(SiqError):
    """A task whose deliveries were lost with their worker process ``limit`` times in a
    row (it kills the process running it: out of memory, a crash in a C extension,
    ``os._exit``) is refused instead of being started again; its state becomes FAILURE
    with this error. (One argument, the message, so a result backend can rebuild it.)"""

    @classmethod
    def of(cls, task: str, limit: int) -> LostDeliveriesError:
        return cls(
            f"{task}: refused, not run again: its worker process died during each of its last {limit} "
            f"runs (siq_max_lost_deliveries={limit}); find what kills it (memory, a crash in a C "
            f"extension), then publish it again"
        )


# A URL's password, in its user info (scheme://user:password@host) or its query
# (?password=..., ?sentinel_password=...): never printed, logged or raised with it.
_USERINFO = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^:/@\s'\"]*):[^\s'\"/]*@")
_QUERY_PASSWORD = re.compile(r"(?P<head>[?&][A-Za-z_]*password=)[^&#\s'\"]*", re.IGNORECASE)


def redacted(text: object) -> str:
    """``text`` with the password of every URL in it replaced by ``***`` (the user name and
    host stay, so a message still says which server it means). Every message, log line and
    error that may carry a store or broker URL passes through this."""
    return _QUERY_PASSWORD.sub(r"\g<head>***", _USERINFO.sub(r"\g<head>:***@", str(text)))


def redacted_url(url: object) -> str:
    """A URL fit for a message: :func:`redacted`, and for text with no scheme (a URL
    mistyped without one) everything before its last ``@``."""
    text = str(url)
    if "://" not in text and "@" in text:
        return "***@" + text.rpartition("@")[2]
    return redacted(text)
