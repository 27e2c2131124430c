"""The pooled Kaplan-Meier curve from the hospitals' summed counts (number at risk and number of
events at each time of the shared grid), with lifelines' confidence band, and the minimum-count
rule.

Kaplan-Meier: ``S(t) = prod_{t_i <= t} (1 - d_i / n_i)``. Band: exponential Greenwood, as
lifelines' ``KaplanMeierFitter``: with ``V = sum d_i / (n_i (n_i - d_i))`` (0 where n_i = d_i)
and ``v = log S``, the bounds are ``exp(-exp(log(-v) -/+ z sqrt(V) / v))`` (1 where undefined).

Minimum-count rule (``min_count`` K, docs/survival.md): before anything is written, event times
are gathered in time order into groups holding at least K pooled events each (a last group
short of K joins the one before it). Only one point per group is published: its last time, the
curve and band there (exact: the product runs over every event time), the group's events and
the number at risk at its first time. The per-time counts inside a group are not written. The
curve ends before the first time with fewer than K patients at risk. K = 1 keeps every event
time (lifelines' curve).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from fedsplit.protocol.errors import ConfigError
from fedsplit.protocol.record.survival import KMPoints

Z_95 = 1.959963984540054


@dataclass(frozen=True)
class KMCurve:
    """Times, survival, band, and the counts they came from."""

    times: np.ndarray
    at_risk: np.ndarray
    events: np.ndarray
    survival: np.ndarray
    lower: np.ndarray
    upper: np.ndarray

    def points(self) -> KMPoints:
        """The curve as ``km.json`` holds it (`protocol.record.survival.KMPoints`)."""
        return KMPoints(time=self.times.tolist(), at_risk=self.at_risk.astype(int).tolist(),
                        events=self.events.astype(int).tolist(), survival=self.survival.tolist(),
                        lower_95=self.lower.tolist(), upper_95=self.upper.tolist())


def km_curve(times: np.ndarray, at_risk: np.ndarray, events: np.ndarray) -> KMCurve:
    """Kaplan-Meier and its exponential-Greenwood 95% band at ``times``."""
    n = np.asarray(at_risk, np.float64)
    d = np.asarray(events, np.float64)
    if np.any(d > n) or np.any(n < 0) or np.any(d < 0):
        raise ConfigError("Kaplan-Meier counts must satisfy 0 <= events <= at risk. "
                          f"Received: {int(np.sum(d > n))} time(s) with more events than at risk")
    with np.errstate(divide="ignore", invalid="ignore"):
        log_s = np.cumsum(np.where(n > 0, np.log(n - d) - np.log(n), 0.0))
        var = np.cumsum(np.where((n > 0) & (n > d), d / (n * (n - d)), 0.0))
        s = np.exp(log_s)
        lower = np.exp(-np.exp(np.log(-log_s) - Z_95 * np.sqrt(var) / log_s))
        upper = np.exp(-np.exp(np.log(-log_s) + Z_95 * np.sqrt(var) / log_s))
    return KMCurve(np.asarray(times, np.float64), n, d, s, np.nan_to_num(lower, nan=1.0),
                   np.nan_to_num(upper, nan=1.0))


def min_count_groups(at_risk: np.ndarray, events: np.ndarray, min_count: int
                     ) -> tuple[np.ndarray, list[list[int]]]:
    """The minimum-count rule's grouping (module docstring): (the grid positions of the event
    times before the first one with fewer than ``min_count`` at risk; the groups, as lists of
    positions into that array, each holding at least ``min_count`` events)."""
    if min_count < 1:
        raise ConfigError(f"--min-count is at least 1 (1: every event time). Received: {min_count}")
    at_risk, events = np.asarray(at_risk), np.asarray(events)
    keep = np.flatnonzero(events > 0)
    enough = at_risk[keep] >= min_count
    stop = int(np.argmin(enough)) if not enough.all() else len(keep)
    keep = keep[:stop]
    groups: list[list[int]] = []
    current: list[int] = []
    for i in range(len(keep)):
        current.append(i)
        if int(events[keep[current]].sum()) >= min_count:
            groups.append(current)
            current = []
    if current and groups:
        groups[-1].extend(current)
    return keep, groups


def apply_min_count(times: np.ndarray, at_risk: np.ndarray, events: np.ndarray,
                    min_count: int) -> KMCurve:
    """The pooled curve as published under the minimum-count rule (module docstring)."""
    times, at_risk, events = (np.asarray(a) for a in (times, at_risk, events))
    keep, groups = min_count_groups(at_risk, events, min_count)
    times, at_risk, events = times[keep], at_risk[keep], events[keep]
    exact = km_curve(times, at_risk, events)
    if min_count == 1:
        return exact
    last = np.array([g[-1] for g in groups], dtype=np.int64)
    return KMCurve(exact.times[last], np.array([at_risk[g[0]] for g in groups], np.float64),
                   np.array([events[g].sum() for g in groups], np.float64),
                   exact.survival[last], exact.lower[last], exact.upper[last])
