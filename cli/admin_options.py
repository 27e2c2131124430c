"""The options every ``fedsplit admin`` command that opens the store takes, defined once."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

SiteName = Annotated[str, typer.Argument(help="The site's name, as add-site registered it.")]
DataDir = Annotated[Path, typer.Option(help="The admin API's --data-dir.")]
DatabaseUrl = Annotated[
    str | None, typer.Option(envvar="FEDSPLIT_DATABASE_URL",
                             help="SQLAlchemy URL; default sqlite in --data-dir.")
]
AuditKeyFile = Annotated[
    Path | None,
    typer.Option(envvar="FEDSPLIT_AUDIT_KEY_FILE",
                 help="The audit log's HMAC key file (default: DATA_DIR/audit.key)."),
]
