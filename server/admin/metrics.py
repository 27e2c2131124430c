"""Prometheus counters of the admin API, rendered in the text exposition format."""

from __future__ import annotations

import threading
from collections import Counter


class AdminMetrics:
    """Thread-safe counters: uploads accepted/refused by reason, bytes, aggregation time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._accepted = 0
        self._refused: Counter[str] = Counter()
        self._accepted_bytes = 0
        self._received_bytes = 0
        self._aggregations = 0
        self._aggregation_seconds = 0.0
        self._last_aggregation_seconds = 0.0
        self._unauthenticated: Counter[str] = Counter()

    def upload_accepted(self, size: int) -> None:
        """Count an accepted upload of ``size`` bytes."""
        with self._lock:
            self._accepted += 1
            self._accepted_bytes += size
            self._received_bytes += size

    def upload_refused(self, reason: str, size: int = 0) -> None:
        """Count a refused upload."""
        with self._lock:
            self._refused[reason] += 1
            self._received_bytes += size

    def unauthenticated(self, kind: str) -> None:
        """Count a request refused before any identity was known (no token, bad token, host...)."""
        with self._lock:
            self._unauthenticated[kind] += 1

    def unauthenticated_counts(self) -> dict[str, int]:
        """The refusals `unauthenticated` counted, by kind."""
        with self._lock:
            return dict(self._unauthenticated)

    def aggregation_done(self, seconds: float) -> None:
        """Count one aggregation and its duration."""
        with self._lock:
            self._aggregations += 1
            self._aggregation_seconds += seconds
            self._last_aggregation_seconds = seconds

    def render(self) -> str:
        """Return the Prometheus text format."""
        with self._lock:
            lines = [
                "# HELP fedsplit_uploads_accepted_total Weight-file uploads stored.",
                "# TYPE fedsplit_uploads_accepted_total counter",
                f"fedsplit_uploads_accepted_total {self._accepted}",
                "# HELP fedsplit_uploads_refused_total Uploads refused, by reason; nothing stored.",
                "# TYPE fedsplit_uploads_refused_total counter",
            ]
            lines += [
                f'fedsplit_uploads_refused_total{{reason="{r}"}} {n}'
                for r, n in sorted(self._refused.items())
            ]
            lines += [
                "# HELP fedsplit_upload_bytes_total Bytes of accepted weight files.",
                "# TYPE fedsplit_upload_bytes_total counter",
                f"fedsplit_upload_bytes_total {self._accepted_bytes}",
                "# HELP fedsplit_upload_received_bytes_total Bytes of file data received, accepted or not.",
                "# TYPE fedsplit_upload_received_bytes_total counter",
                f"fedsplit_upload_received_bytes_total {self._received_bytes}",
                "# HELP fedsplit_aggregation_seconds Wall time of round aggregations.",
                "# TYPE fedsplit_aggregation_seconds summary",
                f"fedsplit_aggregation_seconds_sum {self._aggregation_seconds:.6f}",
                f"fedsplit_aggregation_seconds_count {self._aggregations}",
                "# HELP fedsplit_aggregation_last_seconds Wall time of the latest aggregation.",
                "# TYPE fedsplit_aggregation_last_seconds gauge",
                f"fedsplit_aggregation_last_seconds {self._last_aggregation_seconds:.6f}",
                "# HELP fedsplit_unauthenticated_refused_total Requests refused before any identity "
                "was known, by kind.",
                "# TYPE fedsplit_unauthenticated_refused_total counter",
            ]
            lines += [
                f'fedsplit_unauthenticated_refused_total{{kind="{k}"}} {n}'
                for k, n in sorted(self._unauthenticated.items())
            ]
        return "\n".join(lines) + "\n"
