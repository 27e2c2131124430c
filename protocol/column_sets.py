"""Hospitals whose columns differ: one refusal naming the odd one out and both sides.

Every hospital of a federation needs the same columns (in any order). When they differ, the
hospital that renamed, dropped or added a column is the one to name, not whichever came first:
`check_same_columns` compares each hospital with the columns most hospitals hold.

- A column held by more than half of the hospitals is expected everywhere: a hospital without it
  *lacks* it. A column held by fewer than half is unexpected: a hospital with it *has* it. Each
  odd hospital is named with both sides of its difference (``east lacks 'mean_radius' and has
  'radius_mean' (renamed?)``), and the hospitals that agree are named as the majority.
- A column held by exactly half of the hospitals has no majority: the refusal says so and lists
  each side (``'chol' at a but not at b``).
- Columns the run names (``named``: the target, the survival event, the ID column) are expected
  at every hospital whatever the others hold, and only the hospitals holding all of them vote
  on the other columns: a hospital that renamed the target is the odd one even when most
  hospitals renamed it alike. A named column no hospital holds is left to the per-hospital
  check (`protocol.schema.split_columns`), which says to pass the right option.

The coordinator runs it on the hospitals' column reports (`protocol.schema.merge_reports`: the
feature columns), and ``fedsplit simulate`` / ``fedsplit up --site`` on the files' headers (all
columns but the ignored ones) before anything is read further or started.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from fedsplit.protocol.errors import ConfigError

#: Most hospitals, and most columns per hospital, a refusal lists by name (then "and N more").
SHOWN = 5


def _names(items: Sequence[str], *, quote: bool = False, limit: int = SHOWN) -> str:
    shown = [repr(i) if quote else str(i) for i in items[:limit]]
    more = len(items) - limit
    text = ", ".join(shown)
    return f"{text} and {more} more" if more > 0 else text


def check_same_columns(columns: Mapping[str, Sequence[str]],
                       named: Mapping[str, str] | None = None) -> None:
    """Refuse hospitals whose columns differ (`ConfigError`, one line), naming the odd
    hospital(s) against the majority, what each lacks and has, and each side of a tie.

    ``columns``: every hospital's column names (any order), in the order to name them.
    ``named``: columns every hospital must hold, with the option that names them, e.g.
    ``{"diagnosis": "the target, --target"}``.
    """
    sites = list(columns)
    held = {s: set(map(str, columns[s])) for s in sites}
    if len(sites) < 2 or all(held[s] == held[sites[0]] for s in sites):
        return
    order = list(dict.fromkeys(c for s in sites for c in map(str, columns[s])))
    named = {c: role for c, role in (named or {}).items()
             if c and any(c in held[s] for s in sites)}
    voters = [s for s in sites if all(c in held[s] for c in named)]
    expected, tied = set(named), []
    for col in order:
        if col in named:
            continue
        votes = sum(col in held[s] for s in voters)
        if 2 * votes > len(voters):
            expected.add(col)
        elif 2 * votes == len(voters) and any(col not in held[s] for s in sites):
            tied.append(col)

    def show(col: str) -> str:
        return f"{col!r} ({named[col]})" if col in named else repr(col)

    odd: dict[str, tuple[list[str], list[str]]] = {}
    for s in sites:
        lacks = [c for c in order if c in expected and c not in held[s]]
        extra = [c for c in order if c in held[s] and c not in expected and c not in tied]
        if lacks or extra:
            odd[s] = (lacks, extra)
    parts, received = [], []
    if odd:
        agree = [s for s in sites if s not in odd]
        lines = []
        for s, (lacks, extra) in odd.items():
            said = []
            if lacks:
                said.append(f"lacks {_names([show(c) for c in lacks])}")
            if extra:
                said.append(f"has {_names([repr(c) for c in extra])}"
                            + (" (renamed?)" if lacks else ""))
            lines.append(f"{s} {' and '.join(said)}")
            received.append(f"{s}" + (f" lacks {lacks}" if lacks else "")
                            + (f" has {extra}" if extra else ""))
        who = (f"Hospital {next(iter(odd))} differs" if len(odd) == 1
               else f"Hospitals {_names(list(odd))} differ")
        against = (f"the majority ({_names(agree)})" if 2 * len(agree) > len(sites)
                   else _names(agree) if agree else "the columns most hospitals hold")
        parts.append(f"{who} from {against}: {_semi(lines)}")
    if tied:
        sides: dict[tuple[str, ...], list[str]] = {}
        for col in tied:
            sides.setdefault(tuple(s for s in sites if col in held[s]), []).append(col)
        lines = []
        for holders, cols in sides.items():
            rest = [s for s in sites if s not in holders]
            lines.append(f"{_names(cols, quote=True)} at {_names(list(holders))} but not at "
                         f"{_names(rest)}")
            received.append(f"{cols} at {', '.join(holders)}")
        parts.append(f"no majority ({len(voters)} hospitals, half on each side) for "
                     f"{_semi(lines)}")
    # what --ignore-column could leave out: not a named column, nor the likely rename of one
    involved = [c for c in order if c not in named and (c in tied or any(
        c in lacks or (c in extra and not set(lacks) & set(named))
        for lacks, extra in odd.values()))]
    ignore = (f" or leave it out at every hospital with --ignore-column {involved[0]}"
              if len(involved) == 1 else
              " or leave a column out at every hospital with --ignore-column NAME"
              if involved else "")
    raise ConfigError(
        f"The hospitals' columns differ: {'; '.join(parts)}. Every hospital needs the same "
        f"columns (in any order): rename or add them where they differ (empty cells if the "
        f"values are unknown){ignore}. Received: {_semi(received)}"
    )


def _semi(lines: Collection[str]) -> str:
    items = list(lines)
    return "; ".join(items[:SHOWN]) + (f"; and {len(items) - SHOWN} more" if len(items) > SHOWN
                                       else "")


def check_table_columns(columns: Mapping[str, Sequence[str]], settings: Any) -> None:
    """`check_same_columns` on whole tables (their headers): the ignored columns left out, the
    target (for survival the time column), the event and the ID column named by their option.
    ``settings``: a `protocol.schema.TableSettings` (not imported: schema imports this module)."""
    ignored = set(settings.ignore_columns)
    named = {settings.target: "the time column, --time" if settings.event
             else "the target, --target",
             settings.event: "the event column, --event",
             settings.id_column: "the ID column, --id-column"}
    check_same_columns({site: [c for c in map(str, cols) if c not in ignored]
                        for site, cols in columns.items()},
                       {c: role for c, role in named.items() if c and c not in ignored})
