"""Private set intersection of patient IDs (ECDH / Diffie-Hellman PSI on openmined-psi).

Two parties, A (the label holder) and B (a feature site), each hold a list of IDs and want the
IDs they share, and nothing else. The elliptic-curve work is openmined-psi's commutative cipher
(P-256, hash-to-curve; the library NVIDIA FLARE's PSI uses): ``Encrypt(id) = k * H(id)`` via
``client.CreateRequest`` and ``ReEncrypt(p) = k * p`` via ``server.ProcessRequest``, with one
private key per party per pairing. No curve arithmetic is written here.

The exchange (the classic Meadows / Huberman DH-PSI; both parties learn the intersection):

1. A shuffles its IDs and sends ``k_a * H(a)`` for each; B does the same with ``k_b * H(b)``.
2. Each re-encrypts what it received and sends it back in the order received:
   A gets ``k_b * k_a * H(a)`` in its own order, B gets ``k_a * k_b * H(b)`` in its own order.
3. Each party re-encrypts the other's singly-encrypted list itself and compares the two doubly
   encrypted lists: equal points are shared IDs (the cipher commutes). An ID held by only one
   party yields a point the other cannot link to any ID without the first party's key.

Agreed order without IDs: both sides sort the shared IDs by their doubly encrypted point (the
same bytes at both ends), so "aligned row i" means the same patient at both without either
sending an ID. The work is 2 encryptions per ID per party; `encrypt` and `reencrypt` run in
batches so a party can spread them over processes (see ``bench/psi_bench.py``).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from fedsplit.protocol.errors import ConfigError

try:
    import private_set_intersection.python as _psi
except ImportError as _missing:  # an optional install: see the Makefile and docs/vertical.md
    raise ImportError(
        "Vertical ID alignment needs openmined-psi. Install it without its dependencies (its "
        "exact protobuf pin breaks Flower's gRPC stack): pip install --no-deps openmined-psi==2.0.6"
    ) from _missing

BATCH = 65_536


class PsiParty:
    """One side of one pairing: a fresh private key, encryption and re-encryption in batches."""

    def __init__(self, key: bytes | None = None) -> None:
        self._client = (_psi.client.CreateFromKey(key, True) if key is not None
                        else _psi.client.CreateWithNewKey(True))
        self.key = self._client.GetPrivateKeyBytes()
        self._server = _psi.server.CreateFromKey(self.key, True)

    def encrypt(self, ids: Sequence[str]) -> list[bytes]:
        """``k * H(id)`` for each ID, in order (33-byte compressed points)."""
        out: list[bytes] = []
        for start in range(0, len(ids), BATCH):
            chunk = [str(i) for i in ids[start:start + BATCH]]
            out.extend(self._client.CreateRequest(chunk).encrypted_elements)
        return out

    def reencrypt(self, points: Sequence[bytes]) -> list[bytes]:
        """``k * p`` for each point another party encrypted, in order."""
        out: list[bytes] = []
        for start in range(0, len(points), BATCH):
            request = _psi.Request()
            request.reveal_intersection = True
            request.encrypted_elements.extend(points[start:start + BATCH])
            out.extend(self._server.ProcessRequest(request).encrypted_elements)
        return out


def match(mine_double: Sequence[bytes], theirs_double: Sequence[bytes]) -> list[int]:
    """Indices into ``mine_double`` whose point also occurs in ``theirs_double``."""
    theirs = set(theirs_double)
    return [i for i, p in enumerate(mine_double) if p in theirs]


@dataclass
class Alignment:
    """One party's view of a pairing: its shared rows, in the agreed order."""

    rows: list[int]  # local row numbers of the shared IDs, in agreed order
    own_size: int
    other_size: int

    @property
    def size(self) -> int:
        """Number of shared IDs."""
        return len(self.rows)


def shuffled(n: int) -> list[int]:
    """A uniformly random permutation of range(n) from the OS's CSPRNG.

    Each party encrypts its IDs in this order so positions in its lists say nothing (a sorted
    ID list would leak each shared ID's rank among the party's IDs).
    """
    order = list(range(n))
    for i in range(n - 1, 0, -1):
        j = secrets.randbelow(i + 1)
        order[i], order[j] = order[j], order[i]
    return order


class PsiSession:
    """One party's state through the three steps of a pairing (see the module docstring)."""

    def __init__(self, ids: Sequence[str], key: bytes | None = None) -> None:
        duplicates = len(ids) - len(set(ids))
        if duplicates:
            raise ConfigError(
                f"The ID column must identify each row once; {duplicates} ID(s) repeat. Remove or "
                f"merge the duplicate rows first. Received: {len(ids)} rows, {len(set(ids))} distinct IDs"
            )
        self.party: PsiParty | None = PsiParty(key)
        self.order = shuffled(len(ids))
        self._ids = [str(ids[i]) for i in self.order]

    @classmethod
    def resume(cls, ids: Sequence[str], order: Sequence[int]) -> PsiSession:
        """A session at step 3 after a restart: same shuffle, key no longer needed.

        `finish` then needs ``theirs_double`` (the other party's points as re-encrypted by this
        party in step 2, which the coordinator sends back).
        """
        session = cls.__new__(cls)
        session.party = None
        session.order = [int(i) for i in order]
        session._ids = [str(ids[i]) for i in session.order]
        return session

    def outgoing(self) -> list[bytes]:
        """Step 1: my IDs, shuffled and encrypted with my key."""
        assert self.party is not None, "a resumed session cannot encrypt"
        return self.party.encrypt(self._ids)

    def answer(self, theirs_single: Sequence[bytes]) -> list[bytes]:
        """Step 2: the other party's points re-encrypted with my key, in their order."""
        assert self.party is not None, "a resumed session cannot encrypt"
        return self.party.reencrypt(theirs_single)

    def finish(self, mine_double: Sequence[bytes], theirs_single: Sequence[bytes],
               theirs_double: Sequence[bytes] | None = None) -> tuple[Alignment, list[bytes]]:
        """Step 3: my shared rows in agreed order, and the doubly encrypted points in that order.

        ``mine_double`` is my list as re-encrypted by the other party. ``theirs_double`` (their
        list re-encrypted by me) is computed here unless it was already computed in step 2.
        """
        if len(mine_double) != len(self._ids):
            raise ValueError(f"Expected {len(self._ids)} doubly encrypted IDs back. "
                             f"Received: {len(mine_double)}")
        if theirs_double is None and self.party is None:
            raise ValueError("A resumed PSI session needs theirs_double. Received: None")
        theirs = list(theirs_double) if theirs_double is not None else self.answer(theirs_single)
        hits = match(mine_double, theirs)
        rows = [self.order[i] for i in hits]
        points = [mine_double[i] for i in hits]
        ordered = sorted(zip(points, rows, strict=True))
        alignment = Alignment(rows=[r for _, r in ordered], own_size=len(self._ids),
                              other_size=len(theirs))
        return alignment, [p for p, _ in ordered]
