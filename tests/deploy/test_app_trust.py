"""Only the app a party's own fedsplit builds runs there (issue 40): the FAB pin, its launchers,
and real SuperLinks handed a foreign app by an outsider or a hostile coordinator."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import time
import zipfile
from pathlib import Path

import pytest
from fedsplit.orchestration.app_launcher import Checker, UntrustedApp
from fedsplit.orchestration.app_trust import (
    TRUST_FILE,
    Trust,
    app_digest,
    prepare_home,
    trusted_digests,
    trusted_env,
)
from fedsplit.orchestration.flower_runtime import (
    CONNECTION,
    flower_env,
    free_port,
    health_url,
    run_config_path,
    spawn,
    stage_app,
    stop,
    superexec_command,
    superlink_command,
    tool,
    wait_http,
    write_connection,
)
from fedsplit.orchestration.local_federation import fedsplit_command
from fedsplit.protocol.config import RunConfig
from fedsplit.protocol.horizontal_wire import failure_reason, failure_site


def _fab(files: dict[str, str]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as fab:
        for name, text in files.items():
            fab.writestr(name, text)
    return buffer.getvalue()


def test_the_fab_is_the_same_for_every_run_and_carries_no_run_values(tmp_path: Path) -> None:
    """Two runs with different configs stage byte-identical FABs (the values travel as the
    run-config override beside the app), which is the horizontal digest a hospital computes."""
    one = stage_app(tmp_path / "one", RunConfig(num_server_rounds=3, lr=0.5, strategy="median"))
    two = stage_app(tmp_path / "two", RunConfig(num_server_rounds=9, seed=7, target="diagnosis"))
    assert app_digest(one) == app_digest(two)
    assert app_digest(one) in trusted_digests()
    assert "median" not in (one / "pyproject.toml").read_text()
    assert 'strategy = "median"' in run_config_path(one).read_text()
    assert "num-server-rounds = 9" in run_config_path(two).read_text()


def test_checker_refuses_foreign_claimed_and_untrusted(tmp_path: Path) -> None:
    """A foreign FAB, a trusted FAB under another claimed hash, and any FAB without a trust file
    are refused in one line naming the publisher, the sha256 and why; a trusted one passes."""
    prepare_home(tmp_path, "hospital-1")
    checker = Checker(tmp_path)
    evil = _fab({"pyproject.toml": '[project]\nname = "reader"\nversion = "6.6.6"\n'
                                   '[tool.flwr.app]\npublisher = "mallory"\n'})
    digest = hashlib.sha256(evil).hexdigest()
    with pytest.raises(UntrustedApp) as refused:
        checker.check(evil, digest)
    line = str(refused.value)
    assert line.startswith("hospital hospital-1, checking the app: refused app mallory/reader "
                           f"6.6.6 sha256 {digest}")
    assert "\n" not in line and "nothing of it was installed or run" in line
    assert failure_site(f"<class 'x.UntrustedApp'>:<'{line}'>") == "hospital-1"
    assert failure_reason(f"<class 'x.UntrustedApp'>:<'{line}'>") == line
    assert digest in (tmp_path / "refused-apps.log").read_text()

    trusted = Trust.read(tmp_path)
    app = stage_app(tmp_path / "app", RunConfig())
    from flwr.cli.build import build_fab_from_disk

    ours = build_fab_from_disk(app)
    ours_digest = hashlib.sha256(ours).hexdigest()
    assert ours_digest in trusted.apps
    assert checker.check(ours, ours_digest) == ours_digest
    with pytest.raises(UntrustedApp, match="not the hash of its bytes"):
        checker.check(ours, "0" * 64)

    (tmp_path / TRUST_FILE).unlink()
    with pytest.raises(UntrustedApp, match="no list of trusted apps"):
        Checker(tmp_path).check(ours, ours_digest)


def test_policy_trusted_apps_and_launchers_first_on_path(tmp_path: Path) -> None:
    """A digest the hospital's policy reviewed is trusted too; the launchers shadow Flower's."""
    extra = "ab" * 32
    trust = prepare_home(tmp_path, "h", {extra: "reviewed"})
    assert trust.apps[extra] == "reviewed" and len(trust.apps) == 4
    env = trusted_env(flower_env(tmp_path), tmp_path)
    for name in ("flwr-clientapp", "flwr-serverapp"):
        found = subprocess.run(["sh", "-c", f"command -v {name}"], env=env, capture_output=True,
                               text=True, check=True).stdout.strip()
        assert found == str(tmp_path / "bin" / name)
        assert os.access(found, os.X_OK)


# --- real SuperLinks: a foreign app submitted with `flwr run` -------------------------------

EVIL_APP = '''
from pathlib import Path
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

MARKS = Path({marks!r})
server = ServerApp()
client = ClientApp()


@server.main()
def main(grid: Grid, context) -> None:
    (MARKS / "serverapp-ran").write_text("x")
    nodes = []
    for _ in range(120):
        nodes = list(grid.get_node_ids())
        if nodes:
            break
        import time; time.sleep(0.5)
    messages = [Message(RecordDict({{"q": ConfigRecord({{}})}}), dst_node_id=n,
                        message_type=MessageType.QUERY) for n in nodes]
    for reply in grid.send_and_receive(messages, timeout=60):
        (MARKS / "reply.txt").write_text(reply.error.reason if reply.has_error() else "content")


@client.query()
def steal(msg: Message, context) -> Message:
    rows = Path(str(context.node_config["data-path"])).read_text()[:400]
    (MARKS / "clientapp-ran").write_text(rows)
    return Message(RecordDict({{"rows": ConfigRecord({{"rows": rows}})}}), reply_to=msg)
'''


def _evil_app(root: Path, marks: Path) -> Path:
    app = root / "evil"
    app.mkdir(parents=True)
    (app / "evil_app.py").write_text(EVIL_APP.format(marks=str(marks)))
    (app / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n'
        '[project]\nname = "reader"\nversion = "1.0.0"\nlicense = "Apache-2.0"\n'
        'dependencies = ["flwr>=1.42.0"]\n[tool.hatch.build.targets.wheel]\npackages = ["."]\n'
        '[tool.flwr.app]\npublisher = "mallory"\n[tool.flwr.app.components]\n'
        'serverapp = "evil_app:server"\nclientapp = "evil_app:client"\n[tool.flwr.app.config]\n'
        'x = 1\n')
    return app


def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    return False


@pytest.mark.slow
@pytest.mark.parametrize("coordinator", ["fedsplit", "hostile"])
def test_a_foreign_app_runs_nowhere(tmp_path: Path, coordinator: str) -> None:
    """An app that reads the hospital's rows, submitted with ``flwr run``: fedsplit's coordinator
    (``fedsplit superexec``) refuses its ServerApp; a hostile coordinator (plain
    flower-superexec) runs it, but the hospital agent refuses its ClientApp before a line of it
    runs, in one line of its log naming the app's sha256, and that line is the reply's error."""
    marks = tmp_path / "marks"
    marks.mkdir()
    data = tmp_path / "hospital.csv"
    data.write_text("mrn,age,target\n" + "".join(f"12345{i},{40 + i},{i % 2}\n" for i in range(20)))
    port = free_port()
    address = f"127.0.0.1:{port}"
    procs = []
    try:
        link = spawn(superlink_command(port, isolation="process"), flower_env(tmp_path / "link"),
                     tmp_path / "superlink.log")
        procs.append(link)
        wait_http(health_url(address, False), 60, link)
        flower = superexec_command(address)
        if coordinator == "fedsplit":
            cmd = [*fedsplit_command(), "superexec", "--flwr-home", str(tmp_path / "exec"),
                   *flower[1:]]
        else:
            cmd = flower
        procs.append(spawn(cmd, flower_env(tmp_path / "exec"), tmp_path / "coordinator.log"))
        site_log = tmp_path / "hospital-1.log"
        procs.append(spawn([*fedsplit_command(), "site", "run", "--superlink", address,
                            "--insecure", "--data", str(data), "--name", "hospital-1",
                            "--port", str(free_port()), "--flwr-home", str(tmp_path / "h1")],
                           flower_env(tmp_path / "h1"), site_log))
        assert _wait_for(lambda: "SuperNode ID" in site_log.read_text(errors="replace"), 90)
        write_connection(tmp_path / "cli", address)
        app = _evil_app(tmp_path, marks)
        digest = app_digest(app)
        run = subprocess.run([tool("flwr"), "run", str(app), CONNECTION],
                             env=flower_env(tmp_path / "cli"), capture_output=True, text=True,
                             timeout=120)
        assert "Successfully started run" in run.stdout + run.stderr  # the SuperLink took it
        if coordinator == "fedsplit":
            refusals = tmp_path / "exec" / "refused-apps.log"
            assert _wait_for(lambda: refusals.exists() and digest in refusals.read_text(), 90)
            assert "the coordinator, checking the app: refused app mallory/reader" in \
                refusals.read_text()
            time.sleep(3)
            assert not (marks / "serverapp-ran").exists()
        else:
            reply = marks / "reply.txt"
            assert _wait_for(reply.exists, 120), site_log.read_text()[-2000:]
            assert f"hospital hospital-1, checking the app: refused app mallory/reader 1.0.0 " \
                   f"sha256 {digest}" in reply.read_text()
            assert f"refused app mallory/reader 1.0.0 sha256 {digest}" in site_log.read_text()
        assert not (marks / "clientapp-ran").exists()
        assert not list((tmp_path / "h1").glob("apps/mallory*"))  # never even installed
    finally:
        for proc in reversed(procs):
            stop(proc)
