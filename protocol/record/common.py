"""What every fedsplit run-record document shares: the part base (`RecordPart`, in
`protocol.aggregation_report`), the whole-file base `JsonFile` (read and checked, written
atomically, a `ConfigError` naming what is wrong), the metric type and the file names.

The JSON on disk keeps the keys fedsplit has always written (a file written before these models
existed loads unchanged): a key is written when the writer set it, so an absent key stays
absent rather than becoming ``null``. Keys a model does not declare are kept as they are
(``extra="allow"``), so a newer writer's field survives an older reader's rewrite. To add a
field: declare it on its model with a default (``None`` or an empty container), set it in the
writer, and describe it in docs/run-record.md. The records are written atomically
(`protocol.atomic`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, Self

from fedsplit.protocol.aggregation_report import RecordPart
from fedsplit.protocol.atomic import write_json_atomic
from fedsplit.protocol.errors import ConfigError
from pydantic import ValidationError

HISTORY_FILE = "history.json"
SUMMARY_FILE = "summary.json"

#: A metric as recorded: a number, or a list of numbers (Flower allows both in a reply).
Metric = float | list[float]


def scalars(metrics: dict[str, Metric] | None) -> dict[str, float]:
    """The single-number metrics of ``metrics`` (lists dropped)."""
    return {k: float(v) for k, v in (metrics or {}).items() if not isinstance(v, list)}


def number(value: Any) -> float | None:
    """``value`` as a float when it is a number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


class JsonFile(RecordPart):
    """A whole JSON file of the run: read and checked (`from_json`, `load`), written atomically
    (`save`); `ConfigError` names what is wrong."""

    _file: ClassVar[str]  # the file's usual name
    _kind: ClassVar[str]  # what it is, in error messages
    _fix: ClassVar[str] = ""  # advice after a malformed record

    @classmethod
    def file_name(cls) -> str:
        """The file's usual name in its run folder."""
        return cls._file

    @classmethod
    def from_json(cls, data: Any, *, source: str | None = None) -> Self:
        """Check and read the file's content (as parsed JSON)."""
        source = source or cls._file
        if not isinstance(data, dict):
            raise ConfigError(f"{source} must hold a JSON object (a fedsplit {cls._kind}). "
                              f"Received: {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ConfigError(f"{source} is not a fedsplit {cls._kind}: {first_error(e)}."
                              f"{cls._fix} Received: {source}") from e

    @classmethod
    def load(cls, path: str | Path) -> Self:
        """Read ``path``; `ConfigError` when unreadable or malformed."""
        return cls.from_json(read_json(Path(path)), source=str(path))

    def save(self, path: str | Path) -> None:
        """Write to ``path`` atomically."""
        write_json_atomic(path, self.to_json())


def read_json(path: Path) -> Any:
    """``path`` parsed as JSON; `ConfigError` when unreadable or not JSON."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not readable JSON ({e}). Received: {path}") from e


def first_error(e: ValidationError) -> str:
    """Where and what the first validation error is, and how many there are, in one line."""
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "(top level)"
    return f"{where}: {err['msg']} ({e.error_count()} problem(s) in all)"
