"""Reading a hospital's time and event columns: the rows of a survival table (docs/survival.md).

A survival table holds one row per patient with a **time** column (positive numbers: days,
months, any unit shared by every hospital) and an **event** column (1/0, TRUE/FALSE, yes/no,
t/f, y/n, in any case: 1 = the event was observed, 0 = censored at that time). `read_survival`
reads both columns as they come and refuses, never drops:

- a row whose time is missing, zero or negative, or whose event is missing or another word;
- a time column holding text that is not a number (naming the values);
- a hospital with no event at all (it adds nothing to a Cox likelihood, and its Kaplan-Meier
  curve is flat), or whose times are all equal (no ordering to learn from).

`check_hospitals` runs it over every hospital and raises one `SurvivalDataError` listing each
hospital's count per problem and the fix. The table schema (`protocol.schema`) reads a survival
task's two target columns with it; `protocol.survival` holds the rest of the survival contract.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fedsplit.protocol.cells import na_set
from fedsplit.protocol.errors import ConfigError

EVENT_TRUE = frozenset({"1", "1.0", "true", "yes", "t", "y"})
EVENT_FALSE = frozenset({"0", "0.0", "false", "no", "f", "n"})

#: cells read as missing in the time and event columns (besides --na-values)
MISSING = frozenset({"", "na", "n/a", "nan", "null", "none", "?"})

class SurvivalDataError(ConfigError):
    """A hospital's time or event column cannot be read as survival data."""


def _text(value: Any, missing: frozenset[str] = MISSING) -> str | None:
    """A cell as stripped text, None when missing."""
    if value is None:
        return None
    if isinstance(value, float) and np.isnan(value):
        return None
    if isinstance(value, bool | np.bool_):
        return "true" if value else "false"
    text = str(value).strip()
    return None if text.lower() in missing else text


@dataclass
class SurvivalProblems:
    """What is wrong with one hospital's time and event columns (counts, a few examples)."""

    site: str
    rows: int
    missing_time: int = 0
    nonpositive_time: int = 0
    text_time: list[str] = field(default_factory=list)  # distinct non-numbers, a few
    text_time_rows: int = 0
    missing_event: int = 0
    bad_event: list[str] = field(default_factory=list)
    bad_event_rows: int = 0
    no_events: bool = False
    equal_times: bool = False

    def lines(self, time: str, event: str) -> list[str]:
        """One sentence per problem, each with its fix."""
        s = self.site
        out = []
        if self.text_time_rows:
            out.append(f"{s}: time column {time!r} holds text in {self.text_time_rows} row(s) "
                       f"(e.g. {self.text_time[:3]}); it must hold numbers (days, months: one unit "
                       f"at every hospital). Convert them, or declare a missing-value marker with "
                       f"--na-values {time}=WORD and drop those rows")
        if self.missing_time:
            out.append(f"{s}: {self.missing_time} row(s) have no time in {time!r}; a patient "
                       f"without a follow-up time cannot be used: drop those rows or fill in the "
                       f"time of last contact (with event 0)")
        if self.nonpositive_time:
            out.append(f"{s}: {self.nonpositive_time} row(s) have a time <= 0 in {time!r}; "
                       f"times are follow-up durations and must be positive: fix them (e.g. a "
                       f"same-day event as 0.5 day) or drop those rows")
        if self.missing_event:
            out.append(f"{s}: {self.missing_event} row(s) have no value in event column "
                       f"{event!r}; write 1 (event observed) or 0 (censored), or drop them")
        if self.bad_event_rows:
            out.append(f"{s}: event column {event!r} holds {self.bad_event[:3]} in "
                       f"{self.bad_event_rows} row(s); it must be 1/0, TRUE/FALSE or yes/no "
                       f"(1 = event observed, 0 = censored): recode those values")
        if self.no_events:
            out.append(f"{s}: no patient has an event (every {event!r} is 0) in {self.rows} "
                       f"rows; its rows add nothing to a survival model. Check the event coding "
                       f"(1 = event observed) or leave this hospital out")
        if self.equal_times:
            out.append(f"{s}: every time in {time!r} is the same; survival needs the follow-up "
                       f"times themselves. Check that {time!r} is the time column")
        return out

    @property
    def ok(self) -> bool:
        return not (self.missing_time or self.nonpositive_time or self.text_time_rows
                    or self.missing_event or self.bad_event_rows or self.no_events
                    or self.equal_times)


