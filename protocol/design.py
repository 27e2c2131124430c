"""The design a model fits: the agreed schema's encoded features, less what fedsplit itself
derived and that carries nothing at any hospital (issue 41).

fedsplit derives model inputs from the hospitals' columns (`protocol.schema`): a text column's
one-hot levels (``name=value``) and a missing-value indicator (``name:missing``, also set by a
category withheld as rare at a hospital: the rare-category group). Whether one of them carries
anything is known only once the hospitals have encoded their rows, so the schema merge adds
them conservatively: a category withheld as rare at one hospital adds an indicator that stays 0
when another hospital names the category. **Derived columns never stop a run**; the user's
own columns are the user's to leave out. The one rule, for every task:

- **constant**: a derived feature that takes one value in every row at every hospital (an
  indicator never set, a level no row holds, or one every row holds) is dropped from the schema
  (`prune_schema`, run by the coordinator on the pooled moments before the model is built: the
  horizontal models, the learned survival models and the exact Cox fit all read the pruned
  schema, and it travels with the model to ``fedsplit predict``);
- **collinear** (the linear Cox fits, whose unpenalized fit has no unique optimum otherwise,
  and whose strata make a feature constant within each hospital carry nothing): a derived
  feature that adds no direction to the covariates before it (the user's columns first, then
  one-hot levels, then indicators) is left out of the fit (`independent`, on the summed
  Hessian at 0, no extra exchange; `server.survival.newton.fit`).

Each drop is one warning line per source column, naming the column, what was dropped and why.
A user's own constant or collinear column still stops a Cox fit, naming it
(`server.survival.newton`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

MISSING_SUFFIX = ":missing"

#: why a derived feature is left out ({col}: its source column)
NEVER_SET = "0 in every row at every hospital: no value of {col!r} is missing or unrecognised"
NEVER_HELD = "0 in every row at every hospital: no row holds the category"
ALWAYS_HELD = "1 in every row at every hospital: every row holds the category"
ALWAYS_SET = "1 in every row at every hospital: no value of {col!r} is known"
COLLINEAR = ("collinear with the other covariates: a combination of them, or constant within "
             "each hospital, in every risk set")


def derived_features(schema: Any) -> dict[str, str]:
    """Encoded feature name -> its source column, for every feature fedsplit derives (a text
    column's one-hot levels, every missing indicator); a numeric or boolean column's own value
    is the user's and is not listed."""
    out: dict[str, str] = {}
    for col in schema.columns:
        names = col.encoded_names()
        own = [] if col.kind == "categorical" else names[:1]
        out.update({n: col.name for n in names if n not in own})
    return out


def is_indicator(name: str) -> bool:
    """Whether an encoded feature is a missing-value indicator."""
    return name.endswith(MISSING_SUFFIX)


def constant_mask(count: Any, total: Any, sumsq: Any) -> np.ndarray:
    """Per feature, whether its pooled values are all one (variance at most 1e-12 of the
    squared magnitude; the rule `server.survival.newton.standardization` refuses)."""
    n = np.maximum(np.rint(np.asarray(count, np.float64)), 1.0)
    mean = np.asarray(total, np.float64) / n
    var = np.maximum(np.asarray(sumsq, np.float64) / n - mean**2, 0.0)
    return var <= 1e-12 * np.maximum(np.abs(mean), 1.0) ** 2


def drop_warnings(dropped: Mapping[str, str], sources: Mapping[str, str]) -> list[str]:
    """One line per source column: the inputs fedsplit derived from it and left out, and why."""
    by_source: dict[str, dict[str, list[str]]] = {}
    for name, why in dropped.items():
        by_source.setdefault(sources[name], {}).setdefault(why, []).append(name)
    lines = []
    for col, reasons in by_source.items():
        parts = "; ".join(f"{', '.join(repr(n) for n in names)} ({why.format(col=col)})"
                          for why, names in reasons.items())
        lines.append(f"column {col!r}: left out input(s) fedsplit derives from it, as they carry "
                     f"nothing: {parts}. The run goes on without them (nothing to fix)")
    return lines


def why_constant(name: str, mean: float) -> str:
    """The reason text of a constant derived feature of pooled mean ``mean`` (0 or 1)."""
    if is_indicator(name):
        return NEVER_SET if mean < 0.5 else ALWAYS_SET
    return NEVER_HELD if mean < 0.5 else ALWAYS_HELD


@dataclass(frozen=True)
class Pruned:
    """`prune_schema`'s result: the schema without its constant derived features, the kept
    features' positions among the old schema's encoded features, and one warning per source
    column (none, and the same schema, when nothing was dropped)."""

    schema: Any
    keep: list[int]
    dropped: dict[str, str]
    warnings: list[str]


def prune_schema(schema: Any, count: Any, total: Any, sumsq: Any) -> Pruned:
    """Drop every derived feature (`derived_features`) that is constant over the pooled rows
    (``count``, ``total``, ``sumsq``: per encoded feature of ``schema``, summed over the
    hospitals) from ``schema``: an indicator never (or always) set is switched off, a level no
    row (or every row) holds leaves the vocabulary. Every other feature encodes as before (a
    dropped level held by no row changes no row; a level every row holds leaves a column that
    says nothing), so the hospitals' moments of the kept features stay valid (``keep``)."""
    names = list(schema.feature_names)
    if len(names) != len(np.atleast_1d(np.asarray(count))):
        return Pruned(schema, list(range(len(names))), {}, [])
    sources = derived_features(schema)
    flat = constant_mask(count, total, sumsq)
    n = np.maximum(np.rint(np.asarray(count, np.float64)), 1.0)
    mean = np.asarray(total, np.float64) / n
    dropped = {name: why_constant(name, float(mean[i])) for i, name in enumerate(names)
               if flat[i] and name in sources}
    if not dropped:
        return Pruned(schema, list(range(len(names))), {}, [])
    columns = []
    for col in schema.columns:
        cats = tuple(c for c in col.categories if f"{col.name}={c}" not in dropped)
        indicator = col.missing_indicator and f"{col.name}{MISSING_SUFFIX}" not in dropped
        columns.append(replace(col, categories=cats, missing_indicator=indicator))
    pruned = replace(schema, columns=tuple(columns))
    kept = set(pruned.feature_names)
    return Pruned(pruned, [i for i, name in enumerate(names) if name in kept], dropped,
                  drop_warnings(dropped, sources))


def independent(gram: np.ndarray, names: Sequence[str], derived: Mapping[str, str],
                candidates: Sequence[int] | None = None, *, tolerance: float = 1e-9
                ) -> tuple[list[int], dict[str, str]]:
    """The positions to fit among ``candidates`` (default: all) of a positive semi-definite
    ``gram`` (the negated summed Hessian at 0 on standardized covariates), and the derived
    features left out as collinear (name -> why). The user's covariates are always kept (their
    own collinearity is refused by the fit, naming them); then one-hot levels, then missing
    indicators, each in order, kept when it adds a direction (an eigenvalue above
    ``tolerance`` times the largest of ``gram``)."""
    gram = np.asarray(gram, np.float64)
    pool = list(range(len(names))) if candidates is None else list(candidates)
    top = max(float(np.linalg.eigvalsh(gram[np.ix_(pool, pool)]).max()) if pool else 0.0, 1e-300)

    def rank(idx: list[int]) -> int:
        if not idx:
            return 0
        return int(np.sum(np.linalg.eigvalsh(gram[np.ix_(idx, idx)]) > tolerance * top))

    user = [i for i in pool if names[i] not in derived]
    levels = [i for i in pool if names[i] in derived and not is_indicator(names[i])]
    flags = [i for i in pool if names[i] in derived and is_indicator(names[i])]
    kept, have = list(user), rank(user)
    dropped: dict[str, str] = {}
    for i in levels + flags:
        more = rank([*kept, i])
        if more > have:
            kept.append(i)
            have = more
        else:
            dropped[names[i]] = COLLINEAR
    return sorted(kept), dropped
