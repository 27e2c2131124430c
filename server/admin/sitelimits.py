"""Per-hospital limits, so that one hospital cannot slow the others down: how many uploads it
may have in progress at once (`UploadSlots`) and how many requests it may make (`RequestRate`).

Both answer 429 with ``Retry-After`` (`TooManyRequestsError`) and hold nothing beyond a counter
per hospital. A refused upload is answered before its body is read (the connection is then
closed: `limits.RequestGuard`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from fedsplit.server.admin.errors import TooManyRequestsError

#: Uploads one hospital may have in progress (received, parsed, stored) at once.
DEFAULT_CONCURRENT_UPLOADS = 2
#: Requests one hospital may make per minute, on average, and in one burst.
DEFAULT_REQUESTS_PER_MINUTE = 600
DEFAULT_BURST = 120


class UploadSlots:
    """How many uploads each hospital has in progress; thread-safe."""

    def __init__(self, per_site: int = DEFAULT_CONCURRENT_UPLOADS) -> None:
        self.per_site = per_site
        self._busy: dict[int, int] = {}
        self._lock = threading.Lock()

    @contextmanager
    def hold(self, site_id: int, site_name: str) -> Iterator[None]:
        """Hold one of ``site_id``'s slots for the block; 429 when all are taken."""
        with self._lock:
            busy = self._busy.get(site_id, 0)
            if busy >= self.per_site:
                raise TooManyRequestsError(
                    f"Site {site_name!r} already has {busy} upload(s) in progress, the most this "
                    f"server takes from one hospital at once (--site-concurrent-uploads "
                    f"{self.per_site}). Wait for them to finish, then send this one again. "
                    f"Received: upload {busy + 1} at once", 5.0)
            self._busy[site_id] = busy + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._busy.get(site_id, 1) - 1
                if left > 0:
                    self._busy[site_id] = left
                else:
                    self._busy.pop(site_id, None)


class RequestRate:
    """A token bucket per hospital: ``per_minute`` requests a minute on average, ``burst`` at
    once; thread-safe."""

    def __init__(self, per_minute: int = DEFAULT_REQUESTS_PER_MINUTE, burst: int = DEFAULT_BURST) -> None:
        self.rate_s = per_minute / 60.0
        self.burst = float(burst)
        self.per_minute = per_minute
        self._buckets: dict[int, tuple[float, float]] = {}  # site id -> (tokens, at)
        self._lock = threading.Lock()

    def take(self, site_id: int, site_name: str) -> None:
        """Count one request of ``site_id``; 429 when its bucket is empty."""
        now = time.monotonic()
        with self._lock:
            tokens, at = self._buckets.get(site_id, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.rate_s)
            if tokens < 1.0:
                self._buckets[site_id] = (tokens, now)
                wait = (1.0 - tokens) / self.rate_s
                raise TooManyRequestsError(
                    f"Site {site_name!r} is sending requests faster than this server takes from "
                    f"one hospital ({self.per_minute} a minute, --site-requests-per-minute); wait "
                    f"{max(1, round(wait))} s. Received: a request over the rate", wait)
            self._buckets[site_id] = (tokens - 1.0, now)
