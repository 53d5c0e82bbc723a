"""A bounded mapping that forgets the least recently used entry: the per-queue caches of
a long-lived process (one entry per per-key queue it ever saw) must not grow for ever."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class LRUCache(Generic[K, V]):
    """At most ``size`` entries; reading or writing one makes it the most recent. Safe to
    share between threads (the threads pool)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"an LRU cache holds at least 1 entry, not {size}")
        self.size = size
        self._items: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K, default: V | None = None) -> V | None:
        with self._lock:
            try:
                self._items.move_to_end(key)
            except KeyError:
                return default
            return self._items[key]

    def __setitem__(self, key: K, value: V) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)
