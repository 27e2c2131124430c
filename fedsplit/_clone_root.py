"""Repair ``fedsplit`` when a clone's folder named ``fedsplit`` shadowed it (see ``__init__.py``).

Not imported: each package's ``__init__`` runs this file by path (`runpy.run_path`) when ``from
fedsplit import only_as_fedsplit`` fails, and calls `adopt` with its own ``__file__``.
"""

from __future__ import annotations


def adopt(package_file: str) -> None:
    """Run the clone's ``fedsplit/__init__.py`` into the empty namespace package ``fedsplit``
    that Python made of the clone's folder, and point its ``__path__`` at ``fedsplit/``; any
    other cause of the ImportError being handled is raised again as it was."""
    import sys
    from pathlib import Path

    root = sys.modules.get("fedsplit")
    if root is None or getattr(root, "__file__", "") is not None:
        raise  # the ImportError the calling package is handling
    root.__file__ = str(Path(package_file).resolve().parents[1] / "fedsplit" / "__init__.py")
    root.__path__ = [str(Path(root.__file__).parent)]
    exec(compile(Path(root.__file__).read_text(), root.__file__, "exec"), vars(root))
