"""Round-time overhead of secure aggregation (SecAgg+) vs plain FedAvg, at 10, 20, 100 hospitals.

Two tables (issue 13's goal: secure <= 2x plain at 100 hospitals, where Flower's full-graph
SecAgg costs 36x):

1. **Flower simulation** (what the issue compares; `bench/secure_aggregation_flower.py`):
   ``fedsplit simulate`` plain and with ``--secure-aggregation on``, same data and seed, an MLP
   of about 100k parameters, round times from the coordinator's history (rounds 2..R).
2. **In process** (isolates the computation): the real protocol code (`client.secure.secagg`,
   `server.secure.secagg`, `protocol.secure_vector`, Flower's key agreement, Shamir shares,
   Fernet, ``pseudo_rand_gen``) runs every hospital's stages one after the other, each timed on
   its own. A round's time is modelled as the hospitals working in parallel and the
   coordinator after them:

   - plain  = max_k(train_k) + FedAvg of the N updates (`aggregation.aggregate_updates`);
   - secure = max_k(train_k + setup_k + share-keys_k + encode-and-mask_k + unmask_k)
     + the coordinator's stages (neighbour graph, routing, unmasking, decoding; the unmasking
     runs in ``--workers`` processes, `server.secure.unmask`).

   ``train_k`` is real local training: ``--steps`` Adam mini-batches of ``--batch`` rows of an
   MLP with about ``--params`` parameters (fedsplit's minimum local work is 10 mini-batches).
   Not included: the network (a masked vector is int64, twice the bytes of float32 weights)
   and the three extra message round trips (setup, share-keys, unmask) a deployment adds.

    .venv/bin/python bench/secure_aggregation.py --hospitals 10,20,100
    .venv/bin/python bench/secure_aggregation.py --in-process-only --neighbours 11
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/aggregation.py must not shadow

import secure_aggregation_flower as flower_bench
from fedsplit.client.secure import secagg
from fedsplit.protocol import secure_vector as sv
from fedsplit.protocol.privacy import SecureSpec
from fedsplit.protocol.update import Update
from fedsplit.server.secure import unmask
from fedsplit.server.secure.secagg import SecureSum

from fedsplit import aggregation


class _Node:
    """A hospital's Flower context, reduced to what the stages use."""

    def __init__(self) -> None:
        from flwr.app import RecordDict

        self.state = RecordDict()


def _model(params: int, features: int = 30) -> torch.nn.Module:
    hidden = max(8, int((-(features + 4) + np.sqrt((features + 4) ** 2 + 4 * params)) / 2))
    return torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 2))


def train_seconds(params: int, steps: int, batch: int, repeats: int = 5) -> tuple[float, dict]:
    """Median seconds of one hospital's local training; the trained change (name -> array)."""
    torch.manual_seed(0)
    model = _model(params)
    x, y = torch.randn(batch * steps, 30), torch.randint(0, 2, (batch * steps,))
    start = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    times = []
    for _ in range(repeats):
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        t0 = time.perf_counter()
        for i in range(steps):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[i * batch:(i + 1) * batch]),
                                                     y[i * batch:(i + 1) * batch])
            loss.backward()
            opt.step()
        times.append(time.perf_counter() - t0)
    delta = {k: v.detach().numpy() - start[k] for k, v in model.state_dict().items()}
    return float(np.median(times)), delta


def plain_seconds(deltas: list[dict[str, np.ndarray]], counts: list[int]) -> float:
    """Coordinator time of plain FedAvg over the N updates (fedsplit's registry rule)."""
    rule = aggregation.get_strategy("fedavg", {})
    updates = [Update(arrays={k: v.astype(np.float32) for k, v in d.items()}, num_examples=n)
               for d, n in zip(deltas, counts, strict=True)]
    best = float("inf")
    for _ in range(3):  # the first call compiles the numba kernels: best of three
        t0 = time.perf_counter()
        aggregation.aggregate_updates(rule, updates)
        best = min(best, time.perf_counter() - t0)
    return best


