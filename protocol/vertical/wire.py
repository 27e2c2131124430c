"""What crosses the network in vertical training, and the only shapes it may take.

Every vertical message is a `Payload`: a few scalar settings and named arrays. `ALLOWED` lists,
per message type and direction, the array names that may appear; `check_payload` enforces it
on both ends, so a bug that tried to ship raw columns, labels or IDs fails loudly instead of
leaking. PSI points are opaque 33-byte elliptic-curve points (see `protocol.vertical.psi`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fedsplit.protocol.errors import ConfigError

POINT_BYTES = 33

# message type -> (array names the coordinator may send, array names a site may reply with)
ALLOWED: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "query.psi_start": (frozenset({"points"}), frozenset({"points", "answer"})),
    "query.psi_finish": (frozenset({"mine", "theirs"}), frozenset()),
    "query.prepare": (frozenset({"train-positions"}), frozenset()),
    "train.step": (frozenset({"grad-positions", "gradients", "positions"}), frozenset({"embeddings"})),
    "query.embed": (frozenset({"positions"}), frozenset({"embeddings"})),
    "query.save": (frozenset(), frozenset()),
}
ALLOWED_CONFIG: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "query.psi_start": (frozenset(), frozenset({"rows", "site"})),
    "query.psi_finish": (frozenset(), frozenset({"shared"})),
    "query.prepare": (frozenset({"embedding-dim", "branch-hidden", "lr", "seed"}),
                      frozenset({"input-width"})),
    "train.step": (frozenset(), frozenset()),
    "query.embed": (frozenset(), frozenset()),
    "query.save": (frozenset({"tag", "slot"}), frozenset({"saved"})),
}


@dataclass
class Payload:
    """Scalars and named arrays of one vertical message."""

    config: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)

    def nbytes(self) -> int:
        """Bytes of array data."""
        return int(sum(a.nbytes for a in self.arrays.values()))


def check_payload(message_type: str, payload: Payload, *, reply: bool) -> None:
    """Refuse any array or setting not listed for this message type and direction."""
    if message_type not in ALLOWED:
        raise ConfigError(f"Unknown vertical message type; expected one of {', '.join(ALLOWED)}. "
                          f"Received: {message_type!r}")
    arrays = ALLOWED[message_type][int(reply)]
    config = ALLOWED_CONFIG[message_type][int(reply)]
    extra = sorted(set(payload.arrays) - arrays) + sorted(set(payload.config) - config)
    if extra:
        side = "reply to" if reply else "request of"
        raise ConfigError(
            f"A vertical {side} {message_type} may carry only {sorted(arrays | config)}; anything "
            f"else could leak rows, labels or IDs. Received: {extra}"
        )


def c_order(array: np.ndarray) -> np.ndarray:
    """``array`` C-contiguous, shape kept (``np.ascontiguousarray`` turns 0-d arrays into shape (1,))."""
    return np.require(array, requirements="C")


def to_record(payload: Payload) -> Any:
    """A Flower RecordDict with one ConfigRecord and one ArrayRecord."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

    return RecordDict({
        "config": ConfigRecord(dict(payload.config)),
        "arrays": ArrayRecord({k: Array(c_order(v)) for k, v in payload.arrays.items()}),
    })


def from_record(record: Any) -> Payload:
    """Inverse of `to_record`."""
    config = dict(record.config_records["config"]) if "config" in record.config_records else {}
    arrays: dict[str, np.ndarray] = {}
    if "arrays" in record.array_records:
        arrays = {k: v.numpy() for k, v in record.array_records["arrays"].items()}
    return Payload(config=config, arrays=arrays)


def pack_points(points: Sequence[bytes]) -> np.ndarray:
    """PSI points as an (n, 33) uint8 array."""
    if not points:
        return np.zeros((0, POINT_BYTES), dtype=np.uint8)
    return np.frombuffer(b"".join(points), dtype=np.uint8).reshape(len(points), POINT_BYTES).copy()


def unpack_points(array: np.ndarray) -> list[bytes]:
    """Inverse of `pack_points`."""
    array = np.require(array, dtype=np.uint8, requirements="C")
    return [bytes(row) for row in array.reshape(-1, POINT_BYTES)]
