"""Checks every update before aggregation; a failing update is excluded, not fatal.

For each update, in order:

1. names, shapes and dtypes equal the round's model (``expected``; when not given, the layout
   shared by more than half of the updates), in any order; the reason is
   `protocol.arrays.layout_difference`'s sentence naming the first differing parameter;
2. the sample count is an integer >= 1;
3. the count is at most the site's registered cohort size (``cohort_caps``): above it, the
   count is clipped to the cap (policy ``clip``) or the update is excluded (``refuse``), and
   the site is flagged either way;
4. every value is finite (read in blocks, so a weight file is never loaded whole). With a
   ``watch`` (`aggregation._blocks.ValueWatch`), this scan is left to the rule's own pass: the
   accepted updates come back wrapped in `aggregation._blocks.Watched`, every read of them is
   checked (or the pass's output is), and `aggregation.run` redoes the round with the scan when
   the watch is flagged, so results and reports are those of the scan.

The result lists the accepted updates (with clipped counts applied) and a `SiteReport` with
the reason for every excluded one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from fedsplit.aggregation._blocks import (
    DEFAULT_MEMORY_BUDGET,
    BlockReader,
    Recounted,
    ValueWatch,
    Watched,
    plan_blocks,
)
from fedsplit.aggregation._threads import map_threads, threads_for
from fedsplit.aggregation.compat import VERTICAL_HINT, check_compatible
from fedsplit.aggregation.errors import AggregationError, IncompatibleUpdatesError
from fedsplit.protocol.aggregation_report import SiteReport
from fedsplit.protocol.arrays import ArraySpec, check_num_examples, layout_difference
from fedsplit.protocol.errors import FedsplitError
from fedsplit.protocol.update import UpdateHeader, UpdateSource

CapPolicy = Literal["clip", "refuse"]
CAP_POLICIES: tuple[str, ...] = ("clip", "refuse")

Expected = Sequence[ArraySpec] | UpdateHeader | UpdateSource | Mapping[str, Any]


@dataclass
class GuardResult:
    """Accepted updates (counts as used) and one report per input update, in input order."""

    accepted: list[UpdateSource]
    accepted_index: list[int]
    reports: list[SiteReport]
    expected: tuple[ArraySpec, ...]
    flags: dict[int, list[str]] = field(default_factory=dict)
    claimed: dict[int, int] = field(default_factory=dict)


def expected_specs(expected: Expected) -> tuple[ArraySpec, ...]:
    """Normalise the round's model layout: specs, a header, an update, or name -> array."""
    if isinstance(expected, UpdateHeader):
        return tuple(expected.specs)
    if isinstance(expected, UpdateSource):
        return tuple(expected.header.specs)
    if isinstance(expected, Mapping):
        specs = []
        for name, arr in expected.items():
            a = np.asarray(arr)
            specs.append(ArraySpec(str(name), tuple(int(d) for d in a.shape), a.dtype))
        return tuple(specs)
    specs = tuple(expected)
    if not specs or not all(isinstance(s, ArraySpec) for s in specs):
        raise AggregationError(
            "expected must be the round's model: a sequence of ArraySpec, an UpdateHeader, an "
            "update, or a mapping of parameter names to arrays. Received: "
            f"{type(expected).__name__}"
        )
    return specs


def _signature(specs: Sequence[ArraySpec]) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    return tuple(sorted((s.name, tuple(s.shape), np.dtype(s.dtype).name) for s in specs))


def infer_expected(headers: Sequence[UpdateHeader]) -> tuple[ArraySpec, ...]:
    """The layout shared by more than half the updates; refuse when there is none."""
    votes = Counter(_signature(h.specs) for h in headers)
    sig, count = votes.most_common(1)[0]
    if 2 * count <= len(headers):
        check_compatible(headers)  # names the first differing parameter between two updates
        layouts = "; ".join(
            f"{h.label}: {len(h.specs)} parameters, first {h.specs[0].name!r} {h.specs[0].shape}"
            if h.specs else f"{h.label}: no parameters"
            for h in headers[:4]
        )
        raise IncompatibleUpdatesError(
            f"The updates do not share one model layout (no layout is held by more than half of "
            f"them), so the round's model cannot be told apart from a faulty update. Pass the "
            f"round's model (expected=..., `fedsplit aggregate --reference MODEL.h5`). "
            f"{VERTICAL_HINT} Received: {layouts}"
        )
    first = next(h for h in headers if _signature(h.specs) == sig)
    return tuple(first.specs)


