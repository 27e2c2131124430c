"""One real uvicorn server on 127.0.0.1, driven over HTTP and by `fedsplit upload`."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from fedsplit.cli.app import app as fedsplit_app
from fedsplit.cli.errors import run_guarded
from fedsplit.protocol.errors import UploadFailedError
from fedsplit.server.admin.store import add_site

from tests._helpers.weight_files import raw_weights
from tests.admin.conftest import ADMIN, ADMIN_TOKEN, bearer, write_model

REPO = Path(__file__).resolve().parents[2]
# The `fedsplit admin` sub-app itself (cli.app imports every other command too, which is slow).
SERVE = (
    "import sys; from fedsplit.cli.admin import admin_app; from fedsplit.cli.errors import run_guarded; "
    "sys.exit(run_guarded(admin_app, sys.argv[1:]))"
)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """`fedsplit admin serve` in a subprocess; start, stop (graceful or SIGKILL), restart."""

    def __init__(self, data_dir: Path, tls: tuple[Path, Path] | None = None,
                 env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> None:
        self.data_dir = data_dir
        self.env = env or {}
        self.args = args
        self.port = free_port()
        self.tls = tls
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.verify: ssl.SSLContext | bool = True
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "FEDSPLIT_ADMIN_TOKEN": ADMIN_TOKEN, "PYTHONPATH": str(REPO), **self.env}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                SERVE,
                "serve",
                "--data-dir",
                str(self.data_dir),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--max-upload-mb",
                "2",
                *(["--tls-cert", str(self.tls[0]), "--tls-key", str(self.tls[1])] if self.tls else []),
                *self.args,
            ],
            env=env,
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 60
        # One client for the polls: a client per poll loads the CA bundle into a new SSL context
        # each time (about 0.7 s of this process's CPU per start, taken from the server starting).
        with httpx.Client(timeout=1, verify=self.verify) as poll:
            while time.monotonic() < deadline:  # bounded wait for /healthz
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited: {self.proc.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
                try:
                    if poll.get(f"{self.url}/healthz").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        raise RuntimeError("server did not answer /healthz within 60 s")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.proc.stderr.close()  # type: ignore[union-attr]
        self.proc = None


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LiveServer]:
    """A running admin API over a fresh data directory."""
    live = LiveServer(tmp_path / "data")
    live.start()
    yield live
    live.stop()


@pytest.mark.slow  # a fresh process or an end-to-end run: seconds (make test)
def test_live_server_end_to_end(server: LiveServer, tmp_path: Path, capsys, monkeypatch):
    """CLI add-site + upload, auth, a refusal, 413, 50 concurrent uploads, SIGKILL and restart."""
    # add-site prints the token alone on its last line
    code = run_guarded(
        fedsplit_app,
        ["admin", "add-site", "hospital-a", "--data-dir", str(server.data_dir), "--cohort-size", "500"],
    )
    assert code == 0
    token = capsys.readouterr().out.strip().splitlines()[-1]
    assert token.startswith("fss_")

    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.post("/api/v1/rounds", json={}).status_code == 401
        assert http.post("/api/v1/rounds", json={}, headers=bearer(token)).status_code == 403
        rnd = http.post("/api/v1/rounds", json={"strategy": "fedavg"}, headers=ADMIN).json()

        # fedsplit upload (token from the environment), --num-examples overriding the file's count
        path = write_model(tmp_path / "a.h5", 1.0, num_examples=10)
        monkeypatch.setenv("FEDSPLIT_SITE_TOKEN", token)
        code = run_guarded(
            fedsplit_app,
            [
                "upload",
                "--server",
                server.url,
                "--round",
                str(rnd["id"]),
                str(path),
                "--num-examples",
                "120",
            ],
        )
        out = capsys.readouterr().out
        assert code == 0, out
        assert f"sha256 {hashlib.sha256(path.read_bytes()).hexdigest()}" in out

        # a refused upload through the CLI (token from --token-file, which wins over the
        # environment): UploadFailedError's exit code and the server's detail
        monkeypatch.setenv("FEDSPLIT_SITE_TOKEN", "fss_not-a-token")
        token_file = tmp_path / "site.token"
        token_file.write_text(f"  {token}\n")
        bad = raw_weights(tmp_path / "bad.h5", lambda f, g: g.__setitem__("x", h5py_external()))
        code = run_guarded(
            fedsplit_app,
            ["upload", "--server", server.url, "--token-file", str(token_file), "--round",
             str(rnd["id"]), str(bad)],
        )
        assert code == UploadFailedError.exit_code
        assert "is an external link" in capsys.readouterr().err

        # over the 2 MiB limit: 413 from the declared length
        big = tmp_path / "big.h5"
        big.write_bytes(b"\0" * (3 * 1024 * 1024))
        with open(big, "rb") as fh:
            response = http.post(
                f"/api/v1/rounds/{rnd['id']}/uploads", files={"file": fh}, headers=bearer(token)
            )
        assert response.status_code == 413

        # 50 concurrent uploads from 50 sites, all stored with the right sha256
        many = http.post("/api/v1/rounds", json={"min_uploads": 50}, headers=ADMIN).json()
        tokens = {f"s{i}": add_site(data_dir=server.data_dir, name=f"s{i}") for i in range(50)}
        files = {
            name: write_model(tmp_path / f"{name}.h5", i / 10, num_examples=i + 1)
            for i, name in enumerate(tokens)
        }

        def send(name: str) -> tuple[int, str]:
            with open(files[name], "rb") as fh:
                r = httpx.post(
                    f"{server.url}/api/v1/rounds/{many['id']}/uploads",
                    files={"file": (f"{name}.h5", fh)},
                    headers=bearer(tokens[name]),
                    timeout=60,
                )
            return r.status_code, r.json().get("sha256", r.text)

        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=50) as pool:
            results = dict(zip(tokens, pool.map(send, tokens), strict=True))
        elapsed = time.perf_counter() - started
        print(f"50 concurrent uploads: {elapsed:.2f} s")
        want = {n: hashlib.sha256(files[n].read_bytes()).hexdigest() for n in tokens}
        assert results == {n: (201, want[n]) for n in tokens}
        metrics = http.get("/metrics", headers=ADMIN).text
        assert "fedsplit_uploads_accepted_total 51" in metrics
        assert 'fedsplit_uploads_refused_total{reason="link"} 1' in metrics
        assert 'fedsplit_uploads_refused_total{reason="too_large"} 1' in metrics

    # crash (SIGKILL) and restart: every acknowledged upload is still there, nothing partial
    server.stop(signal.SIGKILL)
    server.start()
    with httpx.Client(base_url=server.url, timeout=30) as http:
        stored = http.get(f"/api/v1/rounds/{many['id']}", headers=ADMIN).json()["uploads"]
        assert {u["site"]: u["sha256"] for u in stored} == want
        first = http.get(f"/api/v1/rounds/{rnd['id']}", headers=ADMIN).json()["uploads"]
        assert [(u["site"], u["num_examples"]) for u in first] == [("hospital-a", 120)]
        aggregated = http.post(f"/api/v1/rounds/{many['id']}/aggregate", headers=ADMIN)
        assert aggregated.status_code == 200
        assert aggregated.json()["num_examples"] == sum(range(1, 51))


def h5py_external():
    """An external link into a file of the server's (refused before it is followed)."""
    import h5py

    return h5py.ExternalLink("/etc/passwd", "/")


