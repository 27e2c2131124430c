"""The simulated hospitals' roster: their names and data fingerprints, in a file beside their data.

Flower's simulation engine ships the run config with every message, to the hospital and back
(a Ray actor call carries the whole `Context`). Two of its values grow with the hospitals: the
names by partition-id (``site-names``) and each hospital's data fingerprint
(``data-fingerprint``, for the resume check): at 1,000 hospitals 142 kB, which Ray moves through
its object store twice per message (5 ms a call against 1.4 ms for a small one, measured) and
every handler parsed again. So a simulation runner writes them once to ``DATA_DIR/roster.json``
(`write_roster`, atomically) and the run config names the file (``site-roster``): it stays the
same size whatever the number of hospitals. A hospital reads its name from the file
(`read_roster`, parsed once per file version in a process); the coordinator puts both values
back inline (`protocol.config.RunConfig.with_roster`) before it records or compares the run,
so ``history.json`` and the resume check hold what a run without a roster holds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fedsplit.protocol.atomic import atomic_path, file_version
from fedsplit.protocol.errors import ConfigError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

#: The roster's file name in a simulation's data dir.
ROSTER_FILE = "roster.json"


class SiteFingerprint(BaseModel):
    """What one hospital's data file holds (`orchestration.fingerprint.fingerprint_file`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rows: int = Field(ge=0)
    columns: int = Field(ge=0)
    sha256: str


class Roster(BaseModel):
    """The simulated hospitals by partition-id, and each one's data fingerprint."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    site_names: list[str] = Field(alias="site-names")
    data_fingerprint: dict[str, SiteFingerprint] = Field(default_factory=dict,
                                                          alias="data-fingerprint")

    def names_value(self) -> str:
        """``site-names`` as the run config holds it inline (JSON text)."""
        return json.dumps(self.site_names)

    def fingerprint_value(self) -> str:
        """``data-fingerprint`` as the run config holds it inline (JSON text, sorted keys)."""
        return json.dumps({k: v.model_dump() for k, v in self.data_fingerprint.items()},
                          sort_keys=True)


def write_roster(data_dir: Path, site_names: list[str], data_fingerprint: dict[str, Any]) -> Path:
    """Write ``DATA_DIR/roster.json`` atomically; return its path (the run config's value)."""
    roster = Roster.model_validate({"site-names": site_names,
                                    "data-fingerprint": data_fingerprint})
    path = Path(data_dir) / ROSTER_FILE
    with atomic_path(path) as tmp:
        tmp.write_text(roster.model_dump_json(by_alias=True))
    return path


_READ: dict[str, tuple[tuple[int, int, int], Roster]] = {}


def read_roster(path: str | os.PathLike[str]) -> Roster:
    """The roster at ``path``, parsed once per version of the file in this process."""
    key = str(path)
    try:
        version = file_version(key)
    except OSError as e:
        raise ConfigError(f"The run's site roster {key} cannot be read ({e.strerror}): it is "
                          f"written by the simulation runner beside the hospitals' data; rerun "
                          f"the simulation, or drop site-roster from the run config. "
                          f"Received: site-roster={key!r}") from e
    cached = _READ.get(key)
    if cached is not None and cached[0] == version:
        return cached[1]
    try:
        roster = Roster.model_validate_json(Path(key).read_bytes())
    except (OSError, ValidationError) as e:
        raise ConfigError(f"The run's site roster {key} is not a roster file "
                          f"({str(e).splitlines()[0]}): rerun the simulation, which writes it. "
                          f"Received: site-roster={key!r}") from e
    _READ[key] = (version, roster)
    return roster