def _first_non_finite(source: UpdateSource, specs: Sequence[ArraySpec], budget: int) -> str | None:
    """Name the first parameter holding NaN/Inf, reading blocks within ``budget`` bytes."""
    itemsize = max(s.dtype.itemsize for s in specs)
    values = max(1, min(budget // (2 * itemsize), max(s.size for s in specs), 1 << 22))
    dtypes = {s.name: s.dtype for s in specs}
    reader = BlockReader(source)
    buf = np.empty(values * itemsize, dtype=np.uint8)
    for block in plan_blocks(specs, values):
        spec_dtype = dtypes[block.name]
        out = reader.view(block)
        if out is None:  # not in memory: read the block into the buffer
            out = buf[: block.size * spec_dtype.itemsize].view(spec_dtype)
            reader.read(block, out)
        # fast path: a finite sum proves every value finite; otherwise count exactly
        total = np.add.reduce(out, dtype=np.float32 if spec_dtype == np.float16 else None)
        if not np.isfinite(total):
            bad = int(block.size - np.count_nonzero(np.isfinite(out)))
            if bad:
                reader.release()
                return f"parameter {block.name!r} holds {bad} NaN/Inf value(s)"
    reader.release()
    return None


def guard_updates(
    updates: Sequence[UpdateSource],
    *,
    expected: Expected | None = None,
    cohort_caps: Mapping[str, int] | None = None,
    cap_policy: str = "clip",
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    watch: ValueWatch | None = None,
    workers: int = 1,
) -> GuardResult:
    """Check every update (layout, count, cap, finite values); exclude failures with a reason.
    The value scans run in up to ``workers`` threads (`BackendSettings.threads`).

    With ``watch``, values are not scanned here: the accepted updates are wrapped in `Watched`
    so the rule's pass checks them as it reads them (see the module docstring).
    """
    if cap_policy not in CAP_POLICIES:
        raise AggregationError(
            f"cap_policy must be 'clip' (lower an over-cap count to the cap) or 'refuse' "
            f"(exclude that update). Received: {cap_policy!r}"
        )
    caps = _check_caps(cohort_caps)
    headers: list[UpdateHeader | None] = []
    reports: list[SiteReport] = []
    for k, u in enumerate(updates):
        try:
            headers.append(u.header)
        except FedsplitError as e:  # a source that cannot even describe itself
            headers.append(None)
            reports.append(_excluded(f"update #{k + 1}", 0, f"unreadable: {e}"))
        else:
            reports.append(SiteReport(site=u.header.label, num_examples=0, weight=0.0))
    readable = [h for h in headers if h is not None]
    if expected is not None:
        want = expected_specs(expected)
    elif readable:
        want = infer_expected(readable)
    else:
        want = ()
    result = GuardResult(accepted=[], accepted_index=[], reports=reports, expected=want)
    candidates: list[tuple[int, UpdateSource, UpdateHeader, int]] = []
    for k, (u, h) in enumerate(zip(updates, headers, strict=True)):
        if h is None:
            continue
        rep = reports[k]
        problem = layout_difference(
            want, h.specs, expected_label="the round's model", got_label="this update",
            ordered=False,
        )
        if problem is not None:
            _exclude(rep, f"layout: {problem}", h.num_examples)
            continue
        try:
            count = check_num_examples(h.num_examples, where=f"update from {h.label}")
        except FedsplitError:
            _exclude(rep, f"count: num_examples must be an integer >= 1, got {h.num_examples!r}", 0)
            continue
        rep.num_examples = count
        cap = caps.get(h.label)
        if cap is not None and count > cap:
            if cap_policy == "refuse":
                rep.flags.append(f"count {count} above cohort cap {cap}")
                _exclude(rep, f"count: claimed {count} rows, above the registered cohort size "
                              f"{cap} (policy refuse)", count)
                continue
            rep.flags.append(f"count {count} clipped to cohort cap {cap}")
            rep.claimed_examples = count
            rep.num_examples = count = cap
        candidates.append((k, u, h, count))
    if watch is not None:  # the rule's pass checks the values as it reads them
        for k, u, h, count in candidates:
            used = u if count == h.num_examples else Recounted(u, count)
            result.accepted.append(Watched(used, watch))
            result.accepted_index.append(k)
        return result
    # the value scans are independent: one update per worker thread, the budget shared out
    threads = threads_for(sum(sum(s.size for s in c[2].specs) for c in candidates), len(candidates),
                          workers)

    def scan(candidate: tuple[int, UpdateSource, UpdateHeader, int]) -> str | None:
        try:
            return _first_non_finite(candidate[1], candidate[2].specs, memory_budget // threads)
        except FedsplitError as e:
            return f"unreadable values: {e}"

    problems = map_threads(scan, threads, candidates)
    for (k, u, h, count), bad in zip(candidates, problems, strict=True):
        if bad is not None:
            _exclude(reports[k], f"values: {bad}", count)
            continue
        result.accepted.append(u if count == h.num_examples else Recounted(u, count))
        result.accepted_index.append(k)
    return result


def _check_caps(cohort_caps: Mapping[str, int] | None) -> dict[str, int]:
    caps: dict[str, int] = {}
    for site, cap in (cohort_caps or {}).items():
        if isinstance(cap, bool) or not isinstance(cap, int | np.integer) or cap < 1:
            raise AggregationError(
                f"A cohort cap is the registered number of patients (rows) of a site, an integer "
                f">= 1. Fix the entry for {site!r}. Received: {site}={cap!r}"
            )
        caps[str(site)] = int(cap)
    return caps


def _excluded(site: str, count: int, reason: str) -> SiteReport:
    return SiteReport(site=site, num_examples=count, weight=0.0, excluded=True, reason=reason)


def _exclude(rep: SiteReport, reason: str, count: Any) -> None:
    rep.excluded = True
    rep.reason = reason
    rep.weight = 0.0
    rep.num_examples = count if isinstance(count, int) and not isinstance(count, bool) else 0