def inspect_survival(site: str, times: Sequence[Any], events: Sequence[Any], *,
                     time: str = "", event: str = "", na_values: Sequence[str] = ()
                     ) -> tuple[np.ndarray, np.ndarray, SurvivalProblems]:
    """(time float64, event bool, problems) of one hospital's two columns, as read.

    Missing cells: `MISSING` plus ``na_values`` (``WORD`` or ``COLUMN=WORD``, as --na-values).
    Unusable rows get time NaN / event False; `SurvivalProblems` counts them."""
    miss_t, miss_e = na_set(na_values, time), na_set(na_values, event)
    n = len(times)
    if len(events) != n:
        raise SurvivalDataError(f"{site}: the time and event columns differ in length. "
                                f"Received: {n} and {len(events)}")
    problems = SurvivalProblems(site, n)
    t = np.full(n, np.nan)
    e = np.zeros(n, dtype=bool)
    text: dict[str, int] = {}
    bad: dict[str, int] = {}
    for i, (tv, ev) in enumerate(zip(times, events, strict=True)):
        cell = _text(tv, miss_t)
        if cell is None:
            problems.missing_time += 1
        else:
            try:
                value = float(cell)
            except ValueError:
                value = None
            if value is None or not np.isfinite(value):
                text[cell] = text.get(cell, 0) + 1
            elif value <= 0:
                problems.nonpositive_time += 1
            else:
                t[i] = value
        flag = _text(ev, miss_e)
        if flag is None:
            problems.missing_event += 1
        elif flag.lower() in EVENT_TRUE:
            e[i] = True
        elif flag.lower() not in EVENT_FALSE:
            bad[flag] = bad.get(flag, 0) + 1
    problems.text_time, problems.text_time_rows = sorted(text), sum(text.values())
    problems.bad_event, problems.bad_event_rows = sorted(bad), sum(bad.values())
    usable = ~np.isnan(t)
    if problems.ok:  # judge the hospital as a whole only once every row reads
        problems.no_events = not bool(e.any())
        problems.equal_times = n > 1 and bool(np.all(t[usable] == t[usable][0]))
    return t, e, problems


def read_survival(site: str, frame: Any, time: str, event: str, na_values: Sequence[str] = (),
                  *, whole: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """One hospital's (time, event) from its table (a DataFrame); `SurvivalDataError` if unusable.

    ``whole``: the table is the hospital's training table, so a table without any event, or
    whose times are all equal, is refused too; False (test or held-out rows, patients to score)
    judges each row only.
    """
    check_columns(site, [str(c) for c in frame.columns], time, event)
    t, e, problems = inspect_survival(site, frame[time].tolist(), frame[event].tolist(),
                                      time=time, event=event, na_values=na_values)
    if not whole:
        problems.no_events = problems.equal_times = False
    if not problems.ok:
        raise SurvivalDataError(_message([problems], time, event))
    return t, e


def check_columns(site: str, columns: Sequence[str], time: str, event: str) -> None:
    """Refuse a table without the time or event column, or with both the same."""
    if time == event:
        raise SurvivalDataError(f"--time and --event must be two different columns. "
                                f"Received: both {time!r}")
    for what, name in (("time", time), ("event", event)):
        if name not in columns:
            raise SurvivalDataError(f"{site}'s table has no {what} column {name!r}; name it with "
                                    f"--{what}. Columns: {', '.join(columns)}. Received: {name!r}")


def check_hospitals(frames: Mapping[str, Any], time: str, event: str,
                    na_values: Sequence[str] = ()) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(time, event) of every hospital; one `SurvivalDataError` listing every hospital's problems."""
    out, bad = {}, []
    for site, frame in frames.items():
        check_columns(site, [str(c) for c in frame.columns], time, event)
        t, e, problems = inspect_survival(site, frame[time].tolist(), frame[event].tolist(),
                                          time=time, event=event, na_values=na_values)
        out[site] = (t, e)
        if not problems.ok:
            bad.append(problems)
    if bad:
        raise SurvivalDataError(_message(bad, time, event))
    return out


def _message(problems: Sequence[SurvivalProblems], time: str, event: str) -> str:
    lines = [line for p in problems for line in p.lines(time, event)]
    counts = ", ".join(f"{p.site}: {p.missing_time + p.nonpositive_time + p.text_time_rows} bad "
                       f"time, {p.missing_event + p.bad_event_rows} bad event of {p.rows} rows"
                       for p in problems)
    return ("Survival data refused (no row was dropped):\n- " + "\n- ".join(lines)
            + f"\nReceived: {counts}")