def secure_seconds(deltas: list[dict[str, np.ndarray]], counts: list[int], spec: SecureSpec,
                   workers: int) -> tuple[float, float, SecureSum, float]:
    """(slowest hospital's protocol seconds, coordinator seconds, the sum, max decode error)."""
    nodes = [(1 << 63) + 7919 * i for i in range(len(deltas))]  # node ids as Flower draws them
    ctx = {n: _Node() for n in nodes}
    per = dict.fromkeys(nodes, 0.0)
    server = 0.0

    def timed(node: int, fn: Any, *args: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args)
        per[node] += time.perf_counter() - t0
        return out

    t0 = time.perf_counter()
    run = SecureSum(spec, nodes, round=1)
    server += time.perf_counter() - t0
    keys = {}
    for n in nodes:
        reply = timed(n, secagg.setup, ctx[n], n, run.setup_config())
        keys[n] = (reply["pk1"], reply["pk2"])
    t0 = time.perf_counter()
    share = run.share_instructions(keys)
    server += time.perf_counter() - t0
    shares = {}
    for n, cfg in share.items():
        reply = timed(n, secagg.share_keys, ctx[n], cfg)
        shares[n] = (reply["dsts"], reply["ciphertexts"])
    t0 = time.perf_counter()
    collect = run.collect_instructions(shares)
    server += time.perf_counter() - t0
    masked = {}
    for (n, cfg), delta, count in zip(collect.items(), deltas, counts, strict=True):
        vector = timed(n, sv.encode, delta, count, spec.bound, spec.levels)
        masked[n] = timed(n, secagg.masked_vector, ctx[n], cfg, vector)
    t0 = time.perf_counter()
    unmask = run.unmask_instructions(masked)
    server += time.perf_counter() - t0
    replies = {}
    for n, cfg in unmask.items():
        reply = timed(n, secagg.unmask, ctx[n], cfg)
        replies[n] = (reply["nodes"], reply["shares"])
    t0 = time.perf_counter()
    mean, _ = sv.decode(run.total(replies, workers), deltas[0], spec.bound, spec.levels)
    server += time.perf_counter() - t0
    total = sum(counts)
    exact = {k: sum(d[k].astype(np.float64) * c for d, c in zip(deltas, counts, strict=True)) / total
             for k in deltas[0]}
    err = max(float(np.max(np.abs(mean[k] - exact[k]))) for k in exact)
    return max(per.values()), server, run, err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hospitals", default="10,20,100")
    parser.add_argument("--params", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--bound", type=float, default=1.0)
    parser.add_argument("--neighbours", type=int, default=0, help="K (0: 2 ceil(log2 N) + 1)")
    parser.add_argument("--workers", type=int, default=0,
                        help="unmasking processes (0: FEDSPLIT_SECAGG_WORKERS or the CPUs)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--in-process-only", action="store_true")
    which.add_argument("--flower-only", action="store_true")
    flower_bench.add_arguments(parser)
    args = parser.parse_args()
    hospitals = [int(h) for h in args.hospitals.split(",")]
    if not args.in_process_only:
        flower_bench.table(hospitals, args)
    if not args.flower_only:
        in_process(hospitals, args)


def in_process(hospitals: list[int], args: argparse.Namespace) -> None:
    """The in-process table (see the module docstring)."""
    torch.set_num_threads(1)
    spec = SecureSpec(bound=args.bound, neighbours=args.neighbours)
    workers = args.workers or unmask.workers_from(os.environ)
    for ready in unmask.warm_up(unmask.MIN_PARALLEL, workers):  # a coordinator starts it once
        ready.result()
    train, delta = train_seconds(args.params, args.steps, args.batch)
    size = sv.vector_size(delta) - 1
    print(f"In process: load average {os.getloadavg()[0]:.2f}; model: {size} parameters; "
          f"local training ({args.steps} x {args.batch} rows): "
          f"{train * 1000:.1f} ms per hospital; unmasking workers: {workers}")
    print(f"{'N':>4} {'K':>3} {'T':>3} {'plain ms':>9} {'secure ms':>10} {'ratio':>6} "
          f"{'hospital ms':>12} {'coordinator ms':>15} {'max error':>10} {'bound 2B/L':>10}")
    rng = np.random.default_rng(0)
    for n in hospitals:
        deltas = [{k: np.clip(v * rng.uniform(0.5, 1.5), -args.bound, args.bound)
                   for k, v in delta.items()} for _ in range(n)]
        counts = [int(c) for c in rng.integers(50, 5000, n)]
        plain = train + plain_seconds(deltas, counts)
        hospital, coordinator, run, err = secure_seconds(deltas, counts, spec, workers)
        secure = train + hospital + coordinator
        print(f"{n:>4} {run.share_num:>3} {run.threshold:>3} {plain * 1000:>9.1f} "
              f"{secure * 1000:>10.1f} {secure / plain:>6.2f} {hospital * 1000:>12.1f} "
              f"{coordinator * 1000:>15.1f} {err:>10.2e} {2 * args.bound / spec.levels:>10.2e}")


if __name__ == "__main__":
    main()
