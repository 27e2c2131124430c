"""The coordinator's side of one SecAgg+ sum (Bell et al. 2020), ported from Flower's
``SecAggPlusWorkflow`` (which runs only on the legacy ``LegacyContext`` path) to plain
per-node instructions, so any driver (the round loop's merge step `server.secure.merge`, the
tests, the benchmark) can carry them. Primitives are Flower's (``combine_shares``, key
agreement, ``pseudo_rand_gen`` via `protocol.secure_vector`).

The coordinator learns the sum of the masked vectors of the hospitals that sent one (U2) and
nothing per hospital: for each of them it reconstructs the private-mask seed from T shares held
by its active neighbours; for each hospital that shared keys but did not send its vector
(dropped: U1 minus U2) it reconstructs that hospital's sk1 and removes the pairwise masks its
active neighbours added for it. A hospital with fewer than T active neighbours holding its
shares cannot be unmasked: the sum fails (`FederationError`) rather than being wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fedsplit.protocol import secure_vector as sv
from fedsplit.protocol.errors import FederationError
from fedsplit.protocol.privacy import SecureSpec
from fedsplit.server.secure import unmask


@dataclass
class SecureSum:
    """One secure sum among ``nodes`` (the hospitals sampled for it)."""

    spec: SecureSpec
    nodes: list[int]
    round: int
    share_num: int = 0
    threshold: int = 0
    graph: dict[int, list[int]] = field(default_factory=dict)
    keys: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    u1: list[int] = field(default_factory=list)
    u2: list[int] = field(default_factory=list)
    masked: dict[int, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.share_num, self.threshold = self.spec.share_plan(len(self.nodes))

    def setup_config(self) -> dict[str, Any]:
        """Stage 1 instruction (the same for every node)."""
        return {"stage": "setup", "share-num": self.share_num, "threshold": self.threshold,
                "bound": float(self.spec.bound), "levels": int(self.spec.levels),
                "modulus": sv.MODULUS, "round": int(self.round)}

    def share_instructions(self, public_keys: Mapping[int, tuple[bytes, bytes]]) -> dict[int, dict]:
        """Stage 2: each node that answered setup gets its neighbours' public keys."""
        self.keys = dict(public_keys)
        ready = sorted(self.keys)
        self._need(len(ready), "answered the key setup")
        self.graph = sv.neighbours(ready, self.share_num)
        return {node: {"stage": "share-keys", "nodes": [str(n) for n in nbrs],
                       "pk1": [self.keys[n][0] for n in nbrs], "pk2": [self.keys[n][1] for n in nbrs]}
                for node, nbrs in self.graph.items()}

    def collect_instructions(
        self, shares: Mapping[int, tuple[list[int], list[bytes]]]
    ) -> dict[int, dict]:
        """Stage 3: forward each encrypted share pair to its destination (U1 = who shared)."""
        self.u1 = sorted(shares)
        self._need(len(self.u1), "shared their keys")
        inbox: dict[int, tuple[list[int], list[bytes]]] = {n: ([], []) for n in self.u1}
        for src, (dsts, cts) in shares.items():
            dsts = [int(d) for d in dsts]
            if sorted(dsts) != sorted(n for n in self.graph[src] if n != src):
                raise FederationError(f"Node {src} sent shares to nodes other than its neighbours. "
                                      f"Received: {sorted(dsts)}")
            for dst, ct in zip(dsts, cts, strict=True):
                if dst in inbox:
                    inbox[dst][0].append(str(src))
                    inbox[dst][1].append(ct)
        return {n: {"stage": "collect", "srcs": s, "ciphertexts": c} for n, (s, c) in inbox.items()}

    def unmask_instructions(self, masked: Mapping[int, np.ndarray]) -> dict[int, dict]:
        """Stage 4: tell every node that sent its vector (U2) who is active and who dropped."""
        self.masked = {n: np.asarray(v, dtype=np.int64) for n, v in masked.items() if n in self.u1}
        self.u2 = sorted(self.masked)
        self._need(len(self.u2), "sent their masked update")
        sizes = {len(v) for v in self.masked.values()}
        if len(sizes) != 1:
            raise FederationError(f"The masked vectors differ in length. Received: {sorted(sizes)}")
        dropped = sorted(set(self.u1) - set(self.u2))
        return {n: {"stage": "unmask", "active": [str(a) for a in self.graph[n] if a in self.u2],
                    "dropped": [str(d) for d in self.graph[n] if d in dropped]} for n in self.u2}

    def total(self, replies: Mapping[int, tuple[list[int], list[bytes]]],
              workers: int | None = None) -> np.ndarray:
        """The unmasked sum of U2's vectors, from the stage-4 replies.

        The reconstructions and masks run in ``workers`` processes (`server.secure.unmask`;
        default the process's pool size, `unmask.workers`)."""
        collected: dict[int, list[bytes]] = {}
        for _sender, (owners, shares) in replies.items():
            for owner, share in zip(owners, shares, strict=True):
                collected.setdefault(int(owner), []).append(share)
        size = len(next(iter(self.masked.values())))
        total = np.zeros(size, dtype=np.int64)
        for vec in self.masked.values():
            total = sv.add(total, vec)
        jobs = []
        for node in self.u1:
            got = collected.get(node, [])
            if len(got) < self.threshold:
                raise FederationError(
                    f"Hospital node {node}'s mask cannot be removed: {len(got)} of its neighbours "
                    f"returned shares, the reconstruction threshold is {self.threshold} (too many "
                    f"dropouts this round). Received: {len(got)} shares")
            shares = tuple(got[: self.threshold])
            if node in self.u2:  # its private mask seed
                jobs.append(unmask.Job(shares))
                continue
            # dropped: remove the pairwise masks its active neighbours added for it
            # (`other` added +pair if other < node, else -pair)
            jobs.append(unmask.Job(shares, tuple(
                (self.keys[other][0], 1 if other < node else -1)
                for other in self.graph[node] if other != node and other in self.u2)))
        return sv.sub(total, unmask.parallel_correction(jobs, size, workers))

    def _need(self, have: int, what: str) -> None:
        if have < max(2, self.threshold):
            raise FederationError(
                f"Secure aggregation needs at least {max(2, self.threshold)} hospitals per stage "
                f"(the reconstruction threshold); only {have} {what}. The round leaves the "
                f"global model unchanged. Received: {have} of {len(self.nodes)} hospitals")
