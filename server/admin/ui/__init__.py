"""The operator's web view at ``/ui``: federations, rounds and every hospital's status.

Served by the admin API itself (same process, port and tokens). `install_ui` adds it to an app:

- ``routes``: sign-in/out and the pages (server-rendered Jinja2, inline SVG charts);
- ``sessions``: server-side sessions (the cookie holds a random id, never the token);
- ``rest`` / ``runs``: view-models of REST rounds (read through the admin's services, as the
  API reads them) and Flower runs (the ``history.json`` files under ``--runs`` folders);
  ``siterows``: one hospital in one round;
- ``activity``: the event feed; ``curves`` / ``charts``: metric curves as SVG;
- ``templates/`` and ``static/`` (one stylesheet, one small script that polls with ETags).

See docs/web-view.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI
from fastapi.templating import Jinja2Templates
from fedsplit.protocol.errors import ConfigError
from fedsplit.server.admin.ui.pages import UIError, handle_ui_error, make_templates
from fedsplit.server.admin.ui.routes import router
from fedsplit.server.admin.ui.runs import RunCatalog
from fedsplit.server.admin.ui.sessions import SessionStore

UI_PATH = "/ui"


@dataclass
class UIState:
    """What the web view keeps per process."""

    sessions: SessionStore
    catalog: RunCatalog
    templates: Jinja2Templates


def install_ui(app: FastAPI, *, runs: list[Path] | tuple[Path, ...] = ()) -> None:
    """Serve the web view on ``app`` (after ``app.state.admin`` is set); ``runs``: ``--runs`` folders."""
    app.state.ui = UIState(sessions=SessionStore(), catalog=RunCatalog(list(runs)),
                           templates=make_templates())
    app.add_exception_handler(UIError, handle_ui_error)
    app.include_router(router)


def check_runs_dirs(dirs: list[Path], *, warn: Callable[[str], object]) -> list[Path]:
    """Validate ``--runs`` folders: a file is refused; a missing folder is kept with a warning."""
    checked = []
    for folder in dirs:
        folder = Path(folder).expanduser().resolve()
        if folder.exists() and not folder.is_dir():
            raise ConfigError(
                "--runs takes a folder: a run's out-dir (holding history.json, or federation/ with "
                f"it) or a folder of such out-dirs. Received: the file {folder}"
            )
        if not folder.exists():
            warn(f"note: --runs {folder} does not exist yet; runs written there later are shown")
        checked.append(folder)
    return checked


def view_url(host: str, port: int, *, https: bool = False) -> str:
    """The URL the CLI prints for the view."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else (f"[{host}]" if ":" in host else host)
    return f"{'https' if https else 'http'}://{shown}:{port}{UI_PATH}"
