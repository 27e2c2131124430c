"""Only the operator controls the federation (issue 40, finding 1).

With TLS, `fedsplit up`'s SuperLink listens on loopback only, with SuperNode and SuperExec
authentication, and Debian's nginx (`orchestration/front_proxy.py`) serves the public port:
the Fleet API and /health go through, re-encrypted; Control and Runtime API get 403. The real
test starts just that (SuperLink + front proxy, as `LocalFederation.start_superlink` does for
`fedsplit up --tls`) and drives it with Flower's own CLI: holding only ca.crt, `flwr run`,
`ls`, `log` and `stop` on the public port are refused, while the operator's loopback connection
works, and a SuperExec without the secret gets no task. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from fedsplit.orchestration import front_proxy
from fedsplit.orchestration.flower_runtime import (
    CONNECTION,
    flower_env,
    spawn,
    stop,
    superexec_command,
    superlink_command,
    tls_context,
    tool,
    write_connection,
    write_superexec_secret,
)
from fedsplit.orchestration.front_proxy import REFUSAL, FrontProxy
from fedsplit.orchestration.local_federation import FRONT_PROXY, SUPERLINK, LocalFederation, Site
from fedsplit.protocol.errors import ConfigError

NGINX = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
needs_nginx = pytest.mark.skipif(NGINX is None, reason=f"no nginx here: {front_proxy.INSTALL_HINT}")


def proxy(tmp_path: Path) -> FrontProxy:
    for name in ("ca.crt", "server.pem", "server.key"):
        (tmp_path / name).write_text("x")
    return FrontProxy("0.0.0.0:8000", "127.0.0.1:9000", tmp_path / "server.pem",
                      tmp_path / "server.key", tmp_path / "ca.crt")


def test_config_forwards_only_fleet_and_health(tmp_path: Path) -> None:
    """The written config: TLS on the public port, two locations forwarded to the loopback
    SuperLink over verified TLS, everything else 403; every path nginx writes under WORK."""
    conf = proxy(tmp_path).config(tmp_path / "work")
    assert "listen 0.0.0.0:8000 ssl;" in conf and "server 127.0.0.1:9000;" in conf
    forwarded = [line.split()[1] for line in conf.splitlines() if "proxy_pass" in line]
    assert forwarded == ["https://superlink/v1/fleet/;", "https://superlink/health;"]
    assert "location /v1/fleet/ {" in conf and "location = /health {" in conf
    assert f'return 403 "{REFUSAL}\\n";' in conf
    for setting in ("proxy_ssl_verify on;", f"proxy_ssl_trusted_certificate {tmp_path / 'ca.crt'};",
                    "proxy_request_buffering off;", "proxy_buffering off;", "daemon off;",
                    "client_max_body_size 512m;", "proxy_read_timeout 300s;"):
        assert setting in conf, setting
    written = [line.split()[1].rstrip(";") for line in conf.splitlines()
               if line.strip().startswith(("pid ", "client_body_temp_path", "proxy_temp_path",
                                           "access_log"))]
    assert written and all(p.startswith(str(tmp_path / "work")) for p in written), written
    assert "\nuser " not in conf  # nginx runs as whoever starts it
    # a build without fastcgi (say) gets no directive for it
    assert "fastcgi_temp_path" not in proxy(tmp_path).config(tmp_path, missing_modules=frozenset({"fastcgi"}))


def test_missing_nginx_is_one_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No nginx: `fedsplit up --tls` stops with one line naming the package, before it starts
    or writes anything."""
    monkeypatch.setattr(front_proxy.shutil, "which", lambda *_a, **_k: None)
    federation = LocalFederation(tmp_path / "up", [Site("hospital-1", tmp_path)], tls=True,
                                 say=lambda _m: None)
    with pytest.raises(ConfigError, match="apt-get install nginx-light"):
        federation.start_superlink()
    assert federation.procs == {} and not (tmp_path / "up" / "certs").exists()


