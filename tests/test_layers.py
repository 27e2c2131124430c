"""The architecture holds: layers, no import circle, one installed namespace.

import-linter checks the contracts in pyproject.toml (``[tool.importlinter]``) over the package
as the wheel lays it out (``fedsplit/<package>/...``): the checkout is copied into that layout
first, since the editable install resolves ``fedsplit.protocol`` through a search-path entry
that import-linter's graph builder does not follow.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protocol", "aggregation", "server", "client", "orchestration", "cli")
# Python sources of the project that import fedsplit's packages (the installed namespace only)
SOURCE_DIRS = (*PACKAGES, "tests", "bench", "docker", "fedsplit")
TOP_LEVEL_IMPORT = re.compile(rf"\b(?:from|import) ({'|'.join(PACKAGES)})(?:\.\w+)*\b(?! *[=(,:])")


def _wheel_layout(dest: Path) -> Path:
    namespace = dest / "fedsplit"
    namespace.mkdir(parents=True)
    shutil.copy2(ROOT / "fedsplit" / "__init__.py", namespace / "__init__.py")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, namespace / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.o"))
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def test_import_contracts_hold(tmp_path: Path) -> None:
    """Layers (cli > orchestration > server | client > aggregation > protocol), aggregation free
    of Flower and web frameworks, and no circle between sibling modules anywhere."""
    lint = Path(sys.executable).parent / "lint-imports"
    if not lint.exists():
        pytest.fail("import-linter is not installed: run `make setup` (it is in the dev extras)")
    tree = _wheel_layout(tmp_path / "layout")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([str(lint), "--no-cache"], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "broken" not in done.stdout.split("Contracts:")[-1].split("\n")[0].replace("0 broken", "")


def _python_files() -> list[Path]:
    files = []
    for folder in SOURCE_DIRS:
        files += [p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts]
    return files


def test_no_module_imports_a_bare_top_level_package() -> None:
    """Installed, fedsplit is importable only as ``fedsplit.*``: a bare top-level import of one of
    its packages (in code, or in code run from a string) works in a
    checkout's working directory and fails everywhere else, or imports a user's own ``server.py``."""
    found = []
    for path in _python_files():
        source = path.read_text()
        for node in ast.walk(ast.parse(source, str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [m.group(0) for m in TOP_LEVEL_IMPORT.finditer(node.value)
                         if "\n" in node.value or node.value.startswith(("import ", "from "))
                         or "; " in node.value]
                names = [n.split()[1] for n in names]
            else:
                continue
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: {name}" for name in names
                      if name.split(".")[0] in PACKAGES]
    assert not found, "import these through fedsplit.* instead:\n" + "\n".join(found)
