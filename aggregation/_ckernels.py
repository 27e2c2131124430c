"""The compiled backend's C kernels (``weighted_sum``, ``squared_distances``), built with cffi.

FedAvg's weighted sum and the distance pass read every value once and do little arithmetic
on it: they are bound by memory, and what a compiled kernel saves there (about half the pass:
one fused loop instead of several numpy calls, each re-reading its block) is smaller than
numba's start-up (about 0.2 s to import numba and load cached kernels). So these two kernels
are a few lines of C compiled by cffi, loaded as a plain extension module in about a
millisecond, which releases the GIL on every call (the aggregation's worker threads run
them side by side). The order statistics and Krum's tiles stay in numba
(`aggregation._numba_kernels`): their start-up pays for itself on the passes they serve. The
compiled backend (`aggregation._compiled`) is the only caller.

Kernels (the same arithmetic as the numpy reference in `aggregation._reference`):

- `StreamedKernels.weighted_sum` (a worker's prepared `WeightedSum` calls): one block of the
  weighted mean over N updates per call. Each update is taken where it lies (an in-memory
  update's own memory) or read by the call itself from its weight file (one ``pread`` per
  update and sub-block of `_compiled.file_block` values into a row buffer that stays in the core's
  cache). Products are rounded to the working precision before they are added (compiled
  without contraction into fused multiply-adds), in groups of ``group`` updates whose sums
  are added in float64 (float32 models), or one float64 sum (float64 models): the result is
  bit for bit the numpy reference's. With ``dist2``, each update's squared distance to the
  finished mean is added in the same call, tile by tile (2048 coordinates: the tile's N inputs
  are still in the core's cache when they are re-read).
- `StreamedKernels.squared_distance`: ``sum((x - ref)**2)``, differences in the input
  precision, squares summed in float64 over eight interleaved partial sums (the numpy
  reference sums float32 squares with BLAS's dot).

Building: ``python -m fedsplit.aggregation._ckernels`` (``make setup`` runs it), or the first pass that
wants the kernels, builds them in a subprocess (cffi and the machine's C compiler, about a
second) into the first writable of the package's ``__pycache__`` and the user's cache
(``$XDG_CACHE_HOME/fedsplit/kernels``, default ``~/.cache/fedsplit/kernels``), named by a hash
of the source and flags, so a changed source is rebuilt and never loaded stale; the module is
moved into place by rename, so a concurrent process never loads half a file
(``FEDSPLIT_KERNEL_DIR`` names one directory instead of both); builds of older sources are
removed. An AVX2 clone of each kernel is chosen when the module loads where the CPU has it
(the same bits as the baseline clone). Where no C
compiler (or no Python headers) is found, the reason is recorded beside it and the passes
stay in numpy (``FEDSPLIT_AGG_BACKEND=compiled`` then fails and names the reason; running
``python -m fedsplit.aggregation._ckernels`` tries again).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

import numpy as np

#: The kernels' C source. ``addr`` holds the address of each update's block (int64).
SOURCE = r"""
#include <errno.h>
#include <stdint.h>
#include <sys/types.h>
#include <unistd.h>

#define TILE 2048

/* One machine-code clone per instruction set, chosen when the module loads (glibc's ifunc):
   AVX2 where the CPU has it, else the x86-64 baseline. No FMA either way (-ffp-contract=off
   and no "fma" target), and no reassociation, so every clone computes the same bits. */
#if defined(__x86_64__) && defined(__GNUC__) && defined(__GLIBC__)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif
#if defined(__GNUC__)
#define INLINE static inline __attribute__((always_inline))
#else
#define INLINE static inline
#endif

INLINE double sq_f32(const float *x, const float *ref, int64_t n) {
    double a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; l++) {
            double d = (double)(float)(x[j + l] - ref[j + l]);
            a[l] += d * d;
        }
    for (; j < n; j++) {
        double d = (double)(float)(x[j] - ref[j]);
        a[0] += d * d;
    }
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

INLINE double sq_f64(const double *x, const double *ref, int64_t n) {
    double a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; l++) {
            double d = x[j + l] - ref[j + l];
            a[l] += d * d;
        }
    for (; j < n; j++) {
        double d = x[j] - ref[j];
        a[0] += d * d;
    }
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

