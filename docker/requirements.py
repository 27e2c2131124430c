"""Print what the fedsplit image installs, one requirement a line, from pyproject.toml.

    python3 docker/requirements.py [PYPROJECT] > requirements.txt

The image (docker/Dockerfile) and `make wheelhouse` both read this list, so the wheelhouse holds
exactly what the image installs: torch (TORCH_VERSION, default 2.13.0) first, fedsplit's runtime
dependencies, and hatchling (fedsplit itself is built from source in the image without network).
Flower comes without its `simulation` extra: the containers run Flower's deployment runtime, and
the simulation engine (ray, about 250 MB installed) would only grow the image; `fedsplit simulate`
runs outside containers. openmined-psi is installed separately with --no-deps (its protobuf pin
breaks Flower's gRPC stack; see Makefile), so it is not in this list.
"""

from __future__ import annotations

import os
import re
import sys
import tomllib
from pathlib import Path

BUILD_REQUIREMENTS = ("hatchling",)
# extras the image leaves out, per distribution (see the module docstring)
DROPPED_EXTRAS = {"flwr": "simulation"}


def _drop_extras(requirement: str) -> str:
    """`flwr[simulation]==1.42.0` -> `flwr==1.42.0` for the extras in DROPPED_EXTRAS."""
    match = re.match(r"^\s*([A-Za-z0-9_.-]+)\[([^\]]*)\](.*)$", requirement)
    if not match or match.group(1).lower() not in DROPPED_EXTRAS:
        return requirement
    name, extras, rest = match.groups()
    kept = [e.strip() for e in extras.split(",") if e.strip() != DROPPED_EXTRAS[name.lower()]]
    return f"{name}[{','.join(kept)}]{rest}" if kept else f"{name}{rest}"


def requirements(pyproject: Path, torch_version: str) -> list[str]:
    """torch pinned to `torch_version`, then the runtime dependencies, then the build backend."""
    project = tomllib.loads(pyproject.read_text())["project"]
    deps = [d for d in project["dependencies"] if not d.replace(" ", "").lower().startswith("torch")]
    return [f"torch=={torch_version}", *(_drop_extras(d) for d in deps), *BUILD_REQUIREMENTS]


def main(argv: list[str]) -> int:
    """Print the list for the pyproject.toml in argv[1] (default: the repository's)."""
    pyproject = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1] / "pyproject.toml"
    if not pyproject.is_file():
        print(f"requirements: no pyproject.toml at {pyproject}: pass the repository's. Received: {pyproject}",
              file=sys.stderr)
        return 2
    print("\n".join(requirements(pyproject, os.environ.get("TORCH_VERSION", "2.13.0"))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
