"""The coordinator's side of the exact federated Cox model: Newton-Raphson on the sum of the
hospitals' stratified log partial likelihoods, from summed gradients and Hessians only.

Conventions are lifelines' ``CoxPHFitter(strata=[hospital], penalizer=P)`` (l1_ratio 0):

- covariates are standardized with the pooled mean and standard deviation (ddof 1) before the
  fit, from the hospitals' summed count, sum and sum of squares (`standardization`);
- the penalty on the standardized coefficients b is ``n * P * ||b||^2 / 2`` (n: all rows), so
  the gradient gains ``-n P b`` and the Hessian ``-n P I`` (`Newton.penalized`);
- coefficients and their covariance go back to the original scale by dividing by the standard
  deviations; the covariance is ``inv(-H)`` of the penalized Hessian at the last coefficients;
- the log-likelihood reported is the penalized one, at those coefficients.

The Newton steps are full steps (lifelines damps them to 0.95, and so needs more rounds; both
reach the same maximum), halved while the log-likelihood falls. The fit stops when the step's
norm is below `TOLERANCE`, or after `MAX_ROUNDS` evaluations (`ConvergenceFailed`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fedsplit.protocol import design as pdesign
from fedsplit.protocol.errors import ConfigError, FederationError
from fedsplit.protocol.record.survival import CoxCovariate, CoxDocument, NewtonStep

MAX_ROUNDS = 15
TOLERANCE = 1e-9
Z_95 = 1.959963984540054  # lifelines: inv_normal_cdf(1 - 0.05 / 2)
PENALIZER_ADVICE = ("add a small ridge penalty (--penalizer 0.01, lifelines' convention: "
                    "n * P * ||b||^2 / 2 on standardized coefficients) or leave the column(s) "
                    "out with --ignore-column")


class CollinearError(ConfigError):
    """Constant or collinear covariates: the unpenalized fit has no unique maximum."""


class ConvergenceFailed(FederationError):
    """Newton-Raphson did not converge within its rounds."""


@dataclass(frozen=True)
class Standardization:
    """Pooled rows, mean and standard deviation (ddof 1) of every covariate."""

    rows: int
    mean: np.ndarray
    std: np.ndarray


def standardization(names: Sequence[str], count: float | np.ndarray, total: np.ndarray,
                    sumsq: np.ndarray) -> Standardization:
    """Pooled mean and sample standard deviation from summed moments; constant columns refused.
    ``count``: the rows, or per covariate its number of values (missing ones not counted)."""
    n = np.rint(np.asarray(count, np.float64))
    if np.any(n < 2):
        raise ConfigError(f"A Cox model needs at least 2 values of every covariate in all. "
                          f"Received: {int(n.min())}")
    mean = np.asarray(total, np.float64) / n
    var = (np.asarray(sumsq, np.float64) - n * mean**2) / (n - 1)
    scale = np.maximum(np.abs(mean), 1.0) ** 2
    constant = [name for name, v, s in zip(names, var, scale, strict=True) if v <= 1e-12 * s]
    if constant:
        raise CollinearError(
            f"Covariate(s) {', '.join(repr(c) for c in constant)} take one value in every row at "
            f"every hospital: a Cox model cannot estimate their effect (no penalty helps). Leave "
            f"them out with --ignore-column. Received: {len(constant)} constant column(s)")
    return Standardization(int(n.max()), mean, np.sqrt(np.maximum(var, 0.0)))


@dataclass
class Design:
    """Which covariates a Cox fit uses (`protocol.design`: what fedsplit derived and carries
    nothing is left out; the user's own constant or collinear columns are refused). ``names``
    are every covariate the hospitals encode; ``mean``/``std`` the standardization broadcast
    for all of them (a dropped constant one: its value and 1, so it reads as 0); ``used`` the
    positions fitted; ``dropped`` name -> why; ``warnings`` one line per source column."""

    names: list[str]
    derived: dict[str, str]
    rows: int
    mean: np.ndarray
    std: np.ndarray
    used: list[int]
    dropped: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def used_names(self) -> list[str]:
        """The fitted covariates' names."""
        return [self.names[i] for i in self.used]

    def full(self, beta: np.ndarray) -> np.ndarray:
        """Coefficients of the fitted covariates -> one per covariate (0 where left out)."""
        out = np.zeros(len(self.names))
        out[self.used] = beta
        return out

    def standardization(self) -> Standardization:
        """The fitted covariates' pooled mean and standard deviation."""
        return Standardization(self.rows, self.mean[self.used], self.std[self.used])


def design(names: Sequence[str], derived: Mapping[str, str], count: float | np.ndarray,
           total: np.ndarray, sumsq: np.ndarray) -> Design:
    """The pooled standardization (`standardization`), less the derived covariates that take one
    value in every row (dropped with a warning); a user's constant column is refused."""
    names = list(names)
    count = np.broadcast_to(np.asarray(count, np.float64), len(names))
    total, sumsq = np.asarray(total, np.float64), np.asarray(sumsq, np.float64)
    mean = total / np.maximum(np.rint(count), 1.0)
    flat = pdesign.constant_mask(count, total, sumsq)
    drop = {n: pdesign.why_constant(n, float(mean[i])) for i, n in enumerate(names)
            if flat[i] and n in derived}
    used = [i for i, n in enumerate(names) if n not in drop]
    if not used:
        raise CollinearError(
            f"Every covariate fedsplit derived ({', '.join(repr(n) for n in names[:6])}) takes one "
            f"value in every row at every hospital: nothing is left for a Cox model to fit. Add "
            f"a covariate that varies. Received: {len(names)} constant derived covariate(s)")
    std = standardization([names[i] for i in used], count[used], total[used], sumsq[used])
    sd = np.ones(len(names))
    mean[used], sd[used] = std.mean, std.std
    return Design(names, dict(derived), std.rows, mean, sd, used, drop,
                  pdesign.drop_warnings(drop, derived))


def fit(plan: Design, evaluate: Callable[[np.ndarray], tuple[float, np.ndarray, np.ndarray]],
        penalizer: float, *, max_rounds: int = MAX_ROUNDS, tolerance: float = TOLERANCE
        ) -> NewtonResult:
    """`newton` on ``plan``'s covariates: ``evaluate`` takes and returns every covariate's
    coefficient (0 for the ones left out). Its first evaluation, at 0, also decides which
    derived covariates are collinear with the others (`protocol.design.independent`; dropped
    from ``plan`` with a warning, no extra evaluation)."""
    first = evaluate(np.zeros(len(plan.names)))
    used, collinear = pdesign.independent(-first[2], plan.names, plan.derived, plan.used)
    if collinear:
        plan.used = used
        plan.dropped.update(collinear)
        plan.warnings[:] = pdesign.drop_warnings(plan.dropped, plan.derived)
    pick = np.asarray(plan.used, dtype=np.int64)
    pending = [first]

    def reduced(beta: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
        ll, g, h = pending.pop() if pending and not np.any(beta) else evaluate(plan.full(beta))
        pending.clear()
        return ll, np.asarray(g)[pick], np.asarray(h)[np.ix_(pick, pick)]

    return newton(reduced, plan.used_names, plan.rows, penalizer, max_rounds=max_rounds,
                  tolerance=tolerance)


@dataclass
class NewtonResult:
    """The fit on the standardized scale, and how it went."""

    beta: np.ndarray
    hessian: np.ndarray  # penalized, at beta
    loglik: float  # penalized, at beta
    loglik_null: float  # unpenalized, at 0
    rounds: int
    steps: list[NewtonStep] = field(default_factory=list)


def collinear_columns(hessian: np.ndarray, names: Sequence[str]) -> list[list[str]]:
    """Groups of covariates spanning the (near) null space of ``-hessian`` (standardized)."""
    values, vectors = np.linalg.eigh(-hessian)
    top = max(float(values.max()), 1e-300)
    groups = []
    for k in np.flatnonzero(values <= 1e-9 * top):
        v = np.abs(vectors[:, k])
        groups.append([names[i] for i in np.flatnonzero(v >= 0.05 * v.max())])
    return groups


def newton(evaluate: Callable[[np.ndarray], tuple[float, np.ndarray, np.ndarray]],
           names: Sequence[str], rows: int, penalizer: float, *,
           max_rounds: int = MAX_ROUNDS, tolerance: float = TOLERANCE) -> NewtonResult:
    """Maximize the summed (penalized) log partial likelihood.

    ``evaluate(beta)`` returns the hospitals' summed (log-likelihood, gradient, Hessian) at
    standardized ``beta``: one federated round each.
    """
    p = len(names)
    ridge = rows * penalizer

    def penalized(beta: np.ndarray) -> tuple[float, np.ndarray, np.ndarray, float]:
        ll, g, h = evaluate(beta)
        raw = ll
        return (ll - 0.5 * ridge * float(beta @ beta), g - ridge * beta,
                h - ridge * np.eye(p), raw)

    beta = np.zeros(p)
    ll, g, h, ll_null = penalized(beta)
    rounds, steps = 1, []
    if penalizer == 0 and (groups := collinear_columns(h, names)):
        involved = {c for grp in groups for c in grp}
        listed = ", ".join(repr(c) for c in names if c in involved)
        raise CollinearError(
            f"Covariates are collinear (some are combinations of others in every risk set, e.g. "
            f"one-hot columns of one variable that sum to 1): {listed}. The unpenalized Cox "
            f"model has no unique fit; {PENALIZER_ADVICE}. Received: {len(groups)} collinear "
            f"direction(s) among {p} covariates")
    while True:
        try:
            delta = np.linalg.solve(-h, g)
        except np.linalg.LinAlgError as e:
            raise CollinearError(f"The Hessian is singular at round {rounds} ({e}); {PENALIZER_ADVICE}. "
                                 f"Received: {p} covariates") from e
        size = float(np.linalg.norm(delta))
        steps.append(NewtonStep(round=rounds, loglik=ll, step_norm=size))
        if size < tolerance:
            return NewtonResult(beta, h, ll, ll_null, rounds, steps)
        step = 1.0
        while True:
            if rounds >= max_rounds:
                raise ConvergenceFailed(
                    f"Newton-Raphson did not converge in {max_rounds} rounds (last step norm "
                    f"{size:.3g}): a covariate may separate the events completely, or the data "
                    f"are nearly collinear; {PENALIZER_ADVICE}. Received: penalizer={penalizer}")
            trial = beta + step * delta
            t_ll, t_g, t_h, _ = penalized(trial)
            rounds += 1
            if np.isfinite(t_ll) and t_ll >= ll - 1e-12 * abs(ll):
                break
            step /= 2  # the likelihood fell: go half as far
        beta, ll, g, h = trial, t_ll, t_g, t_h


@dataclass(frozen=True)
class CoxTable:
    """Per-covariate results on the original scale."""

    names: list[str]
    coef: np.ndarray
    se: np.ndarray
    covariance: np.ndarray

    def rows(self) -> dict[str, CoxCovariate]:
        """name -> coefficient, SE, hazard ratio, 95% intervals, z, p (lifelines' columns)."""
        from scipy.stats import norm

        out = {}
        for name, c, s in zip(self.names, self.coef, self.se, strict=True):
            z = c / s
            lo, hi = c - Z_95 * s, c + Z_95 * s
            out[name] = CoxCovariate(
                coef=float(c), se=float(s), hazard_ratio=math.exp(c), coef_lower_95=float(lo),
                coef_upper_95=float(hi), hr_lower_95=math.exp(lo), hr_upper_95=math.exp(hi),
                z=float(z), p=float(2 * norm.sf(abs(z))))
        return out


def original_scale(result: NewtonResult, names: Sequence[str], std: np.ndarray) -> CoxTable:
    """Coefficients and covariance on the covariates' own scale (lifelines' rescaling)."""
    coef = result.beta / std
    cov = np.linalg.inv(-result.hessian) / np.outer(std, std)
    return CoxTable(list(names), coef, np.sqrt(np.diag(cov)), cov)


def concordance(correct: float, tied: float, pairs: float) -> float | None:
    """Harrell's C from summed pair counts (lifelines' ratio); None without comparable pairs."""
    return None if pairs <= 0 else float((correct + 0.5 * tied) / pairs)


def summary(table: CoxTable, result: NewtonResult, *, rows: int, events: int, penalizer: float,
            hospitals: Sequence[str], c_index: float | None, **fields: Any) -> CoxDocument:
    """The cox.json document (`protocol.record.survival.CoxDocument`): the fit, and ``fields``
    (the caller's: concordance note, per-site figures, secure aggregation, timings)."""
    return CoxDocument(
        model="Cox proportional hazards, stratified by hospital (each its own baseline hazard)",
        ties="efron", penalizer=penalizer, l1_ratio=0.0, hospitals=list(hospitals), rows=rows,
        events=events, covariates=table.rows(), log_likelihood=result.loglik,
        log_likelihood_null=result.loglik_null, newton_rounds=result.rounds,
        newton_steps=result.steps, concordance=c_index, **fields)