CLONES double fs_squared_distance_f32(const float *x, const float *ref, int64_t n) {
    return sq_f32(x, ref, n);
}

CLONES double fs_squared_distance_f64(const double *x, const double *ref, int64_t n) {
    return sq_f64(x, ref, n);
}

/* Point ptr[k] at values [s, s + m) of update k: src[k] is the address of its block's first
   value when fd[k] < 0, else the byte offset of that value in file fd[k], and the values are
   read (pread, whole, retried on EINTR) into row k of rows (m values each). Returns -1, or
   the index of the update whose read failed, with err[0] = errno (0: the file ended early)
   and err[1] = bytes read. */
static int64_t place_rows(const int64_t *src, const int64_t *fd, int64_t n, int64_t s,
                          int64_t m, int64_t itemsize, char *rows, int64_t *ptr, int64_t *err) {
    int64_t bytes = m * itemsize;
    for (int64_t k = 0; k < n; k++) {
        if (fd[k] < 0) {
            ptr[k] = src[k] + s * itemsize;
            continue;
        }
        char *dst = rows + k * bytes;
        int64_t got = 0;
        while (got < bytes) {
            ssize_t r = pread((int)fd[k], dst + got, (size_t)(bytes - got),
                              (off_t)(src[k] + s * itemsize + got));
            if (r < 0 && errno == EINTR)
                continue;
            if (r <= 0) {
                err[0] = r < 0 ? errno : 0;
                err[1] = got;
                return k;
            }
            got += r;
        }
        ptr[k] = (int64_t)(intptr_t)dst;
    }
    return -1;
}

/* The weighted sum of one block of `size` values, `sub` values at a time: each update's
   sub-block is placed (read from its file into `rows`, n x sub values, which stay in the
   core's cache; or taken where it lies), then summed tile by tile, and with dist2 each
   update's squared distance to the finished tile added. */
CLONES int64_t fs_weighted_sum_f32(const int64_t *src, const int64_t *fd, int64_t n,
                                   int64_t size, int64_t sub, const float *share,
                                   int64_t group, float *out, double *dist2, float *rows,
                                   int64_t *ptr, int64_t *err) {
    float g[TILE];
    double total[TILE];
    int single = n <= group;
    for (int64_t s0 = 0; s0 < size; s0 += sub) {
        int64_t mm = size - s0 < sub ? size - s0 : sub;
        int64_t failed = place_rows(src, fd, n, s0, mm, sizeof(float), (char *)rows, ptr, err);
        if (failed >= 0)
            return failed;
        float *o = out + s0;
        for (int64_t s = 0; s < mm; s += TILE) {
            int64_t m = mm - s < TILE ? mm - s : TILE;
            for (int64_t first = 0; first < n; first += group) {
                int64_t last = first + group < n ? first + group : n;
                const float *x = (const float *)(intptr_t)ptr[first] + s;
                float w = share[first];
                for (int64_t j = 0; j < m; j++) g[j] = x[j] * w;
                for (int64_t k = first + 1; k < last; k++) {
                    const float *y = (const float *)(intptr_t)ptr[k] + s;
                    float wk = share[k];
                    for (int64_t j = 0; j < m; j++) {
                        float p = y[j] * wk;
                        g[j] = g[j] + p;
                    }
                }
                if (single)
                    for (int64_t j = 0; j < m; j++) o[s + j] = g[j];
                else if (first == 0)
                    for (int64_t j = 0; j < m; j++) total[j] = (double)g[j];
                else
                    for (int64_t j = 0; j < m; j++) total[j] = total[j] + (double)g[j];
            }
            if (!single)
                for (int64_t j = 0; j < m; j++) o[s + j] = (float)total[j];
            if (dist2)
                for (int64_t k = 0; k < n; k++)
                    dist2[k] += sq_f32((const float *)(intptr_t)ptr[k] + s, o + s, m);
        }
    }
    return -1;
}

