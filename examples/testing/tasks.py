"""A geocoding app: ``geocode`` calls a service that allows one call per 200 ms from all of
its clients together, so every worker shares one interval queue, ``geocoder``, and a 429
holds that queue for as long as the service asks. ``test_tasks.py`` tests it."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from celery import Celery

from siq_celery import IntervalTask

app = Celery("geo", broker=os.environ.get("GEO_BROKER", "redis://localhost:6379/0"))

GEOCODER = "https://geocoder.example/search"


def lookup(address: str) -> dict[str, Any]:
    """The service's answer for ``address`` (urllib's HTTPError for an error status)."""
    with urllib.request.urlopen(f"{GEOCODER}?{urllib.parse.urlencode({'q': address})}", timeout=10) as reply:
        return dict(json.load(reply))


@app.task(base=IntervalTask, interval="200ms", interval_queue="geocoder", bind=True)
def geocode(self: Any, address: str) -> dict[str, Any]:
    try:
        return lookup(address)
    except urllib.error.HTTPError as exc:
        if exc.code == 429:
            self.siq_backoff(exc)  # its Retry-After: the queue waits, then this call runs again first
        raise