def test_https_server_and_upload_with_the_ca(tmp_path: Path, capsys, monkeypatch) -> None:
    """`admin serve --tls-cert/--tls-key` serves HTTPS; `upload --root-cert` verifies it with the CA."""
    assert run_guarded(fedsplit_app, ["certs", "--out", str(tmp_path / "certs"), "--sites", "0"]) == 0
    certs = tmp_path / "certs"
    live = LiveServer(tmp_path / "data", tls=(certs / "server.pem", certs / "server.key"))
    live.verify = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    live.start()
    try:
        token = add_site(data_dir=live.data_dir, name="hospital-a", cohort_size=None)
        with pytest.raises(httpx.ConnectError):  # the system CAs do not know the test CA
            httpx.get(f"{live.url}/healthz", timeout=5)
        with httpx.Client(base_url=live.url, timeout=30, verify=live.verify) as http:
            rnd = http.post("/api/v1/rounds", json={"strategy": "fedavg"}, headers=ADMIN).json()
        path = write_model(tmp_path / "a.h5", 1.0, num_examples=10)
        monkeypatch.setenv("FEDSPLIT_SITE_TOKEN", token)
        args = ["upload", "--server", live.url, "--round", str(rnd["id"]), str(path)]
        assert run_guarded(fedsplit_app, args) == UploadFailedError.exit_code  # unverified: refused
        capsys.readouterr()
        assert run_guarded(fedsplit_app, [*args, "--root-cert", str(certs / "ca.crt")]) == 0
        assert f"sha256 {hashlib.sha256(path.read_bytes()).hexdigest()}" in capsys.readouterr().out
        assert run_guarded(fedsplit_app, [*args, "--root-cert", str(tmp_path / "missing.crt")]) == 2
    finally:
        live.stop()


def test_serve_refuses_half_a_tls_pair(tmp_path: Path, capsys) -> None:
    """--tls-cert without --tls-key is a ConfigError naming both options."""
    code = run_guarded(fedsplit_app, ["admin", "serve", "--data-dir", str(tmp_path),
                                      "--tls-cert", str(tmp_path / "x.pem")])
    assert code == 2
    assert "--tls-cert and --tls-key go together" in capsys.readouterr().err