CLONES int64_t fs_weighted_sum_f64(const int64_t *src, const int64_t *fd, int64_t n,
                                   int64_t size, int64_t sub, const double *share,
                                   double *out, double *dist2, double *rows, int64_t *ptr,
                                   int64_t *err) {
    for (int64_t s0 = 0; s0 < size; s0 += sub) {
        int64_t mm = size - s0 < sub ? size - s0 : sub;
        int64_t failed = place_rows(src, fd, n, s0, mm, sizeof(double), (char *)rows, ptr, err);
        if (failed >= 0)
            return failed;
        for (int64_t s = 0; s < mm; s += TILE) {
            int64_t m = mm - s < TILE ? mm - s : TILE;
            double *o = out + s0 + s;
            const double *x = (const double *)(intptr_t)ptr[0] + s;
            double w = share[0];
            for (int64_t j = 0; j < m; j++) o[j] = x[j] * w;
            for (int64_t k = 1; k < n; k++) {
                const double *y = (const double *)(intptr_t)ptr[k] + s;
                double wk = share[k];
                for (int64_t j = 0; j < m; j++) {
                    double p = y[j] * wk;
                    o[j] = o[j] + p;
                }
            }
            if (dist2)
                for (int64_t k = 0; k < n; k++)
                    dist2[k] += sq_f64((const double *)(intptr_t)ptr[k] + s, o, m);
        }
    }
    return -1;
}
"""

CDEF = """
double fs_squared_distance_f32(const float *x, const float *ref, int64_t n);
double fs_squared_distance_f64(const double *x, const double *ref, int64_t n);
int64_t fs_weighted_sum_f32(const int64_t *src, const int64_t *fd, int64_t n, int64_t size,
                            int64_t sub, const float *share, int64_t group, float *out,
                            double *dist2, float *rows, int64_t *ptr, int64_t *err);
int64_t fs_weighted_sum_f64(const int64_t *src, const int64_t *fd, int64_t n, int64_t size,
                            int64_t sub, const double *share, double *out, double *dist2,
                            double *rows, int64_t *ptr, int64_t *err);
"""

#: -ffp-contract=off: a product is rounded before it is added, as numpy does (no fused
#: multiply-add), so the weighted sum is the reference's bit for bit.
FLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math")

#: Coordinates a fused call handles at a time (must match ``TILE`` in `SOURCE`).
TILE = 2048

#: The extension module's name: the source's hash, so a changed source is never loaded stale.
MODULE = "_fedsplit_streamed_" + hashlib.blake2b(
    "\0".join((SOURCE, CDEF, *FLAGS)).encode(), digest_size=8
).hexdigest()


def cache_dirs() -> list[Path]:
    """Where the built module is looked for, and built into (the first writable one):
    ``FEDSPLIT_KERNEL_DIR`` alone when set, else the package's ``__pycache__`` and the user's
    cache."""
    if os.environ.get("FEDSPLIT_KERNEL_DIR"):
        return [Path(os.environ["FEDSPLIT_KERNEL_DIR"])]
    user = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return [Path(__file__).resolve().parent / "__pycache__", user / "fedsplit" / "kernels"]


def _filename() -> str:
    return MODULE + importlib.machinery.EXTENSION_SUFFIXES[0]


class StreamedKernels:
    """The loaded C kernels, called with numpy arrays (the GIL is released during each call)."""

    def __init__(self, module: ModuleType, path: Path) -> None:
        self._ffi = module.ffi
        self._lib = module.lib
        #: the extension module file the kernels were loaded from
        self.path = path

    def address(self, values: np.ndarray) -> int:
        """Where a C-contiguous array's first value lies (for ``src`` of `weighted_sum`)."""
        return int(self._ffi.cast("intptr_t", self._ffi.from_buffer(values)))

    def weighted_sum(
        self,
        num_updates: int,
        dtype: np.dtype,
        sub: int,
        share: np.ndarray,
        dist2: np.ndarray | None,
        group: int,
        reads: bool,
    ) -> WeightedSum:
        """A worker's prepared weighted-mean calls over ``dtype`` (float32/64) blocks, reading
        files ``sub`` values at a time (see `WeightedSum`)."""
        return WeightedSum(self, num_updates, np.dtype(dtype), sub, share, dist2, group, reads)

    def squared_distance(self, values: np.ndarray, ref: np.ndarray) -> float:
        """``sum((values - ref)**2)`` of two contiguous 1-D arrays of one dtype (float32/64)."""
        ffi, lib = self._ffi, self._lib
        if values.dtype == np.float32:
            return float(lib.fs_squared_distance_f32(
                ffi.from_buffer("float[]", values), ffi.from_buffer("float[]", ref), values.size
            ))
        return float(lib.fs_squared_distance_f64(
            ffi.from_buffer("double[]", values), ffi.from_buffer("double[]", ref), values.size
        ))


