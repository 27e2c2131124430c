"""No module under server/ reaches into another object's private members (issue 34, item 5).

The round loop's merge steps and hooks (`server.secure.merge.SecureMerge`,
`server.privacy.PrivacyHook`) work through the round's public members (`server.bookkeeping`:
`Round`, `RoundReplies`), not through another object's underscored attributes. The check
parses every file under server/ and flags an attribute ``x._name`` (one leading underscore,
not a dunder) whose ``x`` is not ``self``, ``cls`` or ``super()``, and a ``from module import
_name``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVER = Path(__file__).resolve().parents[2] / "server"

#: (what the attribute is read on, attribute) pairs that are public API despite the underscore:
#: - ``os._exit``: the standard library's documented way for a forked child to end without
#:   running the parent's clean-up (server/admin/zygote.py, server/secure/unmask.py).
#: - ``grid._runtime_client``: Flower 1.42's ``HttpGrid`` connection to the SuperLink, which
#:   Flower's own ``pull_messages`` uses; it has no public way to pull a reply one object at a
#:   time (server/reply_pull.py, which pins what it uses in tests/server/test_reply_pull.py).
ALLOWED = {("os", "_exit"), ("grid", "_runtime_client")}

#: Uses in files another engineer owns right now, each with the public hook that replaces it;
#: the entry must go (with the alias it uses) once the file stops using it.
#: (none left)
PENDING: set[tuple[str, str]] = set()


def private_reaches(source: str) -> list[tuple[int, str]]:
    """(line, code) of each private member of another object that ``source`` uses."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            found += [(node.lineno, f"from {node.module} import {a.name}") for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
            continue
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        if (isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name)
                and owner.func.id == "super"):
            continue
        if isinstance(owner, ast.Name) and (owner.id, node.attr) in ALLOWED:
            continue
        found.append((node.lineno, ast.unparse(node)))
    return found


def _scan(root: Path) -> dict[tuple[str, str], list[int]]:
    uses: dict[tuple[str, str], list[int]] = {}
    for path in sorted(root.rglob("*.py")):
        for line, code in private_reaches(path.read_text()):
            uses.setdefault((path.relative_to(root).as_posix(), code), []).append(line)
    return uses


def test_server_uses_no_private_member_of_another_object() -> None:
    uses = _scan(SERVER)
    unexpected = {k: v for k, v in uses.items() if k not in PENDING}
    assert not unexpected, (
        "These server modules use private members of other objects; use (or add) a public "
        "hook instead (server/bookkeeping.py for the round loop's rounds): "
        + "; ".join(f"server/{f}:{lines} {code}" for (f, code), lines in sorted(unexpected.items())))
    if gone := PENDING - set(uses):
        pytest.fail(f"{sorted(gone)} no longer occur: remove them from PENDING")


def test_the_secure_merge_step_uses_no_private_member_of_another_class() -> None:
    source = (SERVER / "secure" / "merge.py").read_text()
    assert private_reaches(source) == []


@pytest.mark.parametrize(("code", "flagged"), [
    ("loop._skipped.pop(('train', 1))", ["loop._skipped"]),
    ("self.loop._site(msg, senders)", ["self.loop._site"]),
    ("from fedsplit.aggregation._blocks import _x", ["from fedsplit.aggregation._blocks import _x"]),
    ("self._runs.pop(1)", []),
    ("super()._check_and_log_replies(r)", []),
    ("os._exit(0)", []),
    ("obj.__class__", []),
])
def test_the_check_flags_what_it_should(code: str, flagged: list[str]) -> None:
    assert [c for _, c in private_reaches(code)] == flagged
