"""How a raw table cell reads: the missing-value markers and the yes/no words every reader shares.

`protocol.schema` (every column) and `protocol.survival_rows` (time and event) read cells with
these, so a marker means the same everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable

#: Cells that mean "missing" (compared stripped and lower-cased), before ``na-values``.
NA_MARKERS = ("", "na", "n/a", "nan", "null", "none", "?")
TRUE_WORDS = frozenset({"true", "yes", "t", "y", "1", "1.0"})
FALSE_WORDS = frozenset({"false", "no", "f", "n", "0", "0.0"})


def na_set(extra: Iterable[str] = (), column: str | None = None) -> frozenset[str]:
    """The lower-cased cells read as missing in ``column``: `NA_MARKERS` plus ``extra``.

    An ``extra`` entry ``COLUMN=VALUE`` applies to that column only (``chol=0``: a cholesterol
    of 0 is a placeholder); any other entry applies to every column. A numeric marker also
    matches the same number written otherwise (``0`` matches ``0.0``).
    """
    out = set(NA_MARKERS)
    for entry in extra:
        text = str(entry).strip()
        name, sep, value = text.partition("=")
        if not sep:
            out.add(text.lower())
        elif column is not None and name.strip() == column:
            out.add(value.strip().lower())
    return frozenset(out)
