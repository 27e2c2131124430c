"""The architecture holds: layers, no import circle, one installed namespace.

import-linter checks the contracts in pyproject.toml (``[tool.importlinter]``) on the checkout as
it is: ``fedsplit/`` holds one relative symbolic link per package (``fedsplit/protocol ->
../protocol``), so ``fedsplit.*`` is a folder tree that import-linter's graph builder walks.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fedsplit

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protocol", "aggregation", "server", "client", "orchestration", "cli")
# Python sources of the project that import fedsplit's packages (the installed namespace only)
SOURCE_DIRS = (*PACKAGES, "tests", "bench", "docker", "fedsplit")
TOP_LEVEL_IMPORT = re.compile(rf"\b(?:from|import) ({'|'.join(PACKAGES)})(?:\.\w+)*\b(?! *[=(,:])")


def _clean_env() -> dict[str, str]:
    """The environment without PYTHONPATH: only the checkout's own install finds fedsplit."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_import_contracts_hold() -> None:
    """Layers (cli > orchestration > server | client > aggregation > protocol), aggregation free
    of Flower and web frameworks, and no circle between sibling modules anywhere, read from the
    checkout as it is (no copy)."""
    lint = Path(sys.executable).parent / "lint-imports"
    if not lint.exists():
        pytest.fail("import-linter is not installed: run `make setup` (it is in the dev extras)")
    done = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, env=_clean_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "broken" not in done.stdout.split("Contracts:")[-1].split("\n")[0].replace("0 broken", "")
    # the graph holds every module of the checkout, not only fedsplit/__init__.py
    analyzed = re.search(r"Analyzed (\d+) files", done.stdout)
    modules = sum(1 for p in PACKAGES for f in (ROOT / p).rglob("*.py") if "__pycache__" not in f.parts)
    assert analyzed and int(analyzed.group(1)) >= modules, (done.stdout[-2000:], modules)


def test_the_namespace_links_every_package() -> None:
    """fedsplit/<package> is a relative link to the top-level folder, for each package."""
    assert fedsplit.PACKAGES == PACKAGES
    for package in PACKAGES:
        link = ROOT / "fedsplit" / package
        assert link.is_symlink(), f"{link} should be a symbolic link to ../{package}"
        assert os.readlink(link) == f"../{package}", os.readlink(link)
        assert link.resolve() == (ROOT / package).resolve()


@pytest.mark.parametrize("where", ["outside", "checkout"])
def test_a_bare_package_name_is_not_a_second_module(where: str, tmp_path: Path) -> None:
    """The bare name ``protocol.errors`` does not import (outside the checkout: not found; in the
    checkout's root, where Python finds the folder itself: refused, saying what to import), so
    each file is one module object and there is one ``ConfigError`` class."""
    probe = (
        "import json, fedsplit.protocol.errors as real\n"
        "out = {'real': real.__file__}\n"
        "for name in ('protocol.errors', 'server', 'aggregation', 'cli'):\n"
        "    try:\n"
        "        __import__(name)\n"
        "        out[name] = 'imported'\n"
        "    except ImportError as exc:\n"
        "        out[name] = str(exc)\n"
        "print(json.dumps(out))\n"
    )
    cwd = tmp_path if where == "outside" else ROOT
    done = subprocess.run([sys.executable, "-c", probe], cwd=cwd, env=_clean_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(out.pop("real")).resolve().is_relative_to(ROOT.resolve())
    for name, result in out.items():
        top = name.split(".")[0]
        assert result != "imported", f"`import {name}` from {cwd} loaded a second copy"
        if where == "outside":
            assert result == f"No module named {top!r}", result
        else:
            assert f"import fedsplit.{top}" in result, result


def _python_files() -> list[Path]:
    files = []
    for folder in SOURCE_DIRS:
        files += [p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts]
    return files


def _imports_in_code(text: str) -> list[str] | None:
    """The modules a string of Python code imports (``import a, b``); None if it is not code."""
    if "import " not in text:
        return None
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


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
                parsed = _imports_in_code(node.value)
                if parsed is not None:  # code: its import statements, exactly
                    names = parsed
            else:
                continue
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: {name}" for name in names
                      if name.split(".")[0] in PACKAGES]
    assert not found, "import these through fedsplit.* instead:\n" + "\n".join(found)
