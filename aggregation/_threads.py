"""Worker threads for the blocked aggregation passes (numpy's loops and every compiled kernel
release the GIL), shared by every backend."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fedsplit.aggregation.errors import AggregationError

T = TypeVar("T")


#: The environment variable of the worker threads (`worker_count`).
THREADS_ENV = "FEDSPLIT_AGG_THREADS"


def cpu_threads() -> int:
    """The default thread count: the CPU count, at most 8."""
    return max(1, min(8, os.cpu_count() or 1))


def worker_count(environ: Mapping[str, str]) -> int:
    """Threads an aggregation uses as ``FEDSPLIT_AGG_THREADS`` says (default `cpu_threads`),
    read by `aggregation.backend.BackendSettings.from_environ` once at start-up.

    numpy's sort and element-wise loops release the GIL, so blocks or tiles run in parallel
    threads. On a coordinator whose cores are busy with other work, set
    ``FEDSPLIT_AGG_THREADS=1``.
    """
    raw = environ.get(THREADS_ENV, "").strip()
    if not raw:
        return cpu_threads()
    if not raw.isdigit() or int(raw) < 1:
        raise AggregationError(
            f"{THREADS_ENV} must be a whole number >= 1 (threads an aggregation uses). "
            f"Received: {raw!r}"
        )
    return int(raw)


def executor(workers: int) -> ThreadPoolExecutor:
    """The process-wide pool of ``workers`` aggregation threads (created once, then reused).

    Keyed by process id too: a forked child (the admin API's parsing sandbox) gets its own pool
    instead of the parent's, whose threads do not exist in the child.
    """
    return _executor(workers, os.getpid())


@functools.cache
def _executor(workers: int, pid: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fedsplit-agg")


#: Below this many input values a pass runs in the calling thread (starting threads costs more).
THREADED_FROM = 1 << 20


def threads_for(values: int, tasks: int, workers: int) -> int:
    """Threads for a pass over ``values`` input values split into ``tasks`` independent parts,
    at most ``workers`` (the settings' `threads`)."""
    if values < THREADED_FROM:
        return 1
    return max(1, min(workers, tasks))


def round_robin(items: Sequence[T], threads: int) -> list[Sequence[T]]:
    """Deal ``items`` to ``threads`` shares: share j holds items j, j + threads, ...

    Neighbouring blocks then run side by side, so the threads stream nearby memory.
    """
    return [items[j::threads] for j in range(threads)]


def map_threads(fn: Callable[..., T], threads: int, *iterables: Iterable[Any]) -> list[T]:
    """``list(map(fn, *iterables))``, on ``threads`` pool threads when more than one."""
    if threads > 1:
        return list(executor(threads).map(fn, *iterables))
    return list(map(fn, *iterables))
