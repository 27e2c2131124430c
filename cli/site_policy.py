"""``fedsplit site policy FILE``: check a hospital's policy file and print the policy in force."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def policy(
    file: Annotated[Path | None, typer.Argument(help="The hospital's policy file (TOML, or JSON "
                                                     "by its suffix); none: the defaults.")] = None,
) -> None:
    """Check a hospital's policy file and print the policy in force.

    Every field is printed, ``# default`` marking one the file does not set; a bad file is one
    line naming the field and the fix (exit 2)."""
    from fedsplit.protocol.site_policy import SitePolicy

    loaded = SitePolicy.load(file)
    given = loaded.model_fields_set
    source = f"# {file}" if file is not None else "# no policy file: the defaults"
    lines = [f"{source} (docs/privacy.md, \"Hospital policy\")"]
    tables = []
    for name, value in loaded.model_dump(mode="json").items():
        mark = "" if name in given else "  # default"
        if isinstance(value, dict):
            tables.append((name, value, mark))
        elif value is None:
            lines.append(f"# {name}: not set{mark.replace('  #', ';')}")
        else:
            lines.append(f"{name} = {_toml(value)}{mark}")
    for name, value, mark in tables:
        lines += ["", f"[{name}]{mark}"]
        lines += [f"{k} = {_toml(v)}" for k, v in value.items()]
    typer.echo("\n".join(lines))
