"""A hospital's part of the survival sums: the Cox partial likelihood's log-likelihood, gradient
and Hessian at given coefficients (Efron ties), its Kaplan-Meier counts, and concordance counts.

Each hospital is its own stratum (its own baseline hazard), so the federation's log partial
likelihood is the sum of the hospitals' and so are its gradient and Hessian: what a hospital
returns here is all the coordinator's Newton step needs (`server.survival.newton`).

Efron's approximation for tied event times, as lifelines' ``CoxPHFitter``: at an event time t
with d tied events D and risk set R (time >= t), with w = exp(x'b),

    log L_t = sum_{i in D} x_i'b - sum_{l=0}^{d-1} log(S0 - l/d T0)

where S0 = sum_R w and T0 = sum_D w (S1, T1: sums of w x; S2, T2: of w x x'). The gradient and
Hessian follow term by term (`efron_parts`). Covariates are the federation's standardized ones
(pooled mean and standard deviation, as lifelines standardizes before fitting).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CoxParts:
    """One hospital's (log-likelihood, gradient, Hessian) at the broadcast coefficients."""

    loglik: float
    gradient: np.ndarray  # (p,)
    hessian: np.ndarray  # (p, p)


def efron_parts(x: np.ndarray, time: np.ndarray, event: np.ndarray, beta: np.ndarray) -> CoxParts:
    """Log partial likelihood (Efron ties), its gradient and Hessian for one stratum."""
    x = np.asarray(x, dtype=np.float64)
    n, p = x.shape
    order = np.argsort(time, kind="stable")
    x, time, event = x[order], np.asarray(time, np.float64)[order], np.asarray(event, bool)[order]
    eta = x @ np.asarray(beta, dtype=np.float64)
    shift = float(eta.max()) if n else 0.0
    w = np.exp(eta - shift)  # every ratio below is invariant to the shift; the log adds it back
    wx = w[:, None] * x
    wxx = wx[:, :, None] * x[:, None, :]
    # risk-set sums: rows at or after each row in time order (suffix sums)
    s0 = np.cumsum(w[::-1])[::-1]
    s1 = np.cumsum(wx[::-1], axis=0)[::-1]
    s2 = np.cumsum(wxx[::-1], axis=0)[::-1]
    times, first = np.unique(time, return_index=True)  # first row of each distinct time
    group = np.searchsorted(times, time)
    d = np.bincount(group, weights=event, minlength=len(times))
    has = d > 0
    if not has.any():
        return CoxParts(0.0, np.zeros(p), np.zeros((p, p)))
    ev = event.astype(np.float64)
    t0 = np.bincount(group, weights=w * ev, minlength=len(times))
    t1 = np.zeros((len(times), p))
    np.add.at(t1, group, wx * ev[:, None])
    t2 = np.zeros((len(times), p, p))
    np.add.at(t2, group[event], wxx[event])
    k = np.flatnonzero(has)
    counts = d[k].astype(np.int64)
    rep = np.repeat(k, counts)  # one entry per event: its time's index
    frac = np.concatenate([np.arange(c) / c for c in counts])  # l / d for l = 0 .. d-1
    start = first[rep]
    phi = s0[start] - frac * t0[rep]
    num1 = s1[start] - frac[:, None] * t1[rep]
    num2 = s2[start] - frac[:, None, None] * t2[rep]
    with np.errstate(divide="ignore", invalid="ignore"):  # an underflowed risk set: not finite,
        ratio = num1 / phi[:, None]  # which the coordinator's step halving steps back from
        loglik = float(eta[event].sum() - (np.log(phi) + shift).sum())
        gradient = x[event].sum(axis=0) - ratio.sum(axis=0)
        hessian = -(num2 / phi[:, None, None]).sum(axis=0) + ratio.T @ ratio
    return CoxParts(loglik, gradient, (hessian + hessian.T) / 2)


def triangle(matrix: np.ndarray) -> np.ndarray:
    """The upper triangle (with the diagonal) of a symmetric matrix, row by row."""
    return matrix[np.triu_indices(matrix.shape[0])]


def from_triangle(values: np.ndarray, p: int) -> np.ndarray:
    """The symmetric matrix whose upper triangle `triangle` gave."""
    out = np.zeros((p, p))
    out[np.triu_indices(p)] = values
    return out + np.triu(out, 1).T


def concordance_counts(time: np.ndarray, event: np.ndarray, risk: np.ndarray) -> tuple[int, int, int]:
    """(concordant, tied, comparable) pairs of one hospital (Harrell's C, lifelines' counts):
    a higher risk should meet the event earlier."""
    from lifelines.utils.concordance import _concordance_summary_statistics

    correct, tied, pairs = _concordance_summary_statistics(
        np.asarray(time, float), -np.asarray(risk, float), np.asarray(event, bool))
    return int(correct), int(tied), int(pairs)


def km_counts(time: np.ndarray, event: np.ndarray, grid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(number at risk, number of events) at each grid time: at risk = time >= t; events: an
    event at exactly t."""
    time = np.asarray(time, np.float64)
    srt = np.sort(time)
    at_risk = len(time) - np.searchsorted(srt, grid, side="left")
    ev = np.sort(time[np.asarray(event, bool)])
    events = np.searchsorted(ev, grid, side="right") - np.searchsorted(ev, grid, side="left")
    return at_risk.astype(np.int64), events.astype(np.int64)
