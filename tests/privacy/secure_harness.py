"""Runs one SecAgg+ sum in process: the coordinator's `SecureSum` and N hospitals' stages."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
from fedsplit.client.secure import secagg
from fedsplit.protocol.privacy import SecureSpec
from fedsplit.server.secure.secagg import SecureSum
from flwr.app import RecordDict


class Node:
    """A hospital's Flower context, reduced to what the stages use."""

    def __init__(self) -> None:
        self.state = RecordDict()


def secure_sum(spec: SecureSpec, vectors: Mapping[int, np.ndarray], *,
               drop_before_collect: Iterable[int] = (), workers: int | None = None
               ) -> tuple[np.ndarray, SecureSum]:
    """Sum ``vectors`` (node -> int64 vector) with SecAgg+; dropped nodes never send theirs;
    the coordinator unmasks with ``workers`` processes (default: `server.secure.unmask.workers`)."""
    nodes = sorted(vectors)
    ctx = {n: Node() for n in nodes}
    run = SecureSum(spec, nodes, round=1)
    keys = {}
    for n in nodes:
        reply = secagg.setup(ctx[n], n, run.setup_config())
        keys[n] = (reply["pk1"], reply["pk2"])
    shares = {}
    for n, cfg in run.share_instructions(keys).items():
        reply = secagg.share_keys(ctx[n], cfg)
        shares[n] = (reply["dsts"], reply["ciphertexts"])
    masked = {}
    dropped = set(drop_before_collect)
    for n, cfg in run.collect_instructions(shares).items():
        if n not in dropped:
            masked[n] = secagg.masked_vector(ctx[n], cfg, vectors[n])
    replies = {}
    for n, cfg in run.unmask_instructions(masked).items():
        reply = secagg.unmask(ctx[n], cfg)
        replies[n] = (reply["nodes"], reply["shares"])
    return run.total(replies, workers), run