def test_superexec_secret_and_commands(tmp_path: Path) -> None:
    """The secret is random, 0600 and replaced at each start; the SuperLink and the
    coordinator's SuperExec get the same file; a plain federation keeps one port."""
    secret = write_superexec_secret(tmp_path / "secrets" / "superexec")
    first = secret.read_bytes()
    assert secret.stat().st_mode & 0o777 == 0o600 and len(first) == 64
    assert write_superexec_secret(secret).read_bytes() != first
    link = superlink_command(9000, superexec_secret=secret)
    assert link[link.index("--superexec-auth-secret-file") + 1] == str(secret)
    runner = superexec_command("127.0.0.1:9000", root_cert=tmp_path / "ca.crt", secret=secret)
    assert runner[runner.index("--superexec-auth-secret-file") + 1] == str(secret)
    assert "--superexec-auth-secret-file" not in superexec_command("127.0.0.1:9000")
    plain = LocalFederation(tmp_path / "plain", [], say=lambda _m: None)
    assert plain.link_address == plain.address and plain.superexec_secret is None
    secure = LocalFederation(tmp_path / "tls", [], tls=True, say=lambda _m: None)
    assert secure.link_address != secure.address
    assert all(a.startswith("127.0.0.1:") for a in (secure.address, secure.link_address))


def hand_made_app(root: Path, publisher: str, marker: Path) -> Path:
    """A small Flower app of someone else's: its ServerApp leaves ``marker`` if it ever runs,
    its ClientApp would send a hospital's data file back."""
    app = root / publisher
    (app / "probe").mkdir(parents=True)
    (app / "probe" / "__init__.py").write_text("")
    (app / "probe" / "server_app.py").write_text(
        "from pathlib import Path\nfrom flwr.serverapp import ServerApp\n\napp = ServerApp()\n\n\n"
        f"@app.main()\ndef main(grid, context):\n    Path({str(marker)!r}).write_text('ran')\n")
    (app / "probe" / "client_app.py").write_text(
        "from pathlib import Path\nfrom flwr.app import ConfigRecord, Message, RecordDict\n"
        "from flwr.clientapp import ClientApp\n\napp = ClientApp()\n\n\n@app.query()\n"
        "def leak(msg, context):\n    data = Path(str(context.node_config['data-path'])).read_bytes()[:400]\n"
        "    return Message(RecordDict({'c': ConfigRecord({'data': data})}), reply_to=msg)\n")
    (app / "pyproject.toml").write_text(f"""[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "probe"
version = "1.0.0"
description = "not fedsplit's app"
license = "Apache-2.0"
dependencies = ["flwr>=1.42.0"]

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "{publisher}"

[tool.flwr.app.components]
serverapp = "probe.server_app:app"
clientapp = "probe.client_app:app"
""")
    return app


