"""The coordinator's public port: Debian's nginx in front of the SuperLink, Fleet API only.

Flower 1.42's SuperLink serves its Fleet API (``/v1/fleet/*``: SuperNodes), its Control API
(``/v1/control/*``: ``flwr run``, ``ls``, ``log``, ``stop``, ``supernode register``) and its
Runtime API (``/v1/runtime/*``: the SuperExec and the ServerApp) on one HTTP(S) port, and the
open-source SuperLink authenticates nobody on the Control API. So the SuperLink listens on the
coordinator's loopback only (an internal port), and this proxy is what the network sees:

- it terminates TLS on the public port with the SuperLink's own certificate (hospitals keep
  verifying it with ``ca.crt``), and forwards ``POST /v1/fleet/*`` and ``GET /health``, re-encrypted,
  to the loopback SuperLink (verifying its certificate against the same CA);
- everything else (Control, Runtime, ``/docs``, ``/openapi.json``, any other path) is answered
  ``403`` with one line saying the Control API is only for the operator on the coordinator host.

Hospitals still authenticate to the SuperLink itself (``--enable-supernode-auth``: a registered
key signs every Fleet request; the proxy passes the headers through unchanged). The operator's
credential is a login on the coordinator host: ``flwr`` there talks to the loopback port
(remote operators tunnel to it with ``ssh -L``). nginx runs as the invoking user with a config
written under WORK (pid, temp paths, logs: nothing under /etc or /var), in the foreground
(``daemon off``), so `LocalFederation` and a container supervise it like any other process.

No fedsplit code handles the traffic: nginx does, from Debian's ``nginx-light`` package.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from fedsplit.protocol.errors import ConfigError

#: The one line every refused request gets (HTTP 403).
REFUSAL = ("fedsplit: this port serves hospitals' SuperNodes only (Flower Fleet API); the "
           "Control and Runtime APIs are only for the operator, on the coordinator host "
           "(docs/deployment.md, section Ports)")
#: Largest request body forwarded: Flower sends arrays in 5 MB objects and a FAB is at most
#: 10 MB; a recipe's single record could be larger, so the bound is generous.
MAX_BODY = "512m"
#: Read/send timeouts towards hospitals and the SuperLink (a Fleet request is a unary POST;
#: Flower's own client gives up after 30 s, so this never cuts a live one).
TIMEOUT_S = 300
#: The name on the SuperLink's certificate the proxy checks when it connects to the loopback
#: port (`fedsplit certs` always puts localhost and 127.0.0.1 on it; nginx matches DNS names).
UPSTREAM_NAME = "localhost"
INSTALL_HINT = "apt-get install nginx-light (Debian's nginx; nginx-full or nginx also do)"


def nginx_binary() -> str:
    """The nginx executable (PATH, then /usr/sbin, where Debian puts it and a non-root PATH
    often does not look); a `ConfigError` naming the package when there is none."""
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
    if found is None:
        raise ConfigError(f"The coordinator's public port is served by nginx, which is not "
                          f"installed: {INSTALL_HINT}. Received: no nginx on PATH or in /usr/sbin")
    return found


@lru_cache(maxsize=4)
def _missing_modules(binary: str) -> frozenset[str]:
    """The temp-path modules this nginx build was configured without (``nginx -V``)."""
    try:
        done = subprocess.run([binary, "-V"], capture_output=True, text=True, timeout=30,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return frozenset()
    text = done.stdout + done.stderr
    return frozenset(m for m in ("fastcgi", "uwsgi", "scgi")
                     if f"--without-http_{m}_module" in text)


@dataclass(frozen=True)
class FrontProxy:
    """What the proxy serves: its public ``listen`` address (HOST:PORT), the loopback
    SuperLink it forwards to (``superlink``, HOST:PORT), the certificate and key it presents
    (the SuperLink's) and the CA it checks the SuperLink against."""

    listen: str
    superlink: str
    cert: Path
    key: Path
    ca: Path
    max_body: str = MAX_BODY
    timeout_s: int = TIMEOUT_S
    access_log: Path | None = None  # default: WORK/access.log

    def config(self, work: Path, *, missing_modules: frozenset[str] = frozenset()) -> str:
        """The nginx configuration; every path nginx writes lies under ``work`` (or is
        ``access_log``). Errors go to stderr; the access log records refused or failed requests
        only, not every Fleet poll (a file: a non-root nginx may not reopen /dev/stdout)."""
        tmp = work / "tmp"
        access_log = self.access_log or work / "access.log"
        temp_paths = "\n".join(
            f"    {module}_temp_path {tmp / module};"
            for module in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
            if module not in missing_modules)
        refusal = REFUSAL.replace("\\", "\\\\").replace('"', '\\"')
        return f"""# fedsplit front proxy (orchestration/front_proxy.py): rewritten at every start.
# Public: {self.listen} (TLS) -> Fleet API and /health only -> SuperLink {self.superlink} (TLS).
# Refused and failed requests: {access_log}
daemon off;
worker_processes auto;
pid {work / "nginx.pid"};
error_log stderr warn;

events {{
    worker_connections 1024;
}}

http {{
    server_tokens off;
{temp_paths}
    map $status $refused {{
        ~^[23] 0;
        default 1;
    }}
    log_format front '$remote_addr [$time_local] "$request" $status $body_bytes_sent '
                     '$request_time';
    access_log {access_log} front if=$refused;

    upstream superlink {{
        server {self.superlink};
        keepalive 16;
    }}

    server {{
        listen {self.listen} ssl;
        ssl_certificate {self.cert};
        ssl_certificate_key {self.key};
        ssl_protocols TLSv1.2 TLSv1.3;
        ssl_session_cache shared:front:1m;

        client_max_body_size {self.max_body};
        client_body_timeout {self.timeout_s}s;
        send_timeout {self.timeout_s}s;
        proxy_request_buffering off;
        proxy_buffering off;
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_connect_timeout 10s;
        proxy_read_timeout {self.timeout_s}s;
        proxy_send_timeout {self.timeout_s}s;
        proxy_ssl_verify on;
        proxy_ssl_verify_depth 2;
        proxy_ssl_trusted_certificate {self.ca};
        proxy_ssl_name {UPSTREAM_NAME};
        proxy_ssl_server_name on;
        proxy_ssl_session_reuse on;
        default_type text/plain;

        # Hospitals' SuperNodes: Flower's Fleet API (every call a POST; node auth is the
        # SuperLink's). The URI forwarded is nginx's normalized one (dot segments resolved).
        location /v1/fleet/ {{
            limit_except POST {{
                deny all;
            }}
            proxy_pass https://superlink/v1/fleet/;
        }}
        location = /health {{
            limit_except GET {{
                deny all;
            }}
            proxy_pass https://superlink/health;
        }}
        # Control API, Runtime API, /docs, /openapi.json and anything else.
        location / {{
            return 403 "{refusal}\\n";
        }}
    }}
}}
"""

    def write(self, work: Path, *, binary: str | None = None) -> Path:
        """Write ``work/nginx.conf`` (and make its temp folders); return its path."""
        binary = binary or nginx_binary()
        for path in (self.cert, self.key, self.ca):
            if not path.is_file():
                raise ConfigError(f"The front proxy needs the SuperLink's certificate, key and "
                                  f"CA (fedsplit certs). Received: {path} does not exist")
        work = work.resolve()
        (work / "tmp").mkdir(parents=True, exist_ok=True)
        conf = work / "nginx.conf"
        conf.write_text(self.config(work, missing_modules=_missing_modules(binary)))
        return conf

    def command(self, work: Path) -> list[str]:
        """Write the configuration under ``work`` and return the nginx command that serves it
        in the foreground (as the invoking user)."""
        binary = nginx_binary()
        conf = self.write(work, binary=binary)
        return [binary, "-p", str(conf.parent), "-e", "stderr", "-c", str(conf)]
