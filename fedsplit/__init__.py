"""fedsplit: federated learning for hospitals.

Installed, every part of fedsplit lives under this one name (``fedsplit.protocol``,
``fedsplit.aggregation``, ``fedsplit.server``, ``fedsplit.client``, ``fedsplit.orchestration``,
``fedsplit.cli``), so nothing of it collides with a user's own ``server.py`` or ``client.py``.

The repository keeps those packages as top-level folders; the wheel maps them under ``fedsplit/``
at build time (hatch ``sources`` in pyproject.toml). In a source checkout (``make setup``'s
editable install) this file is the only thing in ``fedsplit/``, and it extends the package's
search path to the repository root so that ``fedsplit.protocol`` is ``<repo>/protocol``.
"""

from __future__ import annotations

from pathlib import Path

PACKAGES = ("protocol", "aggregation", "server", "client", "orchestration", "cli")

_here = Path(__file__).resolve().parent
if not (_here / "protocol").is_dir():  # a source checkout: the packages sit beside this folder
    _checkout = _here.parent
    if (_checkout / "protocol" / "__init__.py").is_file():
        __path__.append(str(_checkout))
