"""The read engine of aggregation's passes over weight files: values read where they lie.

A `protocol.WeightFile` validates a file's structure and reads parameters through HDF5. A pass
over many large files reads faster without HDF5 in the way: this module maps the file
(`FileReads.mapped`, copy-on-write), reads values with one positional read each
(`FileReads.read_values`, ``os.preadv``) or hands the C kernels a descriptor and an offset
(`FileReads.raw_location`), and drops the pages a pass is done with (`FileReads.unmap`). Only
for parameters stored as they lie (`WeightFile.storage_offset`) of a file opened from a path
(`WeightFile.vfd_handle`); otherwise the passes read through `WeightFile.read_into`.

The switch is `ReadSettings` (``FEDSPLIT_MMAP=0`` turns mapping and positional reads off),
part of `aggregation.settings.BackendSettings` (``reads``): built once where a command or service
starts and passed in; each backend operation makes its files' engines with it (`reads_of`)
before the pass, and a file keeps the engine it was first read with. Nothing reads the
environment during a pass.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from fedsplit.protocol.arrays import ArraySpec
from fedsplit.protocol.errors import WeightFileError
from fedsplit.protocol.weights import WeightFile

#: The environment variable of `ReadSettings.mmap` ("0": off).
MMAP_ENV = "FEDSPLIT_MMAP"


@dataclass(frozen=True)
class ReadSettings:
    """How passes read weight files. ``mmap``: map files and read values with positional reads
    where they lie (True), or read everything through HDF5 (False, ``FEDSPLIT_MMAP=0``)."""

    mmap: bool = True

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> ReadSettings:
        """The settings ``environ`` (the process's environment, read where it starts) names
        (``FEDSPLIT_MMAP``: "0" off, anything else on)."""
        return cls(mmap=environ.get(MMAP_ENV, "1").strip() != "0")


#: Pages of values a pass is done with are dropped from the process in runs of this many
#: bytes per file (`WeightFile.unmap`): a few calls where one call per block cost more than the
#: reads (FedAvg over 30 x 10M files: 0.98 s -> 0.84 s; runs of 1 MiB: 0.86 s, 16 MiB: 0.82 s)
UNMAP_RUN_BYTES = 4 * 2**20
#: ... and at most this many bytes over all mapped files together (runs get shorter when many
#: files are mapped at once, down to `UNMAP_MIN_RUN_BYTES`): the resident memory a pass holds
#: in done pages stays about the same however many hospitals send a file.
UNMAP_TOTAL_BYTES = 128 * 2**20
UNMAP_MIN_RUN_BYTES = 256 * 1024

_MAPPED = [0]  # weight files mapped now, in this process (`_MAPPED_LOCK`)
_MAPPED_LOCK = threading.Lock()


def _unmap_run() -> int:
    """Bytes of done pages a mapped file drops at once (`WeightFile.unmap`)."""
    share = UNMAP_TOTAL_BYTES // max(1, _MAPPED[0])
    return max(UNMAP_MIN_RUN_BYTES, min(UNMAP_RUN_BYTES, share))

_MAPPED = [0]  # weight files mapped now, in this process (`_MAPPED_LOCK`)
_MAPPED_LOCK = threading.Lock()


def _unmap_run() -> int:
    """Bytes of done pages a mapped file drops at once (`FileReads.unmap`)."""
    share = UNMAP_TOTAL_BYTES // max(1, _MAPPED[0])
    return max(UNMAP_MIN_RUN_BYTES, min(UNMAP_RUN_BYTES, share))


class FileReads:
    """One open weight file's engine: its mapping, its descriptor and the done pages.

    Made once per file by `reads_of` (passes share a file between threads and rounds); closed
    with the file (`WeightFile.on_close`).
    """

    def __init__(self, file: WeightFile, settings: ReadSettings) -> None:
        # a proxy: the engine (a value of `_ENGINES`) must not keep its file (the key) alive
        self._file: WeightFile = weakref.proxy(file)
        self._settings = settings
        self._map: mmap.mmap | None = None  # the whole file, mapped read-only on first use
        self._mapped: dict[str, np.ndarray | None] = {}
        self._map_address: int | None = None
        self._map_lock = threading.Lock()
        # bytes of the mapping that passes are done with and that are not dropped yet
        # (`unmap`): how many, and the range they lie in
        self._done_bytes = 0
        self._done_span = (0, 0)
        # our own descriptor of the file HDF5 opened, for `read_values` (None: not opened yet;
        # -1: this file cannot be read that way)
        self._fd: int | None = None

    @property
    def settings(self) -> ReadSettings:
        """The settings this engine was made with."""
        return self._settings

    def read_values(self, name: str, start: int, out: np.ndarray) -> bool:
        """Copy values ``[start, start + out.size)`` of parameter ``name`` (flat, C order) into
        ``out`` with one positional read of the file (``os.preadv``), and return True.

        For a file opened from a path whose parameter lies in it as it is (what `mapped` maps:
        contiguous, unfiltered, allocated, aligned, this machine's byte order) and a writeable
        C-contiguous 1-D ``out`` of the parameter's dtype; returns False otherwise (read it with
        `read_into`, which converts). The read goes from the page cache straight into ``out``
        (no HDF5 call, no mapping, so nothing stays resident and no page tables change) and
        releases the GIL: the streamed passes' reader. The descriptor is a duplicate of the one
        HDF5 opened (the same file, even if one is renamed over it later), closed by `close`.
        A file that shrank since it was opened raises `WeightFileError` (reason ``corrupt``).
        `ReadSettings.mmap` False (``FEDSPLIT_MMAP=0``) turns these reads off with the mapping.
        """
        spec = self._file.spec(name)
        if (
            out.dtype != spec.dtype
            or out.ndim != 1
            or not out.flags.c_contiguous
            or not out.flags.writeable
            or start < 0
            or start + out.size > spec.size
        ):
            return False
        if out.size == 0:
            return True
        where = self.raw_location(name)
        if where is None:
            return False
        fd, offset = where
        got = os.preadv(fd, [out], offset + start * spec.dtype.itemsize)
        if got != out.nbytes:
            raise self.read_failure(name, start, out.nbytes, got)
        return True

    def raw_location(self, name: str) -> tuple[int, int] | None:
        """``(descriptor, byte offset)`` of parameter ``name``'s first value when its values lie
        in the file as they are (what `read_values` reads: contiguous, unfiltered, allocated,
        aligned, this machine's byte order, inside the file as it was opened), else None.

        For readers that issue their own positional reads (the C kernels of the streamed
        passes, `aggregation._ckernels`): value ``i`` is at ``offset + i * itemsize``. The
        descriptor is this file's own (see `read_values`) and stays open until `close`; a read
        that fails or comes back short is reported with `read_failure`."""
        spec = self._file.spec(name)
        offset = self._file.storage_offset(name)
        if offset is None or spec.size == 0:
            return None
        fd = self._descriptor()
        if fd < 0 or offset + spec.size * spec.dtype.itemsize > self._file.opened_size:
            return None
        return fd, offset

    def read_failure(
        self, name: str, start: int, wanted: int, got: int, errno: int = 0
    ) -> WeightFileError:
        """The error for a positional read of ``wanted`` bytes of ``name`` at value ``start``
        that returned ``got`` (``errno`` 0: the file ended early, i.e. it was truncated or
        replaced in place while open; else the system's error)."""
        if errno:
            return WeightFileError(
                f"{self._file.where}: parameter {name!r} could not be read at value {start} "
                f"({os.strerror(errno)}); check the disk, then send the file again. "
                f"Received: errno {errno}",
                reason="corrupt",
            )
        return WeightFileError(
            f"{self._file.where}: parameter {name!r} ends early in the file ({got} of {wanted} bytes "
            f"read at value {start}); the file was truncated or replaced in place while open. "
            f"Send it again. Received: {got} bytes",
            reason="corrupt",
        )

    def _descriptor(self) -> int:
        """Our duplicate of HDF5's descriptor (opened once), or -1 when there is none."""
        if self._fd is None:
            with self._map_lock:
                if self._fd is None:
                    handle = self._file.vfd_handle() if self._settings.mmap else None
                    self._fd = os.dup(handle) if handle is not None else -1
        return self._fd

    def mapped(self, name: str) -> np.ndarray | None:
        """Parameter ``name``'s values as a flat array mapped from the file, or None.

        Without a copy: the array is a view of the file's pages (page cache), so a pass reads
        the values where they lie instead of copying them into a buffer first. Given only
        for a file opened from a path whose parameter is stored contiguous (no filters),
        allocated, aligned, inside the file and in this machine's byte order; None otherwise
        (`read_into` then reads it). Values are not checked finite here, like `read_into`.
        The mapping is copy-on-write: writing to the array changes this process's copy only.
        The mapping is of the file HDF5 opened (its own descriptor), so a file renamed over
        it later is not seen; a file truncated in place while open would fault, which
        fedsplit never does (it writes weight files atomically, by rename). `ReadSettings.mmap`
        False (``FEDSPLIT_MMAP=0``) turns mapping off.
        """
        if name in self._mapped:
            return self._mapped[name]
        spec = self._file.spec(name)
        with self._map_lock:  # passes share a file between threads: map it once
            if name not in self._mapped:
                try:
                    self._mapped[name] = self._map_dataset(name, spec)
                except (OSError, ValueError, RuntimeError, KeyError):
                    self._mapped[name] = None  # read_into reads it (and names a damaged file)
            return self._mapped[name]

    def unmap(self, name: str, start: int, stop: int) -> None:
        """Mark values ``[start, stop)`` of parameter ``name`` (`mapped`) as done: their pages
        are dropped from this process, staying in the page cache (mapped again if touched).

        Pages are dropped (`madvise(MADV_DONTNEED)`) once a run of them is done
        (`UNMAP_RUN_BYTES`, shorter when many files are mapped: `UNMAP_TOTAL_BYTES` over all of
        them), all at once: the whole pages of the file range the done values lie in, in one
        call. One call per short block cost more than the pass's reads (each call also stops
        the other threads' CPUs to flush their address caches). A pass moves forward through
        the file, so the range is about the blocks done; a block another thread is still
        reading in it only has its pages mapped again (the values are unchanged). So a pass's
        resident memory stays at its current blocks plus under one run per file. `drop_done`
        drops the rest at the end of a pass.
        """
        view = self._mapped.get(name)
        if view is None or self._map is None or stop <= start:
            return
        base = view.__array_interface__["data"][0] - self._base_address()
        first = base + start * view.itemsize
        last = base + stop * view.itemsize
        with self._map_lock:
            if self._done_bytes:
                lo, hi = self._done_span
                first, last = min(lo, first), max(hi, last)
            self._done_bytes += (stop - start) * view.itemsize
            self._done_span = (first, last)
            if self._done_bytes >= _unmap_run():
                self._drop_done()

    def drop_done(self) -> None:
        """Drop the pages of the values `unmap` was told are done and not dropped yet (a
        pass calls this when it ends)."""
        with self._map_lock:
            self._drop_done()

    def _drop_done(self) -> None:
        first, last = self._done_span
        self._done_bytes, self._done_span = 0, (0, 0)
        first += -first % mmap.PAGESIZE  # whole pages inside the range only
        last -= last % mmap.PAGESIZE
        if self._map is not None and last > first:
            self._map.madvise(mmap.MADV_DONTNEED, first, last - first)

    def _base_address(self) -> int:
        assert self._map is not None
        if self._map_address is None:
            probe = np.frombuffer(self._map, dtype=np.uint8, count=1)
            self._map_address = probe.__array_interface__["data"][0]
        return self._map_address

    def _map_dataset(self, name: str, spec: ArraySpec) -> np.ndarray | None:
        if not self._settings.mmap or spec.size == 0:
            return None
        offset = self._file.storage_offset(name)
        return None if offset is None else self._map_at(offset, spec)

    def _map_at(self, offset: int, spec: ArraySpec) -> np.ndarray | None:
        """The parameter's values mapped from byte ``offset`` of the file (None: cannot map)."""
        if self._map is None:
            handle = self._file.vfd_handle()
            if handle is None:
                return None
            # copy-on-write: the arrays are writeable like in-memory ones (so compiled kernels
            # see one array type), and a write would stay in this process, never the file
            self._map = mmap.mmap(handle, 0, access=mmap.ACCESS_COPY)
            with _MAPPED_LOCK:
                _MAPPED[0] += 1
        if offset + spec.size * spec.dtype.itemsize > len(self._map):
            return None
        return np.frombuffer(self._map, dtype=spec.dtype, count=spec.size, offset=offset)

    def close(self) -> None:
        """Release the mapping and the descriptor (the file calls this as it closes)."""
        self._mapped.clear()
        self._done_bytes, self._done_span = 0, (0, 0)
        if self._fd is not None and self._fd >= 0:
            os.close(self._fd)
        self._fd = -1
        if self._map is not None:
            with contextlib.suppress(BufferError):  # arrays still view it: unmapped with them
                self._map.close()
            self._map = None
            with _MAPPED_LOCK:
                _MAPPED[0] -= 1
            self._map_address = None


_ENGINES: weakref.WeakKeyDictionary[WeightFile, FileReads] = weakref.WeakKeyDictionary()
_ENGINES_LOCK = threading.Lock()


def reads_of(file: WeightFile, settings: ReadSettings | None = None) -> FileReads:
    """``file``'s engine, made on first use with ``settings`` (default: `ReadSettings()`,
    mapping on) and kept until the file closes; a later call's settings do not change it."""
    engine = _ENGINES.get(file)
    if engine is not None:
        return engine
    with _ENGINES_LOCK:
        engine = _ENGINES.get(file)
        if engine is None:
            engine = _ENGINES[file] = FileReads(file, settings or ReadSettings())
            file.on_close(engine.close)
            file.on_close(lambda: _ENGINES.pop(file, None))
        return engine
