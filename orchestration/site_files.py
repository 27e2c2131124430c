"""The hospitals' own files as the commands name them (``--site NAME=PATH[:TEST]``), checked
before anything heavy is imported or any process started.

`parse_site` reads a ``--site`` argument; `check_site_files` refuses a file that is missing,
empty or cannot be opened, at any hospital, in one line (`HospitalFailure`, exit 13) naming
every such hospital and the argument received; `table_columns` reads a table file's header
only, for the column check across hospitals (`protocol.column_sets`). This module imports the
standard library and `protocol.errors` only (pandas only inside `table_columns`), so
``fedsplit simulate`` and ``fedsplit up`` refuse a wrong path in a fraction of a second,
before torch, Flower or any hospital's process (measured in docs/simulate.md).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fedsplit.protocol.errors import ConfigError, HospitalFailure

SITE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
#: The stage a hospital's unreadable file is reported at (as its agent reports it).
READING = "reading its data"
#: Suffixes `table_columns` reads a header from.
HEADER_SUFFIXES = (".csv", ".parquet", ".pq")


@dataclass(frozen=True)
class SiteSource:
    """A ``--site`` argument: the hospital's name, its file, and optionally its test file."""

    name: str
    train: Path
    test: Path | None = None

    @property
    def argument(self) -> str:
        """The ``--site`` argument that names this hospital, as a user writes it."""
        return f"{self.name}={self.train}" + (f":{self.test}" if self.test else "")


def parse_site(arg: str | Path | SiteSource) -> SiteSource:
    """``PATH``, ``NAME=PATH`` or ``NAME=TRAIN:TEST`` -> `SiteSource` (name: the file stem)."""
    if isinstance(arg, SiteSource):
        return arg
    text = str(arg)
    name, sep, rest = text.partition("=")
    if not sep:
        name, rest = "", text
    train, colon, test = rest.partition(":")
    if not train or (colon and not test):
        raise ConfigError(f"--site is PATH, NAME=PATH or NAME=TRAIN.csv:TEST.csv. Received: {text!r}")
    source = SiteSource(name or Path(train).stem, Path(train), Path(test) if test else None)
    if not SITE_NAME.match(source.name):
        raise ConfigError(
            f"A hospital name is 1-64 letters, digits, '_', '.' or '-' (starting with a letter or "
            f"digit); name it with --site NAME=PATH. Received: {source.name!r}"
        )
    return source


def file_problem(path: Path) -> str | None:
    """Why ``path`` cannot be a hospital's data (``does not exist``, ``is empty``, ``cannot be
    read (...)``), or None. A folder passes (a recipe's reader, or the one table in it)."""
    try:
        if not path.exists():
            return "does not exist"
        if path.is_dir():
            next(path.iterdir(), None)  # a folder it may not list fails here
            return None
        with open(path, "rb") as fh:
            if not fh.read(1):
                return "is empty (0 bytes)"
    except OSError as e:
        return f"cannot be read ({e.strerror or type(e).__name__})"
    return None


#: What a refusal of a hospital's file tells the user to do.
FILE_FIX = ("Check the path given with --site NAME=FILE (a CSV/Parquet table, an NPZ, or what "
            "--recipe's reader reads)")


def check_site_files(site_files: Sequence[str | Path | SiteSource], *, option: str = "--site",
                     fix: str = FILE_FIX) -> list[SiteSource]:
    """Parse every ``--site`` and refuse, in one `HospitalFailure` line, every hospital whose
    file (or test file) is missing, empty or unreadable; return the parsed sources."""
    sources = [parse_site(s) for s in site_files]
    bad = [(s, path, problem) for s in sources for path in (s.train, s.test)
           if path is not None and (problem := file_problem(path)) is not None]
    if not bad:
        return sources
    (first, path, problem), rest = bad[0], bad[1:]
    also = "".join(f"; hospital {s.name}'s data file {p} {why} too" for s, p, why in rest)
    received = ", ".join(f"{option} {s.argument}" for s in dict.fromkeys(s for s, _, _ in bad))
    raise HospitalFailure(first.name, READING, f"data file {path} {problem}{also}",
                          f"{fix}. Received: {received}")


def table_columns(path: Path) -> list[str] | None:
    """A CSV or Parquet file's column names (its header only), or None for any other file or
    folder, or one whose header cannot be read (the full read reports that)."""
    suffix = path.suffix.lower()
    if not path.is_file() or suffix not in HEADER_SUFFIXES:
        return None
    try:
        if suffix == ".csv":
            import pandas as pd

            return [str(c) for c in pd.read_csv(path, dtype=str, nrows=0).columns]
        import pyarrow.parquet as pq

        schema = pq.read_schema(path)
        index = {c for c in (schema.pandas_metadata or {}).get("index_columns", [])
                 if isinstance(c, str)}  # pandas reads these as the index, not as columns
        return [str(c) for c in schema.names if c not in index]
    except Exception:  # unreadable headers are the full read's to report
        return None


def own_sites(site_files: Sequence[str | Path | SiteSource]) -> list[SiteSource]:
    """``fedsplit up``'s ``--site NAME=FILE`` hospitals, checked before anything is imported,
    read or started: no separate test file (each agent holds out its own evaluation rows),
    names unique, every file present and readable (`check_site_files`)."""
    sources = [parse_site(s) for s in site_files]
    for source in sources:
        if source.test is not None:
            raise ConfigError(
                f"hospital {source.name}: fedsplit up trains each hospital on its whole file (its "
                f"agent holds out val-fraction of the rows to evaluate); a separate test file is "
                f"for fedsplit simulate. Give --site NAME=FILE. "
                f"Received: {source.name}={source.train}:{source.test}")
    names = [s.name for s in sources]
    if dupes := sorted({n for n in names if names.count(n) > 1}):
        raise ConfigError(f"Each hospital needs its own name: name them with --site NAME=FILE. "
                          f"Received: {', '.join(dupes)} more than once")
    return check_site_files(sources)
