"""Every environment variable is read where a process starts (docs/settings.md).

The library code (what a command, the ServerApp, a ClientApp or the admin service calls) takes
its settings passed in; only the modules listed in `ENTRY_POINTS` touch ``os.environ``: the
command-line entry points, the ServerApps' main functions, the launchers, and the few that
hand the environment on to a child process they start. The test reads the source (AST), so a
read hidden in a helper, an ``os.getenv`` or a ``from os import environ`` is found too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the installed packages (fedsplit.<package>)
PACKAGES = ("aggregation", "cli", "client", "orchestration", "protocol", "server", "fedsplit")

#: module -> why it may read the environment
ENTRY_POINTS: dict[str, str] = {
    "cli/__init__.py": "the console script: the BLAS/OpenMP thread variables, before numpy loads",
    "cli/aggregate.py": "fedsplit aggregate: BackendSettings.from_environ, once",
    "cli/admin_serve.py": "fedsplit admin serve: AdminSettings.from_environ, once",
    "cli/superexec.py": "fedsplit superexec: FLWR_HOME",
    "cli/upload.py": "fedsplit upload: the site token",
    "server/app.py": "the horizontal ServerApp's main: BackendSettings, the unmasking workers",
    "server/survival/app.py": "the survival ServerApp's main: the unmasking workers",
    "orchestration/app_launcher.py": "the flwr-clientapp/flwr-serverapp launchers' main: FLWR_HOME",
    "client/parallel/launch.py": "a site-parallel training worker's entry: OMP_NUM_THREADS",
    "aggregation/_ckernels.py": "where the compiled kernels are cached (FEDSPLIT_KERNEL_DIR, "
                                "XDG_CACHE_HOME): the build cache, read when a process first "
                                "builds or loads them (and by make setup's build, its main)",
    "orchestration/flower_runtime.py": "hands the environment on to the Flower processes it starts",
    "orchestration/watchdog.py": "hands the environment on to the watchdog process it starts",
    "server/admin/sandbox.py": "hands the environment on to the upload sandbox it starts",
}


def environment_reads(tree: ast.AST) -> list[int]:
    """Lines of ``tree`` that touch the process environment: ``os.environ`` (any use: a read, a
    copy, ``setdefault``), ``os.getenv``/``os.getenvb``, ``from os import environ``/``getenv``."""
    names = ("environ", "environb", "getenv", "getenvb")
    lines = []
    for node in ast.walk(tree):
        attribute = (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                     and node.value.id == "os" and node.attr in names)
        imported = (isinstance(node, ast.ImportFrom) and node.module == "os"
                    and any(alias.name in names for alias in node.names))
        if attribute or imported:
            lines.append(node.lineno)
    return sorted(lines)


def modules() -> dict[str, ast.AST]:
    """Every module of the installed packages, by its path in the checkout."""
    found = {}
    for package in PACKAGES:
        # fedsplit/ holds the links to the packages (fedsplit/protocol -> ../protocol): its own files only
        paths = (ROOT / package).glob("*.py") if package == "fedsplit" else (ROOT / package).rglob("*.py")
        for path in sorted(paths):
            if "__pycache__" in path.parts:
                continue
            rel = path.relative_to(ROOT).as_posix()
            found[rel] = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
    return found


def test_the_environment_is_read_only_where_a_process_starts() -> None:
    reads = {rel: lines for rel, tree in modules().items() if (lines := environment_reads(tree))}
    outside = {rel: lines for rel, lines in reads.items() if rel not in ENTRY_POINTS}
    assert not outside, (
        "these modules read the environment, but only a process's entry point may (pass the "
        "setting in from there, and list the variable in docs/settings.md): "
        + "; ".join(f"{rel} line(s) {lines}" for rel, lines in sorted(outside.items())))
    stale = sorted(set(ENTRY_POINTS) - set(reads))
    assert not stale, f"listed as reading the environment, but they do not: {stale}"


def test_the_check_finds_every_form_of_read() -> None:
    source = ("import os\nfrom os import getenv\nx = os.environ['A']\ny = os.getenv('B')\n"
              "z = dict(os.environ)\nos.environ.setdefault('C', '1')\nw = 1\n")
    assert environment_reads(ast.parse(source)) == [2, 3, 4, 5, 6]
    assert environment_reads(ast.parse("import os\nhome = os.path.expanduser('~')\n")) == []


def test_every_variable_read_is_in_the_settings_table() -> None:
    """docs/settings.md lists every FEDSPLIT_* variable the packages name."""
    import re

    table = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    named = set()
    for package in PACKAGES:
        for path in (ROOT / package).glob("*.py" if package == "fedsplit" else "**/*.py"):
            named |= set(re.findall(r"\bFEDSPLIT_[A-Z0-9_]+\b", path.read_text(encoding="utf-8")))
    named -= {"FEDSPLIT_FORMAT"}  # a download format's name (server/admin), not a variable
    missing = sorted(v for v in named if f"`{v}`" not in table)
    assert not missing, f"docs/settings.md does not list {missing}"
