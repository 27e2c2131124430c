"""`Update`: what a hospital ships after local training, and nothing more.

An update is an ordered set of named float arrays (the model's parameters, named by their
torch ``state_dict`` keys), the number of training rows they were fitted on, and scalar
metrics. No rows, labels or IDs. Aggregation reads updates through the small
`UpdateSource` interface, which both in-memory `Update` objects and open weight files
(`protocol.weights.WeightFile`) implement, so strategies can stream parameters one at a
time instead of holding every update in memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from protocol.arrays import ArraySpec, check_arrays, check_num_examples, specs_of
from protocol.errors import UpdateError

if TYPE_CHECKING:  # heavy optional imports, only for type checkers
    import torch
    from flwr.app import ArrayRecord


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
        from flwr.app import Array, ArrayRecord

        return ArrayRecord({name: Array(np.ascontiguousarray(a)) for name, a in self.arrays.items()})

    @classmethod
    def from_array_record(
        cls, record: ArrayRecord, *, num_examples: int, **fields: Any
    ) -> Update:
        """Build an update from a Flower `ArrayRecord` and the site's sample count."""
        return cls(
            arrays={name: arr.numpy() for name, arr in record.items()},
            num_examples=num_examples,
            **fields,
        )

    def to_state_dict(self) -> dict[str, torch.Tensor]:
        """Return the parameters as a torch ``state_dict`` (CPU tensors)."""
        import torch

        return {name: torch.from_numpy(np.array(a, copy=True)) for name, a in self.arrays.items()}

    @classmethod
    def from_state_dict(
        cls, state_dict: Mapping[str, torch.Tensor], *, num_examples: int, **fields: Any
    ) -> Update:
        """Build an update from a torch ``state_dict`` and the site's sample count."""
        arrays = {}
        for name, tensor in state_dict.items():
            arrays[name] = tensor.detach().cpu().numpy().copy()
        return cls(arrays=arrays, num_examples=num_examples, **fields)