class WeightedSum:
    """One worker's weighted-mean calls: its buffers, and their C pointers, made once.

    Before each call the caller fills ``src`` and ``fd`` (one entry per update): update k's
    block is at address ``src[k]`` when ``fd[k] < 0`` (memory the caller keeps alive), else at
    byte offset ``src[k]`` of the file open as descriptor ``fd[k]``, which the call reads
    itself, ``sub`` values at a time, into row k of its ``(N, sub)`` buffer (one positional
    read per update and sub-block, the GIL released; the buffer stays in the core's cache).
    A call then writes ``sum_k share[k] * x_k`` into ``out``: float32, groups of ``group``
    updates summed in float32 and the group sums in float64 (float64: one sum); with
    ``dist2``, each update's squared distance to ``out`` is added to it.
    """

    def __init__(
        self,
        kernels: StreamedKernels,
        num_updates: int,
        dtype: np.dtype,
        sub: int,
        share: np.ndarray,
        dist2: np.ndarray | None,
        group: int,
        reads: bool,
    ) -> None:
        ffi = kernels._ffi
        kind = "float" if dtype == np.float32 else "double"
        if kind == "double" and dtype != np.float64:
            raise ValueError(f"the C kernels take float32 or float64. Received: {dtype}")
        if share.dtype != dtype or share.shape != (num_updates,):
            raise ValueError(f"one {dtype} weight per update. Received: {share.dtype} "
                             f"{share.shape}")
        if sub < 1:
            raise ValueError(f"sub-blocks of at least one value. Received: {sub}")
        self.dtype = dtype
        self.sub = sub
        self.src = np.zeros(num_updates, dtype=np.int64)
        self.fd = np.full(num_updates, -1, dtype=np.int64)
        self._rows = np.empty(num_updates * sub, dtype=dtype) if reads else None
        self._err = np.zeros(2, dtype=np.int64)
        self._work = np.zeros(num_updates, dtype=np.int64)
        self._keep = (share, dist2)  # the buffers the pointers below point into
        self._kind = kind
        self._ffi = ffi
        lib = kernels._lib
        self._fn = lib.fs_weighted_sum_f32 if kind == "float" else lib.fs_weighted_sum_f64
        self._head = (ffi.from_buffer("int64_t[]", self.src), ffi.from_buffer("int64_t[]", self.fd),
                      num_updates)
        self._share = (ffi.from_buffer(f"{kind}[]", share),) + ((group,) if kind == "float" else ())
        self._tail = (
            ffi.NULL if dist2 is None else ffi.from_buffer("double[]", dist2, require_writable=True),
            ffi.NULL if self._rows is None else ffi.from_buffer(
                f"{kind}[]", self._rows, require_writable=True),
            ffi.from_buffer("int64_t[]", self._work, require_writable=True),
            ffi.from_buffer("int64_t[]", self._err, require_writable=True),
        )

    def __call__(self, out: np.ndarray) -> tuple[int, int, int] | None:
        """Sum the updates ``src``/``fd`` point at into ``out`` (contiguous, this dtype).
        Returns None, or ``(k, errno, bytes read)`` when update k's read failed (errno 0: the
        file ended early); ``out`` is then incomplete."""
        if out.dtype != self.dtype or not out.flags.c_contiguous:
            raise ValueError(f"out must be contiguous {self.dtype}. Received: {out.dtype}")
        if self._rows is None and self.fd.max(initial=-1) >= 0:
            raise ValueError("file reads need the rows: made with reads=False. Received: a fd")
        dest = self._ffi.from_buffer(f"{self._kind}[]", out, require_writable=True)
        failed = self._fn(*self._head, out.size, self.sub, *self._share, dest, *self._tail)
        return None if failed < 0 else (int(failed), int(self._err[0]), int(self._err[1]))


