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
) -> None:
    """Serve the admin API; the admin token comes from FEDSPLIT_ADMIN_TOKEN(_FILE)."""
    import uvicorn

    from server.admin.app import create_app
    from server.admin.config import AdminSettings

    settings = AdminSettings.from_env(
        data_dir=data_dir, max_upload_mb=max_upload_mb, database_url=database_url
    )
    app = create_app(settings)
    typer.echo(f"fedsplit admin API on http://{host}:{port} (docs: /docs), data in {data_dir}")
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=10)
