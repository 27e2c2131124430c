"""The coordinator's unmasking over worker processes (`server.secure.unmask`): the same sum as the
serial path, dropouts included; workers that outlive no coordinator; the 16-byte private-mask
seed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from fedsplit.client.secure import secagg
from fedsplit.protocol import secure_vector as sv
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.privacy import SecureSpec
from fedsplit.server.secure import unmask
from flwr.common.secure_aggregation.crypto.shamir import create_shares

from tests.privacy.secure_harness import Node, secure_sum

BASE = (1 << 63) + 100  # Flower node ids are unsigned 64-bit


def _vectors(n: int, seed: int) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {BASE + i: rng.integers(0, 1 << 40, 64).astype(np.int64) for i in range(n)}


def test_parallel_correction_equals_serial_on_the_same_jobs() -> None:
    seeds = [os.urandom(sv.SEED_BYTES) for _ in range(unmask.MIN_PARALLEL + 3)]
    jobs = [unmask.Job(tuple(create_shares(s, 3, 5)[1:4])) for s in seeds]
    serial = unmask.parallel_correction(jobs, 50, 1)
    parallel = unmask.parallel_correction(jobs, 50, 2)
    expected = np.zeros(50, dtype=np.int64)
    for s in seeds:
        expected = sv.add(expected, sv.mask(s, 50))
    assert np.array_equal(serial, expected) and np.array_equal(parallel, expected)


def test_parallel_secure_sum_with_dropped_hospitals_completes() -> None:
    n, drops = unmask.MIN_PARALLEL + 4, {BASE + 3, BASE + 11}
    vectors = _vectors(n, 2)
    exact = np.zeros(64, dtype=np.int64)
    for node, vec in vectors.items():
        if node not in drops:
            exact = sv.add(exact, vec)
    parallel, run = secure_sum(SecureSpec(), vectors, drop_before_collect=drops, workers=2)
    serial, _ = secure_sum(SecureSpec(), vectors, drop_before_collect=drops, workers=1)
    assert len(run.u1) - len(run.u2) == 2  # the sum went through the dropped-hospital path
    assert np.array_equal(parallel, exact) and np.array_equal(serial, exact)


def test_worker_count_comes_from_the_environment_the_entry_hands_in(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert unmask.workers_from({unmask.WORKERS_ENV: "3"}) == 3
    assert 1 <= unmask.workers_from({}) == unmask.default_workers() <= 8
    for bad in ("0", "two", "-1"):
        with pytest.raises(ConfigError, match=r"FEDSPLIT_SECAGG_WORKERS.*Received"):
            unmask.workers_from({unmask.WORKERS_ENV: bad})
    monkeypatch.setattr(unmask, "_workers", None)  # this process's pool size, restored after
    assert unmask.workers() == unmask.default_workers()
    unmask.use_workers(3)
    assert unmask.workers() == 3
    with pytest.raises(ConfigError, match="at least one worker"):
        unmask.use_workers(0)


def test_private_mask_seed_is_128_bits_in_two_shamir_blocks() -> None:
    nodes = [BASE + i for i in range(4)]
    ctx = {n: Node() for n in nodes}
    config = {"round": 1, "share-num": 4, "threshold": 3, "bound": 1.0, "levels": 1 << 20,
              "modulus": sv.MODULUS}
    keys = {n: secagg.setup(ctx[n], n, config) for n in nodes}
    cfg = {"nodes": [str(n) for n in nodes], "pk1": [keys[n]["pk1"] for n in nodes],
           "pk2": [keys[n]["pk2"] for n in nodes]}
    secagg.share_keys(ctx[nodes[0]], cfg)
    state = secagg._state(ctx[nodes[0]])
    assert len(state["rd-seed"]) == 16
    # Flower's share: 4 index bytes + 16 per PKCS7-padded block; 16 bytes pad to 2 blocks
    assert {len(b) for b in state["held-b"]} == {4 + 2 * 16}


def _running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (reparented zombies may linger unreaped)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_workers_exit_when_the_coordinator_dies_without_cleanup(tmp_path: Path) -> None:
    # Flower stops a simulation's process with a signal: no exit handlers run, and without the
    # watchdog the pool's workers (and the forkserver) stayed behind for good.
    code = ("import os, sys\n"
            "from fedsplit.server.secure import unmask\n"
            "pids = [f.result() for f in unmask.warm_up(unmask.MIN_PARALLEL, 2)]\n"
            "print(' '.join(map(str, pids)), flush=True)\n"
            "os._exit(0)\n")
    # output to files: the workers inherit them, and a pipe would wait for them to close it;
    # stderr gets the resource tracker's "leaked semaphore" note, expected after os._exit
    log, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with log.open("w") as out, err.open("w") as errors:
        subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                       stdout=out, stderr=errors, timeout=120, check=True)
    pids = [int(p) for p in log.read_text().split()]
    assert len(pids) >= 1 and all(p != os.getpid() for p in pids)
    deadline = time.monotonic() + 10
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_running(p) for p in pids)


def test_a_broken_pool_still_gives_the_sum_and_is_replaced(caplog: pytest.LogCaptureFixture
                                                             ) -> None:
    seeds = [os.urandom(sv.SEED_BYTES) for _ in range(unmask.MIN_PARALLEL)]
    jobs = [unmask.Job(tuple(create_shares(s, 2, 3)[:2])) for s in seeds]
    expected = unmask.parallel_correction(jobs, 20, 1)
    pids = {f.result() for f in unmask.warm_up(unmask.MIN_PARALLEL, 2)}
    os.kill(next(iter(pids)), signal.SIGKILL)  # a worker of this test's own pool
    time.sleep(0.5)
    assert np.array_equal(unmask.parallel_correction(jobs, 20, 2), expected)  # serial fallback
    assert "unmasking pool broke" in caplog.text
    assert np.array_equal(unmask.parallel_correction(jobs, 20, 2), expected)  # a fresh pool