def _import(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _failure_note(directory: Path) -> Path:
    return directory / f"{MODULE}.failed"


def failure() -> str | None:
    """Why the kernels could not be built here (recorded by the last attempt), else None."""
    for directory in cache_dirs():
        note = _failure_note(directory)
        if note.is_file():
            return note.read_text(errors="replace").strip() or "the build failed"
    return None


_LOAD_LOCK = threading.Lock()


def load() -> StreamedKernels | None:
    """The kernels, built first if no cached build exists; None where they cannot be built
    (the reason: `failure`). Builds at most once per process and source version (threads
    asking at once wait for one build)."""
    with _LOAD_LOCK:
        return _load()


@functools.cache
def _load() -> StreamedKernels | None:
    for directory in cache_dirs():
        path = directory / _filename()
        if path.is_file():
            try:
                return StreamedKernels(_import(path), path)
            except ImportError:
                continue  # unreadable or foreign: try the next place, or rebuild
    if failure() is not None:
        return None
    built = _build_in_subprocess()
    return StreamedKernels(_import(built), built) if built is not None else None


def _build_in_subprocess() -> Path | None:
    """Build in a child process (its compiler output captured); the module's path, or None
    with the reason recorded (`failure`)."""
    import subprocess

    done = subprocess.run(
        # -c, not -m: the package imports this module first, which -m would warn about
        [sys.executable, "-c", "from fedsplit.aggregation._ckernels import main; "
         "raise SystemExit(main(['--quiet']))"],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True, text=True, check=False,
    )
    if done.returncode == 0:
        for directory in cache_dirs():
            path = directory / _filename()
            if path.is_file():
                return path
    return None


def build() -> Path:
    """Build the kernels into the first writable cache directory and return the module's path.

    Raises `RuntimeError` naming the reason when no directory is writable or the compile
    fails (no C compiler, no Python headers, cffi missing); the reason is also recorded
    (`failure`) so later processes use numpy without trying again.
    """
    import tempfile

    errors = []
    for directory in cache_dirs():
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=directory, prefix=".build-"):
                pass  # writable: a build can be moved into place here
        except OSError as e:
            errors.append(f"{directory}: {e.strerror or e}")
            continue
        _failure_note(directory).unlink(missing_ok=True)
        try:
            return _compile_into(directory)
        except Exception as e:  # any build failure means "use numpy": recorded
            reason = (
                f"the streamed kernels could not be compiled ({type(e).__name__}: {e}); "
                f"install a C compiler and Python's headers (Debian: apt-get install gcc "
                f"python3-dev), then run: python -m fedsplit.aggregation._ckernels"
            )
            _failure_note(directory).write_text(reason + "\n")
            raise RuntimeError(reason) from e
    raise RuntimeError(
        "no writable directory for the streamed kernels (" + "; ".join(errors) + "); set "
        "XDG_CACHE_HOME to a writable directory, then run: python -m fedsplit.aggregation._ckernels"
    )


def _compile_into(directory: Path) -> Path:
    import tempfile

    from cffi import FFI

    ffi = FFI()
    ffi.cdef(CDEF)
    ffi.set_source(MODULE, SOURCE, extra_compile_args=list(FLAGS))
    with tempfile.TemporaryDirectory(dir=directory, prefix=".build-") as tmp:
        built = Path(ffi.compile(tmpdir=tmp, verbose=False))
        target = directory / _filename()
        os.replace(built, target)  # atomic: a concurrent loader sees the old name or the whole file
    for stale in directory.glob("_fedsplit_streamed_*"):
        if stale.name != target.name:  # earlier sources' builds and their failure notes
            stale.unlink(missing_ok=True)
    return target


def main(argv: list[str] | None = None) -> int:
    """``python -m fedsplit.aggregation._ckernels [--quiet]``: build the kernels (again) and say where."""
    args = sys.argv[1:] if argv is None else argv
    try:
        path = build()
    except RuntimeError as e:
        print(f"fedsplit streamed kernels: not built: {e}", file=sys.stderr)
        return 1
    if "--quiet" not in args:
        print(f"fedsplit streamed kernels: built {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
