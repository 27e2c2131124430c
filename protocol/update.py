"""`Update`: what a hospital ships after local training, and nothing more.

An update is an ordered set of named float arrays (the model's parameters, named by their
torch ``state_dict`` keys), the number of training rows they were fitted on, and scalar
metrics. No rows, labels or IDs. Aggregation reads updates through the small
`UpdateSource` interface, which both in-memory `Update` objects and open weight files
(`protocol.weights.WeightFile`) implement, so strategies can stream parameters one at a
time instead of holding every update in memory.

Integer buffers on the wire. Updates, weight files and every Flower record carry float16/32/64
only (`protocol.arrays.ALLOWED_DTYPES`). A torch model also has integer buffers (BatchNorm's
0-d int64 ``num_batches_tracked``): `state_dict_arrays`, the one torch -> numpy conversion
every path uses (`Update.from_state_dict`, the hospital agent's initial model and replies),
carries them as float64, which is exact below 2**53, and `arrays_to_state_dict` given the
model's own ``state_dict`` turns them back into the model's dtype (rounded to the nearest
integer: an averaged counter such as 3.5 batches loads as 4). The initial model, every reply
and every global model therefore share one layout, so the coordinator's expected layout
matches every honest reply. Shapes are kept exactly, 0-d included (`c_contiguous`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
from fedsplit.protocol.arrays import ArraySpec, check_arrays, check_num_examples, specs_of
from fedsplit.protocol.errors import UpdateError

if TYPE_CHECKING:  # heavy optional imports, only for type checkers
    import torch
    from flwr.app import Array, ArrayRecord


#: Largest integer a float64 carries exactly; integer buffers beyond it are refused.
EXACT_INT_LIMIT = 2**53


def c_contiguous(array: Any) -> np.ndarray:
    """``array`` as a C-contiguous numpy array of the same shape (0-d stays 0-d, no copy if already)."""
    arr = np.asarray(array)
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def state_dict_arrays(state_dict: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """A torch ``state_dict`` as named numpy arrays in wire form (copies, shapes kept).

    Float tensors keep their dtype; integer and bool buffers (BatchNorm's
    ``num_batches_tracked``) become float64, exact below 2**53 (larger values are refused).
    """
    import torch

    arrays: dict[str, np.ndarray] = {}
    for name, tensor in state_dict.items():
        t = tensor.detach().cpu()
        if t.dtype == torch.bfloat16:
            t = t.float()
        if t.is_floating_point():
            arrays[name] = t.numpy().copy()
            continue
        values = t.numpy()
        if values.size and int(np.abs(values.astype(np.int64)).max()) >= EXACT_INT_LIMIT:
            raise UpdateError(
                f"Integer buffer {name!r} holds a value of 2**53 or more, which float64 (the "
                f"wire type of integer buffers) cannot carry exactly. Reset the buffer or leave "
                f"it out of the state_dict. Received: max |value| "
                f"{int(np.abs(values.astype(np.int64)).max())}",
                reason="dtype",
            )
        arrays[name] = values.astype(np.float64)
    return arrays


def arrays_to_state_dict(
    arrays: Mapping[str, np.ndarray], like: Mapping[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Named numpy arrays as a torch ``state_dict`` (CPU tensors, shapes kept).

    With ``like`` (the receiving model's ``state_dict``), each tensor takes the dtype of the
    model's tensor of the same name: integer buffers sent as float64 are rounded back to
    integers. Names missing from ``like`` keep their own dtype (``load_state_dict`` names them).
    """
    import torch

    out: dict[str, torch.Tensor] = {}
    for name, a in arrays.items():
        tensor = torch.from_numpy(np.array(a, copy=True))
        target = like.get(name) if like is not None else None
        if target is not None and target.dtype != tensor.dtype:
            if not target.is_floating_point() and tensor.is_floating_point():
                tensor = torch.round(tensor)
            tensor = tensor.to(target.dtype)
        out[name] = tensor
    return out


