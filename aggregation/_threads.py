"""Worker threads for the blocked aggregation passes (numpy releases the GIL in its loops)."""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor

from aggregation.errors import AggregationError


def worker_count() -> int:
    """Threads an aggregation uses: ``FEDSPLIT_AGG_THREADS``, default the CPU count (at most 8).

    numpy's sort and element-wise loops release the GIL, so blocks or tiles run in parallel
    threads. On a coordinator whose cores are busy with other work, set
    ``FEDSPLIT_AGG_THREADS=1``.
    """
    raw = os.environ.get("FEDSPLIT_AGG_THREADS", "").strip()
    if not raw:
        return max(1, min(8, os.cpu_count() or 1))
    if not raw.isdigit() or int(raw) < 1:
        raise AggregationError(
            f"FEDSPLIT_AGG_THREADS must be a whole number >= 1 (threads an aggregation uses). "
            f"Received: {raw!r}"
        )
    return int(raw)


@functools.cache
def executor(workers: int) -> ThreadPoolExecutor:
    """The process-wide pool of ``workers`` aggregation threads (created once, then reused)."""
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fedsplit-agg")
