"""README.md stays short, and every command in it runs as written.

Every line of the README's ``bash`` blocks is extracted. A ``make`` line must name a target of
the Makefile; a ``fedsplit`` line (or ``.venv/bin/fedsplit``) is parsed by the real command tree,
every option and value checked by click as a run would check them, without running it (the
demo itself runs in the end-to-end tests).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest
import typer
from fedsplit.cli.app import app

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _commands() -> list[str]:
    lines, block = [], None
    for raw in README.read_text().splitlines():
        if raw.startswith("```"):
            block = raw[3:].strip() if block is None else None
            continue
        if block == "bash" and raw.strip():
            lines.append(raw.split("  #")[0].split(" # ")[0].strip())
    return lines


def _parse(args: list[str]) -> None:
    """Build the click contexts for ``fedsplit ARGS`` down to the leaf command: every option,
    argument and value is converted and checked, nothing is invoked."""
    command: click.Command = typer.main.get_command(app)
    parent, name = None, "fedsplit"
    while True:
        ctx = command.make_context(name, list(args), parent=parent)
        if not isinstance(command, click.Group):
            return
        rest = [*ctx._protected_args, *ctx.args]
        name, sub, args = command.resolve_command(ctx, rest)
        assert sub is not None, f"no command {rest[:1]}"
        command, parent = sub, ctx


def test_readme_is_read_in_five_minutes() -> None:
    assert len(README.read_text().splitlines()) < 200


def test_readme_names_two_commands_first() -> None:
    text = README.read_text()
    first = text.index("## The two commands")
    block = text[first:].split("```bash", 1)[1].split("```", 1)[0]
    assert [line.split()[:2] for line in block.strip().splitlines()] == [["make", "demo"],
                                                                         ["make", "test"]]


@pytest.mark.parametrize("line", _commands())
def test_every_readme_command_runs_as_written(line: str) -> None:
    words = shlex.split(line)
    if words[0] == "make":
        targets = set(re.findall(r"(?m)^([\w-]+):", (ROOT / "Makefile").read_text()))
        assert set(words[1:]) <= targets, f"{line!r}: no such make target"
        return
    assert words[0] in ("fedsplit", ".venv/bin/fedsplit"), f"{line!r}: not checked by this test"
    try:
        _parse(words[1:])
    except click.ClickException as e:
        pytest.fail(f"{line!r} does not parse: {e.format_message()}")


def test_readme_links_point_at_files() -> None:
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text()):
        if target.startswith("http"):
            continue
        assert (ROOT / target).exists(), f"README links to {target}, which does not exist"
