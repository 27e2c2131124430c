"""`fedsplit simulate --ray-address` on a two-node Ray cluster started as docs/simulate.md says
('On a Ray cluster'), both nodes on this machine: the same model as on one node, and hospitals
run on both nodes (issue 43)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from fedsplit.cli.app import app
from fedsplit.cli.errors import run_guarded
from fedsplit.orchestration.flower_runtime import free_port
from fedsplit.protocol import read_weights
from fedsplit.protocol.errors import ConfigError

BIN = Path(sys.executable).parent
#: every wait is bounded: a node's start, a run, a node's stop
NODE_START_S, RUN_S, NODE_STOP_S = 180, 480, 30
#: Ray writes each task it runs into its node's export events (its task records; off by
#: default): the node that ran a hospital's message logs a ``ClientAppActor.run`` there
TASK_RECORDS = {"RAY_enable_export_api_write_config": "EXPORT_TASK"}
HOSPITAL_TASK = '"event_name":"task::ClientAppActor.run"'


@dataclass
class Node:
    proc: subprocess.Popen[bytes]
    temp_dir: Path
    log: Path

    def hospital_tasks(self) -> int:
        """How many hospital messages (Flower's ``ClientAppActor.run``) this node ran."""
        return sum(path.read_text(errors="replace").count(HOSPITAL_TASK)
                   for path in self.temp_dir.glob("session_latest/logs/export_events/*.log"))


@contextmanager
def ray_node(args: list[str]) -> Iterator[Node]:
    """``ray start ARGS --block`` with one CPU and its own temp dir, in its own process group;
    yields once it says it started; the group is stopped on the way out, whatever happened."""
    temp_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Ray's socket paths
    log = temp_dir / "start.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(BIN / "ray"), "start", *args, "--num-cpus=1", f"--temp-dir={temp_dir}",
             "--node-ip-address=127.0.0.1", "--object-store-memory=100000000",
             "--disable-usage-stats", "--block"],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **TASK_RECORDS},
            start_new_session=True)
    try:
        deadline = time.monotonic() + NODE_START_S
        while "Ray runtime started" not in log.read_text(errors="replace"):
            assert proc.poll() is None, f"ray start {args} exited: {log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"ray start {args} not up in {NODE_START_S} s"
            time.sleep(1)
        yield Node(proc, temp_dir, log)
    finally:
        stop_group(proc)
        shutil.rmtree(temp_dir, ignore_errors=True)


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the node's process group (``ray start --block`` stops its node's processes),
    SIGKILL if any of it is left after `NODE_STOP_S`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        deadline = time.monotonic() + NODE_STOP_S
        while time.monotonic() < deadline and group_alive(proc.pid):
            proc.poll()  # reap the leader, or its group stays 'alive' as a zombie
            time.sleep(0.5)
        if not group_alive(proc.pid):
            break
    proc.wait(timeout=5)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def simulate(out: Path, *extra: str) -> None:
    cmd = [str(BIN / "fedsplit"), "simulate", "--dataset", "breast-cancer", "--sites", "4",
           "--rounds", "2", "--local-steps", "2", "--seed", "3", "--baselines", "none",
           "--out", str(out), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.slow
def test_simulate_on_a_two_node_ray_cluster_trains_the_one_node_model_on_both_nodes(
        tmp_path: Path) -> None:
    port = free_port()
    with ExitStack() as nodes:
        head = nodes.enter_context(ray_node(["--head", f"--port={port}",
                                             "--include-dashboard=false"]))
        worker = nodes.enter_context(ray_node([f"--address=127.0.0.1:{port}"]))
        simulate(tmp_path / "cluster", "--ray-address", f"127.0.0.1:{port}")
        ran = {"head": head.hospital_tasks(), "worker": worker.hospital_tasks()}
        # each node has one CPU and each hospital's actor takes one: both nodes ran hospitals
        assert ran["head"] >= 1 and ran["worker"] >= 1, ran
        assert sum(ran.values()) >= 4 * 2, ran  # every hospital, every round
        # without --ray-address the run stays on this machine, even with a cluster up here
        simulate(tmp_path / "one-node")
        assert {"head": head.hospital_tasks(), "worker": worker.hospital_tasks()} == ran
    cluster = read_weights(tmp_path / "cluster" / "federation" / "global.h5")
    alone = read_weights(tmp_path / "one-node" / "federation" / "global.h5")
    assert cluster.arrays.keys() == alone.arrays.keys()
    for name, values in alone.arrays.items():
        np.testing.assert_allclose(cluster.arrays[name], values, rtol=1e-6, atol=1e-6,
                                   err_msg=name)
    assert cluster.round == alone.round


def test_a_ray_address_that_does_not_answer_is_refused_before_flower_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()  # nothing listens there
    code = run_guarded(app, ["simulate", "--dataset", "breast-cancer", "--sites", "2",
                             "--rounds", "1", "--out", str(tmp_path),
                             "--ray-address", f"127.0.0.1:{port}"])
    assert code == ConfigError.exit_code
    said = " ".join(capsys.readouterr().err.split())
    assert f"No Ray cluster answers at 127.0.0.1:{port}" in said and "ray start --head" in said
    assert not (tmp_path / "flower").exists() and not (tmp_path / "sites").exists()
    assert run_guarded(app, ["simulate", "--dataset", "breast-cancer", "--out", str(tmp_path),
                             "--ray-address", "head-node"]) == ConfigError.exit_code
    assert "--ray-address is a Ray cluster's HOST:PORT" in " ".join(capsys.readouterr().err.split())
