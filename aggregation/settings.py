"""How an aggregation's passes run: `BackendSettings`, built once where a command or a service
starts and passed in (as httpx takes a transport); its `BackendSettings.select` is the one place
the technology of a pass is chosen. The operations themselves are `aggregation.backend`'s."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from fedsplit.aggregation import _compiled, _device
from fedsplit.aggregation._blocks import base
from fedsplit.aggregation._filereads import ReadSettings, reads_of
from fedsplit.aggregation._interface import OPERATIONS, STACKED, Backend
from fedsplit.aggregation._reference import NumpyBackend
from fedsplit.aggregation._threads import cpu_threads, worker_count
from fedsplit.aggregation.errors import AggregationError
from fedsplit.protocol.update import UpdateSource
from fedsplit.protocol.weights import WeightFile

#: The environment variable that names the backend (see `BackendSettings.select`).
ENV = "FEDSPLIT_AGG_BACKEND"
MODES = ("auto", "numpy", "compiled", "gpu")
#: The variable ``FEDSPLIT_AGG_BACKEND`` replaces (still read, with a warning, when it is unset).
OLD_ENV = "FEDSPLIT_AGG_KERNELS"

#: ``auto`` sends a pass to the GPU, and a stacked pass to the numba kernels, from this many
#: values read (N x coordinates); smaller passes stay in numpy.
COMPILED_FROM = 1 << 20
#: Stacked operations ``auto`` leaves to numpy at any size (see `BackendSettings.select`).
NUMPY_UNDER_AUTO = ("gram",)


def _mode_from(env: Mapping[str, str]) -> str:
    """``FEDSPLIT_AGG_BACKEND`` (or, unset, the variable it replaces, with a warning)."""
    raw = env.get(ENV, "").strip().lower()
    if not raw and env.get(OLD_ENV, "").strip():
        old = env[OLD_ENV].strip().lower()
        _warn_old(old)
        raw = "compiled" if old == "numba" else old
        if raw not in ("auto", "numpy", "compiled"):
            raise AggregationError(
                f"{OLD_ENV} (replaced by {ENV}) is 'auto', 'compiled' ('numba' is the same) or "
                f"'numpy'. Set {ENV} instead. Received: {OLD_ENV}={old!r}"
            )
    return raw or "auto"


@functools.cache
def _warn_old(value: str) -> None:
    warnings.warn(
        f"{OLD_ENV} is deprecated: set {ENV}={'compiled' if value == 'numba' else value} "
        f"instead (auto, numpy, compiled or gpu).",
        FutureWarning,
        stacklevel=5,
    )


@dataclass(frozen=True)
class BackendSettings:
    """Which technology runs an aggregation's passes, fixed before the first one: built once at
    start-up and passed in (``aggregate_updates(..., settings=...)``, as httpx takes a
    transport). Nothing reads the environment during a pass.

    Attributes
    ----------
    mode : {"auto", "numpy", "compiled", "gpu"} (default: "auto")
        The policy of `select` (``FEDSPLIT_AGG_BACKEND``).
    device : {"auto", "cpu", "cuda", "cuda:N"} or TorchDevice (default: "auto")
        Where passes may run (``fedsplit aggregate --device``): ``auto`` uses the first CUDA
        GPU, when the machine has one, for passes of at least `COMPILED_FROM` values (torch is
        imported only then); a named device takes every pass; ``cpu`` never the GPU. Resolved
        once, on the first pass.
    threads : int (default: the CPU count, at most 8)
        Worker threads of every pass (``FEDSPLIT_AGG_THREADS``).
    reads : ReadSettings (default: mapping on)
        How weight files are read (``FEDSPLIT_MMAP=0``: through HDF5 only; `_filereads`).
    """

    mode: str = "auto"
    device: str | _device.TorchDevice = "auto"
    threads: int = field(default_factory=cpu_threads)
    reads: ReadSettings = field(default_factory=ReadSettings)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise AggregationError(
                f"{ENV} is 'auto' (the GPU, the compiled kernels or numpy, where each pays), "
                f"'numpy' (the reference code), 'compiled' (the C and numba kernels for every "
                f"pass) or 'gpu' (every pass on a CUDA GPU). Received: {self.mode!r}"
            )
        if not isinstance(self.device, _device.TorchDevice):
            _device.check_spec(self.device)
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise AggregationError(
                f"An aggregation's worker threads are a whole number >= 1. "
                f"Received: {self.threads!r}"
            )

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], *,
                     device: str | _device.TorchDevice = "auto") -> BackendSettings:
        """The settings ``environ`` names (``FEDSPLIT_AGG_BACKEND``, the deprecated
        ``FEDSPLIT_AGG_KERNELS``, ``FEDSPLIT_AGG_THREADS``, ``FEDSPLIT_MMAP``), with ``device``
        (the command's ``--device``): what a command or a service builds once when it starts,
        from the process's environment (``os.environ``, read there and nowhere else)."""
        return cls(mode=_mode_from(environ), device=device, threads=worker_count(environ),
                   reads=ReadSettings.from_environ(environ))

    def prepare_reads(self, updates: Iterable[UpdateSource]) -> None:
        """Make the read engine of each weight file among ``updates`` with `reads` (a file
        already read keeps its engine)."""
        for update in updates:
            source = base(update)
            if isinstance(source, WeightFile):
                reads_of(source, self.reads)

    @functools.cached_property
    def _choice(self) -> _device.Choice:
        return _device.resolve(self.device)

    def select(self, operation: str, values: int) -> Backend:
        """The backend that runs ``operation`` for one whole pass over ``values`` values (N x
        coordinates): the one place the technology is chosen. The policy:

        1. **GPU.** ``mode`` ``gpu``: every pass on the settings' CUDA device (``device``
           ``cuda``/``cuda:N``; ``auto``: the current one); an error when torch sees no GPU or
           ``device`` is ``cpu``. Under any other mode, a device named (``cuda``, ``cuda:N``)
           takes every pass, and ``auto`` (the first CUDA GPU, found without importing torch
           where there is no NVIDIA driver) takes the passes of at least `COMPILED_FROM` values
           when the mode is ``auto``. ``cpu`` never uses the GPU.
        2. **numpy.** ``FEDSPLIT_AGG_BACKEND=numpy``: the numpy reference for every pass the GPU
           does not take.
        3. **compiled.** ``FEDSPLIT_AGG_BACKEND=compiled``: the compiled kernels for every such
           pass, whatever its size; an error naming the reason when the operation's kernels are
           missing here (no C compiler for ``weighted_sum`` and ``squared_distances``, numba not
           installed for the four stacked operations).
        4. **auto** (the default): ``weighted_sum`` and ``squared_distances`` run the C kernels
           whenever they could be built on this machine (they load in about a millisecond); the
           sorting operations (``trimmed_mean``, ``weighted_median``, ``weighted_trimmed_mean``)
           run numba's kernels from `COMPILED_FROM` values when numba is installed (importing
           numba and loading its cached kernels takes about 0.2-0.4 s, which smaller passes do not
           win back); everything else runs numpy, ``gram`` always: its work is BLAS's tile product
           either way, numba would only centre the tiles, and its start-up is not won back
           (``fedsplit aggregate`` of Krum over 30 files x 10M, best of 5: 1.77 s in numpy, 2.20 s
           with numba's kernels; multi-Krum 1.89 s and 2.36 s).

        Inside the compiled backend, a block it has no kernel for runs the numpy reference: float16
        parameters, a stacked block whose output dtype differs from its values', a weight file's
        parameter stored in another form (compressed, big-endian), and the whole weighted sum when
        the memory budget cannot hold its per-thread read buffers.

        Two compiled technologies, for this reason: the streamed operations read every value once
        and do little arithmetic on it, so they are bound by memory and a kernel saves about half
        the pass, less than numba's start-up on any model that fits in memory (``fedsplit
        aggregate`` of FedAvg over 30 files x 10M: 1.4 s of CPU in numpy, 2.05 s with numba's
        kernels loaded for it), while a few lines of C load in a millisecond and read the weight
        files themselves. The stacked operations are sorting networks and tile gathers, compute
        bound, where numba's kernels pay for their start-up from `COMPILED_FROM` values; they are
        not written in C.
        """
        if operation not in OPERATIONS:
            raise ValueError(f"operation is one of {', '.join(OPERATIONS)}. "
                             f"Received: {operation!r}")
        gpu = _device.gpu_for(self.mode, self._choice, values, COMPILED_FROM)
        if gpu is not None:
            return _device.GpuBackend(gpu, self.threads)
        if self.mode == "numpy" or (self.mode == "auto" and operation in STACKED
                                    and (values < COMPILED_FROM or operation in NUMPY_UNDER_AUTO)):
            return NumpyBackend(self.threads)
        missing = _compiled.missing(operation)
        if missing is None:
            return _compiled.CompiledBackend(self.threads)
        if self.mode == "compiled":
            raise AggregationError(
                f"{ENV}=compiled asks for the compiled kernels, but {missing} Or set {ENV}=auto "
                f"(numpy where they are missing). Received: {ENV}=compiled"
            )
        return NumpyBackend(self.threads)



#: The library's defaults (no environment read): what a rule's `aggregate` uses when it is
#: called directly without settings.
DEFAULT_SETTINGS = BackendSettings()
