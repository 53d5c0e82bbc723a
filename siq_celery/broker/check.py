"""A worker's check, at start, that its broker keeps an unacknowledged task longer than
siq_celery may hold one by countdown (``siq_horizon``): otherwise a task waiting that long
may be redelivered, or its channel closed."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("siq_celery")

#: RabbitMQ's default consumer_timeout (30 min): a delivery unacknowledged longer closes the channel.
RABBITMQ_CONSUMER_TIMEOUT_S = 1800.0
REDIS_VISIBILITY_TIMEOUT_S = 3600.0  # kombu's default for the Redis (and SQS) transports


def warn_if_broker_forgets_before_horizon(app: Any, horizon: float) -> None:
    transport = str(app.conf.broker_url or "").split("://")[0].split("+")[0]
    options = app.conf.broker_transport_options or {}
    if transport in ("redis", "rediss", "sqs", "sentinel"):
        limit, name = float(options.get("visibility_timeout", REDIS_VISIBILITY_TIMEOUT_S)), "visibility_timeout"
    elif transport in ("amqp", "amqps", "pyamqp"):
        limit, name = RABBITMQ_CONSUMER_TIMEOUT_S, "RabbitMQ's default consumer_timeout"
    else:
        return
    if horizon >= limit * 0.9:
        logger.warning(
            "siq_celery: siq_horizon (%.0fs) is not well below the broker's %s (%.0fs): a task waiting by "
            "countdown that long may be redelivered or its channel closed; lower siq_horizon",
            horizon, name, limit,
        )  # fmt: skip
