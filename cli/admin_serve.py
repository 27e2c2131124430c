"""``fedsplit admin serve``: run the admin REST API with uvicorn."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def serve(
    data_dir: Annotated[Path, typer.Option(help="Database and stored files live here.")],
    host: Annotated[str, typer.Option(help="Interface to bind (put a TLS proxy in front).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8080,
    max_upload_mb: Annotated[float, typer.Option(help="Largest accepted weight file, MiB.")] = 512.0,
    database_url: Annotated[
        str | None, typer.Option(help="SQLAlchemy URL; default sqlite in --data-dir.")
    ] = None,
    runs: Annotated[
        list[Path] | None,
        typer.Option("--runs", help="Flower run out-dir, or a folder of them, shown at /ui (repeat)."),
    ] = None,
) -> None:
    """Serve the admin API; the admin token comes from FEDSPLIT_ADMIN_TOKEN(_FILE)."""
    import uvicorn

    from server.admin.app import create_app
    from server.admin.config import AdminSettings
    from server.admin.ui import check_runs_dirs, view_url

    settings = AdminSettings.from_env(
        data_dir=data_dir, max_upload_mb=max_upload_mb, database_url=database_url,
        runs=tuple(check_runs_dirs(runs or [], warn=typer.echo)),
    )
    app = create_app(settings)
    typer.echo(f"fedsplit admin API on http://{host}:{port} (docs: /docs), data in {data_dir}")
    typer.echo(f"web view: {view_url(host, port)} (sign in with the admin or a site token)")
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=10)
