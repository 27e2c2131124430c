"""``fedsplit admin serve``: run the admin REST API with uvicorn."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from fedsplit.cli.admin_options import DatabaseUrl


def serve(
    data_dir: Annotated[Path, typer.Option(help="Database and stored files live here.")],
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8080,
    max_upload_mb: Annotated[float, typer.Option(help="Largest accepted weight file, MiB.")] = 1088.0,
    database_url: DatabaseUrl = None,
    runs: Annotated[
        list[Path] | None,
        typer.Option("--runs", help="Flower run out-dir, or a folder of them, shown at /ui (repeat)."),
    ] = None,
    tls_cert: Annotated[
        Path | None, typer.Option(help="PEM certificate (chain) to serve HTTPS with; needs --tls-key.")
    ] = None,
    tls_key: Annotated[Path | None, typer.Option(help="PEM private key of --tls-cert.")] = None,
    allowed_hosts: Annotated[
        list[str] | None,
        typer.Option("--allowed-hosts", envvar="FEDSPLIT_ALLOWED_HOSTS",
                     help="Host header value to answer (repeat; '*.example.org' for subdomains, '*' "
                     "for any; FEDSPLIT_ALLOWED_HOSTS: space-separated). Localhost is always "
                     "answered. Default: the bound address and localhost."),
    ] = None,
    min_model_sites: Annotated[
        int, typer.Option(help="Fewest hospitals an aggregate needs before a hospital may download it.")
    ] = 2,
    max_site_share: Annotated[
        float, typer.Option(min=0.01, max=1.0, help="Largest share of an aggregate's weight one other "
                            "hospital may hold for a hospital to download it (dominance rule).")
    ] = 0.6,
    min_own_share: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Smallest own share, as a fraction of an equal "
                            "share, a hospital needs to download an aggregate.")
    ] = 0.1,
    max_model_mb: Annotated[
        float, typer.Option(help="Largest model (decompressed) a round's first upload or template may "
                            "declare, MiB; later uploads: the round's model.")
    ] = 1024.0,
    site_quota_mb: Annotated[
        float, typer.Option(help="Bytes one hospital may hold in open rounds, MiB.")
    ] = 4096.0,
    site_concurrent_uploads: Annotated[
        int, typer.Option(min=1, help="Uploads one hospital may have in progress at once.")
    ] = 2,
    site_requests_per_minute: Annotated[
        int, typer.Option(min=1, help="Requests one hospital may make a minute.")
    ] = 600,
    audit_key_file: Annotated[
        Path | None,
        typer.Option(envvar="FEDSPLIT_AUDIT_KEY_FILE",
                     help="The audit log's HMAC key file, created (0600) on first start "
                     "(default: DATA_DIR/audit.key)."),
    ] = None,
    docs: Annotated[
        bool, typer.Option("--docs/--no-docs", help="Serve the API docs at /docs (from local files).")
    ] = True,
    forwarded_allow_ips: Annotated[
        list[str] | None,
        typer.Option("--forwarded-allow-ips", envvar="FEDSPLIT_FORWARDED_ALLOW_IPS",
                     help="Address of a proxy in front whose X-Forwarded-For is trusted (repeat, or "
                     "comma-separated; FEDSPLIT_FORWARDED_ALLOW_IPS). Default: none, so the address "
                     "rate limits and the audit log see is the connection's own."),
    ] = None,
    header_timeout: Annotated[
        float, typer.Option(min=0.1, help="Seconds a connection has to send a request's headers.")
    ] = 10.0,
    idle_timeout: Annotated[
        int, typer.Option(min=1, help="Seconds an idle keep-alive connection stays open.")
    ] = 5,
) -> None:
    """Serve the admin API; the admin token comes from FEDSPLIT_ADMIN_TOKEN(_FILE)."""
    import os

    import uvicorn
    from fedsplit.protocol.errors import ConfigError
    from fedsplit.server.admin.app import create_app
    from fedsplit.server.admin.config import AdminSettings
    from fedsplit.server.admin.connections import forwarded_settings, protocol_with
    from fedsplit.server.admin.limits import LOCAL_HOSTS, MAX_HEADER_BYTES, default_allowed_hosts
    from fedsplit.server.admin.ui import check_runs_dirs, view_url

    if (tls_cert is None) != (tls_key is None):
        raise ConfigError(
            "--tls-cert and --tls-key go together: give both to serve HTTPS, or neither for HTTP. "
            f"Received: --tls-cert {tls_cert}, --tls-key {tls_key}"
        )
    for option, path in (("--tls-cert", tls_cert), ("--tls-key", tls_key)):
        if path is not None and not path.is_file():
            raise ConfigError(
                f"{option} must be a readable PEM file (e.g. from `fedsplit certs`). Received: {path}"
            )
    https = tls_cert is not None
    # loopback names are always answered (health checks; a rebinding page never sends them)
    hosts = (tuple(dict.fromkeys([*allowed_hosts, *LOCAL_HOSTS])) if allowed_hosts
             else default_allowed_hosts(host))
    settings = AdminSettings.from_environ(
        os.environ,
        data_dir=data_dir, max_upload_mb=max_upload_mb, database_url=database_url,
        runs=tuple(check_runs_dirs(runs or [], warn=typer.echo)), allowed_hosts=hosts,
        min_model_sites=min_model_sites, max_site_share=max_site_share, min_own_share=min_own_share,
        max_model_mb=max_model_mb, site_quota_mb=site_quota_mb,
        site_concurrent_uploads=site_concurrent_uploads,
        site_requests_per_minute=site_requests_per_minute, audit_key_file=audit_key_file, docs=docs,
    )
    os.umask(0o077)  # every file the server writes (uploads, models, database): this user's only
    app = create_app(settings)
    scheme = "https" if https else "http"
    typer.echo(f"fedsplit admin API on {scheme}://{host}:{port} (docs: /docs), data in {data_dir}")
    typer.echo(f"web view: {view_url(host, port, https=https)} (sign in with the admin or a site token)")
    typer.echo(f"answering Host: {', '.join(hosts)} (--allowed-hosts)")
    forwarded = forwarded_settings(forwarded_allow_ips)
    typer.echo("trusting X-Forwarded-For from: "
               f"{', '.join(forwarded['forwarded_allow_ips']) or 'nobody'} (--forwarded-allow-ips)")
    # h11 with a bounded header buffer: a request whose headers exceed it is refused before
    # they are held in memory (the app refuses the same limit with 431); headers must arrive
    # within --header-timeout, idle connections close after --idle-timeout (server.admin.connections)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=10,
                http=protocol_with(header_timeout), h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                timeout_keep_alive=idle_timeout, **forwarded,
                ssl_certfile=str(tls_cert) if tls_cert else None,
                ssl_keyfile=str(tls_key) if tls_key else None)
