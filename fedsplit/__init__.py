"""fedsplit: federated learning for hospitals.

Installed, every part of fedsplit lives under this one name (``fedsplit.protocol``,
``fedsplit.aggregation``, ``fedsplit.server``, ``fedsplit.client``, ``fedsplit.orchestration``,
``fedsplit.cli``), so nothing of it collides with a user's own ``server.py`` or ``client.py``.

The repository keeps those packages as top-level folders; ``fedsplit/`` holds this file and one
relative symbolic link per package (``fedsplit/protocol -> ../protocol``), so the checkout *is* the
installed layout: the wheel follows the links (hatchling), ``make setup``'s editable install
exposes only the name ``fedsplit`` (hatch ``dev-mode-exact``), and import-linter reads
``fedsplit.*`` from the checkout as it is. Each package refuses to be imported under its bare
folder name (``protocol`` rather than ``fedsplit.protocol``), which would load every file a
second time as another module.

Python started in the folder that holds a clone named ``fedsplit`` finds the clone's folder (no
``__init__.py``) before the editable install's import hook and makes an empty namespace package
``fedsplit`` of it. The first package imported under it then runs this file into that module
and points its ``__path__`` at this folder (``_clone_root.py``, run by path from the ``except
ImportError`` in each package's ``__init__``), so ``python -c "from fedsplit.client.models
import ..."`` works there too.
"""

from __future__ import annotations

PACKAGES = ("protocol", "aggregation", "server", "client", "orchestration", "cli")


def only_as_fedsplit(name: str) -> None:
    """Refuse a package imported by its bare folder name (``protocol`` instead of ``fedsplit.protocol``).

    Called at the end of each package's ``__init__``: run from the repository root, Python can
    find ``protocol/`` on its own, and the copy it imports would hold a second ``ConfigError``
    class that an ``except fedsplit.protocol.ConfigError`` does not catch.
    """
    if not name.startswith("fedsplit."):
        raise ImportError(
            f"{name!r} is fedsplit's package 'fedsplit.{name}': import it as `import fedsplit.{name}` "
            f"(the bare name would load a second copy of every module beside the installed one)",
            name=name,
        )