def flwr(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """One flwr CLI call (bounded)."""
    return subprocess.run([tool("flwr"), *args], env=env, capture_output=True, text=True,
                          timeout=120, check=False)


def refused(done: subprocess.CompletedProcess[str], path: str) -> bool:
    """Whether flwr stopped on the proxy's 403 for ``path``."""
    text = done.stdout + done.stderr
    return done.returncode != 0 and "403" in text and path in text


@pytest.mark.slow
@needs_nginx
def test_outsider_with_ca_cert_controls_nothing(tmp_path: Path) -> None:
    """Holding only ca.crt on the public port: `flwr run` of a hand-made app, `flwr ls`, `flwr log`
    and `flwr stop` are refused (403) and the Runtime API too, while the Fleet API's health goes
    through; on loopback the operator lists and stops runs; a SuperExec without the secret is
    refused and runs nothing."""
    data = tmp_path / "hospital-1"
    data.mkdir()
    (data / "data.csv").write_text("a,target\n1,0\n")
    with LocalFederation(tmp_path / "up", [Site("hospital-1", data)], tls=True, admin_port=None,
                         say=lambda _m: None) as federation:
        federation.start_superlink()  # SuperLink + front proxy; hospital-1's key registered
        assert set(federation.procs) == {SUPERLINK, FRONT_PROXY}
        ca = federation.root_cert
        verify = tls_context(ca)
        public = f"https://{federation.address}"

        # the Fleet API's health and Fleet calls go through; nothing else does
        assert httpx.get(f"{public}/health", verify=verify, timeout=10).status_code == 200
        fleet = httpx.post(f"{public}/v1/fleet/get-run", verify=verify, timeout=10)
        assert fleet.status_code != 403 and "code" in fleet.json()  # Flower's own answer
        for path in ("/v1/runtime/acquire-task", "/v1/control/list-runs", "/docs", "/openapi.json",
                     "/v1/fleet/../control/list-runs", "/v1/fleet/%2e%2e/runtime/acquire-task"):
            answer = httpx.post(f"{public}{path}", verify=verify, timeout=10)
            assert (answer.status_code, answer.text) == (403, REFUSAL + "\n"), path
        assert httpx.get(f"{public}/docs", verify=verify, timeout=10).status_code == 403

        # the operator (loopback) submits a run; no SuperExec runs yet, so it waits
        marker = tmp_path / "serverapp-ran"
        submitted = flwr(federation.cli_env, "run", str(hand_made_app(tmp_path, "operator", marker)),
                         CONNECTION, "--format", "json")
        assert submitted.returncode == 0, submitted.stdout + submitted.stderr
        run_id = json.loads(submitted.stdout)["run-id"]

        # an outsider with ca.crt only, through the public port
        outsider = flower_env(tmp_path / "outsider")
        write_connection(tmp_path / "outsider", federation.address, root_cert=ca)
        app = hand_made_app(tmp_path, "outsider", marker)
        assert refused(flwr(outsider, "run", str(app), CONNECTION), "/v1/control/start-run")
        assert refused(flwr(outsider, "ls", CONNECTION), "/v1/control/list-runs")
        assert refused(flwr(outsider, "log", run_id, CONNECTION, "--show"), "/v1/control/stream-logs")
        assert refused(flwr(outsider, "stop", run_id, CONNECTION), "/v1/control/stop-run")

        # the operator sees only its own run, still pending (not stopped by the outsider)
        listed = flwr(federation.cli_env, "ls", CONNECTION, "--format", "json")
        assert listed.returncode == 0, listed.stdout + listed.stderr
        runs = json.loads(listed.stdout)["runs"]
        assert [(r["run-id"], r["fab-id"]) for r in runs] == [(run_id, "operator/probe")], runs
        assert runs[0]["status"].startswith("pending"), runs

        # a SuperExec without the secret, on the loopback port itself: refused, runs nothing
        home = tmp_path / "no-secret"
        runner = spawn(superexec_command(federation.link_address, root_cert=ca), flower_env(home),
                       tmp_path / "no-secret.log")
        try:
            deadline = time.monotonic() + 60
            while runner.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
        finally:
            stop(runner)
        link_log = (federation.logs / f"{SUPERLINK}.log").read_text()
        assert "SuperExec authentication failed" in link_log
        assert not marker.exists() and not (home / "apps").exists()

        stopped = flwr(federation.cli_env, "stop", run_id, CONNECTION)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        access = (federation.logs / f"{FRONT_PROXY}-access.log").read_text()
        assert '"POST /v1/control/start-run HTTP/1.1" 403' in access  # refusals are logged
    assert not (tmp_path / "up" / "secrets" / "superexec").exists()  # removed at close
    assert not any(p.poll() is None for p in federation.procs.values())


@pytest.mark.slow
@needs_nginx
def test_front_proxy_restarts_when_it_dies(tmp_path: Path) -> None:
    """The front proxy is supervised like a hospital agent: killed, it is started again."""
    with LocalFederation(tmp_path / "up", [], tls=True, admin_port=None,
                         say=lambda _m: None, restart_delay=0.1) as federation:
        federation.start_superlink()
        first = federation.procs[FRONT_PROXY]
        stop(first, grace=2)
        federation.check_front_proxy()
        assert federation.procs[FRONT_PROXY] is not first
        verify = tls_context(federation.root_cert)
        assert httpx.get(f"https://{federation.address}/health", verify=verify,
                         timeout=10).status_code == 200
    assert os.path.exists(tmp_path / "up" / "pids.json")


def test_front_proxy_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    """`fedsplit front-proxy` (compose, a coordinator set up by hand) writes the config and
    becomes nginx; a SuperLink address off loopback is refused (its port must stay private)."""
    from fedsplit.cli import front_proxy as cli
    from fedsplit.cli.app import app
    from fedsplit.cli.errors import run_guarded

    p = proxy(tmp_path)
    monkeypatch.setattr(front_proxy, "nginx_binary", lambda: "/usr/sbin/nginx")
    monkeypatch.setattr(front_proxy, "_missing_modules", lambda _b: frozenset())
    became: list[list[str]] = []
    monkeypatch.setattr(cli.os, "execv", lambda path, argv: became.append([path, *argv]))
    args = ["front-proxy", "--listen", "0.0.0.0:8000", "--cert", str(p.cert), "--key", str(p.key),
            "--ca", str(p.ca), "--work", str(tmp_path / "front")]
    assert run_guarded(app, [*args, "--superlink", "superlink:9000"]) == 2
    assert "on loopback" in capsys.readouterr().err and not became
    assert run_guarded(app, [*args, "--superlink", "127.0.0.1:9000"]) == 0
    conf = tmp_path / "front" / "nginx.conf"
    assert became == [["/usr/sbin/nginx", "/usr/sbin/nginx", "-p", str(conf.parent), "-e", "stderr",
                       "-c", str(conf)]]
    assert "server 127.0.0.1:9000;" in conf.read_text()
