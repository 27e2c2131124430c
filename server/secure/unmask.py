"""The coordinator's unmasking work, split over worker processes.

Removing the masks of one secure sum (`server.secure.secagg.SecureSum.total`) means, per
hospital, one Shamir reconstruction (Flower's ``combine_shares``: pycryptodome's GF(2^128)
arithmetic in pure Python, about 5 ms for a 16-byte seed) and one or more 100k-value masks
(Flower's ``pseudo_rand_gen``). These jobs are independent and hold the GIL, so threads do not
help; they run in a persistent process pool instead, each worker summing the masks of its share
of the jobs into one correction vector. Nothing here is cryptography of its own: the same two
Flower primitives run, only in other processes.

Workers: ``FEDSPLIT_SECAGG_WORKERS`` (an integer >= 1; default: the CPUs this process may use,
at most 8), read by the ServerApps where they start (`workers_from`, `use_workers`). One
worker, or fewer than `MIN_PARALLEL` jobs, runs the serial path in process (same function,
same result). The pool uses the ``forkserver`` start method (the coordinator
runs inside Flower's multi-threaded simulation or ServerApp process, where a plain ``fork`` is
unsafe) and is started in the background when a large enough round begins (`warm_up`), so its
start overlaps the key-exchange stages. It lives as long as the coordinator: each worker exits
as soon as the coordinator's process ends, however it ends (`_watch`). Its workers import
this module (and so Flower's primitives) once, when the pool starts.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np
from fedsplit.protocol import secure_vector as sv
from fedsplit.protocol.errors import ConfigError
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

log = logging.getLogger(__name__)

WORKERS_ENV = "FEDSPLIT_SECAGG_WORKERS"
MIN_PARALLEL = 16  # below this many reconstructions the serial path is faster than dispatching


@dataclass(frozen=True)
class Job:
    """One hospital's mask removal.

    ``pairs`` empty: ``shares`` reconstruct its private-mask seed b (it sent its vector).
    Otherwise it dropped: ``shares`` reconstruct its sk1, and ``pairs`` lists, for each active
    neighbour, (that neighbour's pk1, +1 if the neighbour added +PRG(s) for it, else -1).
    """

    shares: tuple[bytes, ...]
    pairs: tuple[tuple[bytes, int], ...] = ()


def correction(jobs: Sequence[Job], size: int) -> np.ndarray:
    """The vector to subtract (mod 2^62) from the sum of the masked vectors for ``jobs``."""
    out = np.zeros(size, dtype=np.int64)
    for job in jobs:
        secret = combine_shares(list(job.shares))
        if not job.pairs:
            out = sv.add(out, sv.mask(secret, size))
            continue
        sk1 = bytes_to_private_key(secret)
        for pk1, sign in job.pairs:
            pair = sv.mask(generate_shared_key(sk1, bytes_to_public_key(pk1)), size)
            out = sv.add(out, pair) if sign > 0 else sv.sub(out, pair)
    return out


def default_workers() -> int:
    """The CPUs this process may use, at most 8."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


def workers_from(environ: Mapping[str, str]) -> int:
    """Worker processes for unmasking as ``environ`` (the coordinator's environment, read
    where its process starts) names them: ``FEDSPLIT_SECAGG_WORKERS``, else `default_workers`."""
    raw = environ.get(WORKERS_ENV, "").strip()
    if not raw:
        return default_workers()
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"{WORKERS_ENV} is the number of unmasking worker processes, an integer "
                          f">= 1 (1 = serial). Received: {raw!r}")
    return int(raw)


#: The unmasking pool's size in this process (`use_workers`); None: `default_workers`.
_workers: int | None = None


def use_workers(count: int) -> None:
    """Size the process's unmasking pool (one per process, as the pool): set once by the
    ServerApp where it starts, from `workers_from` its environment."""
    global _workers
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigError(f"Unmasking needs at least one worker. Received: {count!r}")
    _workers = count


def workers() -> int:
    """Worker processes for unmasking in this process (`use_workers`, else `default_workers`)."""
    return _workers if _workers is not None else default_workers()


_lock = threading.Lock()
_pool: ProcessPoolExecutor | None = None
_pool_size = 0
_alive: Connection | None = None  # write end held only here: workers see EOF when we are gone


def _get_pool(size: int) -> ProcessPoolExecutor:
    global _pool, _pool_size, _alive
    with _lock:
        if _pool is None or _pool_size != size:
            if _pool is not None:
                _pool.shutdown(wait=False, cancel_futures=True)
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload([__name__])
            watch, _alive = ctx.Pipe(duplex=False)
            _pool = ProcessPoolExecutor(max_workers=size, mp_context=ctx, initializer=_watch,
                                        initargs=(watch,))
            _pool_size = size
        return _pool


def _watch(coordinator: Connection) -> None:
    """Worker initializer: exit when the coordinator's process is gone.

    A coordinator that ends without running its exit handlers (Flower stops a simulation's
    process with a signal) would otherwise leave its workers waiting on their queue forever
    (and the forkserver with them, which lives while any of its children hold its pipe). Only
    the coordinator holds the other end of ``coordinator``: it reads EOF once that process has
    ended, however it ended."""

    def watch() -> None:
        try:
            while True:
                coordinator.recv()
        except (EOFError, OSError):
            os._exit(0)

    threading.Thread(target=watch, name="fedsplit-unmask-watch", daemon=True).start()


def _ready() -> int:
    return os.getpid()


def warm_up(jobs: int, count: int | None = None) -> list[Future]:
    """Start the pool in the background if a sum of ``jobs`` reconstructions will use it
    (``count`` workers, default `workers`); the futures resolve once each worker answered."""
    count = workers() if count is None else count
    if count <= 1 or jobs < MIN_PARALLEL:
        return []
    pool = _get_pool(count)
    return [pool.submit(_ready) for _ in range(count)]


def parallel_correction(jobs: Sequence[Job], size: int, count: int | None = None) -> np.ndarray:
    """`correction` over ``count`` worker processes (default `workers`); serial for one worker
    or fewer than `MIN_PARALLEL` jobs. The result is the same either way."""
    count = workers() if count is None else count
    if count < 1:
        raise ConfigError(f"Unmasking needs at least one worker. Received: {count}")
    if count == 1 or len(jobs) < MIN_PARALLEL:
        return correction(jobs, size)
    # dropped hospitals' jobs cost more (an sk1 of 20 chunks, several masks): deal them first
    ordered = sorted(jobs, key=lambda j: -len(j.pairs))
    parts = [ordered[i::count] for i in range(count)]
    pool = _get_pool(count)
    try:
        results = list(pool.map(correction, parts, [size] * len(parts)))
    except BrokenProcessPool as e:  # a worker died (killed, out of memory): same sum, serially
        log.warning("Secure aggregation: the unmasking pool broke (%s); unmasking in process "
                    "and starting a new pool next time", e)
        _drop_pool(pool)
        return correction(jobs, size)
    out = np.zeros(size, dtype=np.int64)
    for part in results:
        out = sv.add(out, part)
    return out


def _drop_pool(pool: ProcessPoolExecutor) -> None:
    global _pool, _pool_size
    with _lock:
        if _pool is pool:
            _pool, _pool_size = None, 0
    pool.shutdown(wait=False, cancel_futures=True)