def npy_header(data: Any) -> tuple[tuple[int, ...], bool, np.dtype, int] | None:
    """The shape, Fortran order, dtype and data offset of the ``.npy`` bytes ``data`` begins
    with (the header alone will do); None when they do not begin with a header numpy reads."""
    import io

    from numpy.lib import format as npy

    head = io.BytesIO(bytes(data[:65536]))
    try:
        read_header = (npy.read_array_header_1_0 if npy.read_magic(head) == (1, 0)
                       else npy.read_array_header_2_0)
        shape, fortran, dtype = read_header(head)
    except (ValueError, EOFError):
        return None
    return tuple(int(n) for n in shape), bool(fortran), dtype, head.tell()


def npy_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised C-ordered array whose memory is the data part of a whole ``.npy``
    image, its header (the one ``np.save`` writes) already in place before it.

    Filled in place (an aggregate's output), it becomes a Flower `Array` without a copy:
    `to_array_record` finds the image (`npy_image`) and hands it over as the Array's bytes,
    where ``Array(ndarray)`` would write a second copy of the values."""
    import io

    from numpy.lib import format as npy

    dtype = np.dtype(dtype)
    shape = tuple(int(n) for n in shape)
    head = io.BytesIO()
    header = {"descr": npy.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    try:
        npy.write_array_header_1_0(head, header)
    except ValueError:  # a header over 64 KiB, as np.save falls back
        head = io.BytesIO()
        npy.write_array_header_2_0(head, header)
    offset = head.tell()
    count = int(np.prod(shape, dtype=np.int64))  # 1 for a 0-d array
    image = bytearray(offset + count * dtype.itemsize)
    image[:offset] = head.getvalue()
    return np.frombuffer(image, dtype=dtype, count=count, offset=offset).reshape(shape)


def npy_image(array: np.ndarray) -> bytearray | None:
    """The whole ``.npy`` image ``array`` is the data of (from `npy_empty`), or None when it
    is not exactly that (another array, a slice, a view of another shape or dtype)."""
    owner: Any = array
    while isinstance(owner, np.ndarray):
        owner = owner.base
    if isinstance(owner, memoryview):
        owner = owner.obj
    if not isinstance(owner, bytearray) or not array.flags.c_contiguous:
        return None
    header = npy_header(owner)
    if header is None:
        return None
    shape, fortran, dtype, offset = header
    if (fortran or shape != tuple(array.shape) or dtype != array.dtype
            or len(owner) != offset + array.nbytes):
        return None
    start = np.frombuffer(owner, dtype=np.uint8, count=0).__array_interface__["data"][0]
    return owner if array.__array_interface__["data"][0] == start + offset else None


def array_view(array: Array) -> np.ndarray:
    """A Flower `Array`'s values as a read-only numpy view over its bytes (no copy).

    Flower's ``Array.numpy()`` loads its ``.npy`` bytes into a new array, so a model held both
    ways costs twice its size; the view shares the bytes (and keeps them alive). An array that
    is not a plain ``.npy`` (another ``stype``, object dtype, Fortran order) is loaded as Flower
    loads it."""
    if array.stype != "numpy.ndarray":
        return array.numpy()
    header = npy_header(array.data)
    if header is None:
        return array.numpy()
    shape, fortran, dtype, offset = header
    if fortran or dtype.hasobject:
        return array.numpy()
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    view = np.frombuffer(array.data, dtype=dtype, count=count, offset=offset)
    view.flags.writeable = False  # read-only over a bytearray too (an `npy_empty` image)
    return view.reshape(shape)


def to_array_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """Named numpy arrays as a Flower `ArrayRecord` (same names, order, shapes, dtypes)."""
    from flwr.app import ArrayRecord

    record = ArrayRecord()  # filled item by item: ArrayRecord(dict) would rebuild each Array
    for name, a in arrays.items():
        record[name] = _flower_array(a)
    return record


def _flower_array(values: Any) -> Array:
    """``values`` as a Flower `Array`: over its own ``.npy`` image when it has one
    (`npy_empty`: no copy), else as ``Array(ndarray)`` writes it."""
    from flwr.app import Array

    arr = c_contiguous(values)
    image = npy_image(arr)
    if image is None:
        return Array(arr)
    array = Array(dtype=str(arr.dtype), shape=tuple(int(n) for n in arr.shape),
                  stype="numpy.ndarray", data=b"")
    array.data = image  # the same bytes Array(arr) would hold, without writing them again
    arr.flags.writeable = False  # now the record's bytes: a later write would change them
    return array


@dataclass(frozen=True)
class UpdateHeader:
    """Everything about an update except its parameter values."""

    num_examples: int
    specs: tuple[ArraySpec, ...]
    site: str | None = None
    round: int | None = None
    model: str | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """Parameter names in model order."""
        return tuple(s.name for s in self.specs)

    @property
    def nbytes(self) -> int:
        """Bytes of all parameters in memory."""
        return sum(s.nbytes for s in self.specs)

    @property
    def label(self) -> str:
        """A name for reports: the site, or ``"?"``."""
        return self.site if self.site else "?"


@runtime_checkable
class UpdateSource(Protocol):
    """Read access to one update: its header, then one parameter at a time."""

    @property
    def header(self) -> UpdateHeader:
        """Counts, names, shapes and dtypes."""
        ...

    def array(self, name: str) -> np.ndarray:
        """Return the parameter called ``name`` (validated: float, finite)."""
        ...


@dataclass
class Update:
    """One site's trained parameters, its sample count and scalar metrics.

    Parameters
    ----------
    arrays : Mapping[str, numpy.ndarray]
        Parameters in model order, keyed by their torch ``state_dict`` names. Float16/32/64
        and finite, checked on construction.
    num_examples : int
        Number of training rows behind these weights (>= 1); FedAvg's weight.
    site : str | None (default: None)
        Who trained it, for reports.
    round : int | None (default: None)
        The federation round it answers.
    model : str | None (default: None)
        Architecture id (``client.models.ModelSpec.to_id()``), so a reader can rebuild the model.
    metrics : Mapping[str, float] (default: {})
        Scalar training metrics (loss, accuracy, ...).
    """

    arrays: dict[str, np.ndarray]
    num_examples: int
    site: str | None = None
    round: int | None = None
    model: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.arrays = check_arrays(self.arrays)
        self.num_examples = check_num_examples(self.num_examples)
        for key, value in self.metrics.items():
            if isinstance(value, bool) or not isinstance(value, int | float | np.number):
                raise UpdateError(
                    f"Update metrics must be scalar numbers; {key!r} is not. Send strings as "
                    f"configuration, not metrics. Received: {key}={value!r}"
                )
        self.metrics = {k: float(v) for k, v in self.metrics.items()}

    # -- UpdateSource -----------------------------------------------------------------------
    @property
    def header(self) -> UpdateHeader:
        """Counts, names, shapes and dtypes."""
        return UpdateHeader(
            num_examples=self.num_examples,
            specs=specs_of(self.arrays),
            site=self.site,
            round=self.round,
            model=self.model,
        )

    def array(self, name: str) -> np.ndarray:
        """Return the parameter called ``name``."""
        try:
            return self.arrays[name]
        except KeyError:
            raise UpdateError(
                f"This update has no parameter {name!r}. Its parameters: "
                f"{', '.join(self.arrays)}. Received: {name!r}"
            ) from None

    # -- conversions ------------------------------------------------------------------------
    def to_array_record(self) -> ArrayRecord:
        """Return the parameters as a Flower `ArrayRecord` (same names, same order)."""
        return to_array_record(self.arrays)

    @classmethod
    def from_array_record(
        cls, record: ArrayRecord, *, num_examples: int, **fields: Any
    ) -> Update:
        """Build an update from a Flower `ArrayRecord` and the site's sample count."""
        return cls(
            arrays={name: array_view(arr) for name, arr in record.items()},
            num_examples=num_examples,
            **fields,
        )

    def to_state_dict(
        self, like: Mapping[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """Return the parameters as a torch ``state_dict`` (CPU tensors).

        Pass the receiving model's ``state_dict`` as ``like`` to get its dtypes back (integer
        buffers carried as float64 become integers again; see `arrays_to_state_dict`).
        """
        return arrays_to_state_dict(self.arrays, like)

    @classmethod
    def from_state_dict(
        cls, state_dict: Mapping[str, torch.Tensor], *, num_examples: int, **fields: Any
    ) -> Update:
        """Build an update from a torch ``state_dict`` and the site's sample count.

        Integer buffers become float64 (see `state_dict_arrays`).
        """
        return cls(arrays=state_dict_arrays(state_dict), num_examples=num_examples, **fields)
