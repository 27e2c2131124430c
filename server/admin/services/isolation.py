"""What a hospital's token may see: one rule, applied by the API and the web view alike.

The admin sees everything. A hospital (a site token, or a web-view session signed in with one)
sees:

- its own uploads (accepted, replaced and refused), never another hospital's;
- each round's aggregate-level facts (strategy, parameters, status, expected model, times) and
  its own line of the aggregation report (its count, whether it was excluded and why), never
  another hospital's name, file name, count, weight, hash or distance, and not the aggregate's
  total count (with two hospitals, total minus its own is the other's count);
- an aggregate model (and a start model that is a previous aggregate) only under the release
  rule (`ReleaseRule`): at least ``min_model_sites`` hospitals' updates went into it, no other
  single hospital holds more than ``max_other_share`` of its weight (a model one hospital
  dominates is close to that hospital's weights: all-zero weights with a count of 1 beside
  another hospital's 4,000 gave back that hospital's weights to cosine 1.000000), and, for
  ``/model``, its own share is not negligible;
- round errors rewritten without other hospitals' names (`round_error_for`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fedsplit.server.admin.auth import ADMIN, Principal
from fedsplit.server.admin.config import AdminSettings
from fedsplit.server.admin.errors import PermissionDeniedError

DEFAULT_MIN_MODEL_SITES = 2
#: (n, k) rule's k: the largest share of an aggregate's weight another hospital may hold.
DEFAULT_MAX_OTHER_SHARE = 0.6
#: The downloader's own share, as a fraction of an equal share, below which it is negligible.
DEFAULT_MIN_OWN_SHARE = 0.1
#: Report fields about the aggregate as a whole that hold nothing of another hospital.
AGGREGATE_REPORT_KEYS = ("strategy", "params")
#: Fields of a hospital's own report line it may see (weight, distance and score depend on
#: the others' counts and updates).
OWN_REPORT_KEYS = ("site", "num_examples", "claimed_examples", "excluded", "reason", "flags")
OTHER_HOSPITAL = "another hospital"


def is_admin(principal: Principal) -> bool:
    """Whether ``principal`` sees everything."""
    return principal.role == ADMIN


def sees_site(principal: Principal, *, site_id: int | None = None, site_name: str | None = None) -> bool:
    """Whether ``principal`` may see a row belonging to a hospital (by id when known)."""
    if is_admin(principal):
        return True
    if site_id is not None:
        return site_id == principal.site_id
    return site_name is not None and site_name == principal.site_name


def report_for(principal: Principal, report: dict[str, Any] | None,
               other_names: Iterable[str] = ()) -> dict[str, Any] | None:
    """The aggregation report as ``principal`` may see it: a hospital gets the aggregate-level
    fields and its own line, with other hospitals' names taken out of its reason."""
    if report is None or is_admin(principal):
        return report
    own = [
        {k: entry.get(k) for k in OWN_REPORT_KEYS if k in entry}
        for entry in report.get("sites", []) or []
        if isinstance(entry, dict) and entry.get("site") == principal.site_name
    ]
    for entry in own:
        if entry.get("reason"):
            entry["reason"] = redact_names(str(entry["reason"]), other_names, principal)
    return {**{k: report[k] for k in AGGREGATE_REPORT_KEYS if k in report}, "sites": own}


@dataclass(frozen=True)
class ReleaseRule:
    """When a hospital may download an aggregate (statistical disclosure control's (n, k)
    dominance rule, with n = 1), from the operator's settings.

    ``min_sites``: at least this many hospitals' updates went into it. ``max_other_share``: no
    other single hospital holds more than this share of its weight (the k of the rule: an
    aggregate one hospital dominates is close to that hospital's own weights, whatever the
    number of hospitals). ``min_own_share``: the downloading hospital's own share is at least
    this fraction of an equal share (1/N of N hospitals), so a hospital that sent a negligible
    update, zeros with a count of 1, does not receive what the others built.
    """

    min_sites: int = DEFAULT_MIN_MODEL_SITES
    max_other_share: float = DEFAULT_MAX_OTHER_SHARE
    min_own_share: float = DEFAULT_MIN_OWN_SHARE


def release_rule(settings: AdminSettings) -> ReleaseRule:
    """The operator's release rule (``--min-model-sites``, ``--max-site-share``,
    ``--min-own-share``)."""
    return ReleaseRule(min_sites=settings.min_model_sites, max_other_share=settings.max_site_share,
                       min_own_share=settings.min_own_share)


def shares_in_model(report: dict[str, Any] | None) -> dict[str, float]:
    """Each hospital's share of an aggregate's weight, from its report (excluded updates and
    Krum's unselected ones hold none). The report's ``weight`` when every used update has one,
    else equal shares."""
    if not isinstance(report, dict):
        return {}
    weights: dict[str, float | None] = {}
    for entry in report.get("sites", []) or []:
        if not isinstance(entry, dict) or entry.get("excluded") or entry.get("selected") is False:
            continue
        weight = entry.get("weight")
        if isinstance(weight, int | float) and not isinstance(weight, bool):
            if not math.isfinite(weight) or weight <= 0:
                continue
            weights[str(entry.get("site"))] = weights.get(str(entry.get("site")), 0.0) + float(weight)
        else:
            weights.setdefault(str(entry.get("site")), None)
    if not weights:
        return {}
    if any(w is None for w in weights.values()):
        return {site: 1.0 / len(weights) for site in weights}
    total = sum(w for w in weights.values() if w is not None)
    return {site: (w or 0.0) / total for site, w in weights.items()}


def sites_in_model(report: dict[str, Any] | None) -> int:
    """How many hospitals' updates went into an aggregate, from its report (0 if unknown)."""
    return len(shares_in_model(report))


def release_refusal(principal: Principal, report: dict[str, Any] | None, rule: ReleaseRule, *,
                    contributor: bool = True) -> str | None:
    """Why ``principal`` may not download the aggregate ``report`` describes: ``too_few_sites``,
    ``dominated`` or ``own_share``; None when it may. ``contributor=False`` (a start model, which
    every hospital of the next round needs) leaves the own-share test out."""
    if is_admin(principal):
        return None
    shares = shares_in_model(report)
    if len(shares) < rule.min_sites:
        return "too_few_sites"
    own = shares.get(str(principal.site_name), 0.0)
    others = [share for site, share in shares.items() if site != principal.site_name]
    if others and max(others) > rule.max_other_share:
        return "dominated"
    if contributor and own < rule.min_own_share / len(shares):
        return "own_share"
    return None


def may_download_model(principal: Principal, report: dict[str, Any] | None, rule: ReleaseRule, *,
                       contributor: bool = True) -> bool:
    """Whether ``principal`` may download the aggregate described by ``report``."""
    return release_refusal(principal, report, rule, contributor=contributor) is None


def check_model_download(principal: Principal, report: dict[str, Any] | None, rule: ReleaseRule,
                         what: str, *, contributor: bool = True) -> None:
    """Refuse (403) a hospital an aggregate `release_refusal` holds back; the text says why
    without naming or counting the other hospitals."""
    reason = release_refusal(principal, report, rule, contributor=contributor)
    if reason is None:
        return
    why = {
        "too_few_sites": f"too few hospitals' updates went into it (this server releases "
                         f"aggregates of at least {rule.min_sites} hospitals): it would be one "
                         f"hospital's own weights, or close to them",
        "dominated": f"one other hospital holds more than {rule.max_other_share:.0%} of its weight, "
                     f"so it is close to that hospital's own weights",
        "own_share": "your hospital's update is not in it or holds a negligible share of its "
                     f"weight (less than {rule.min_own_share:.0%} of an equal share), so it is "
                     f"the other hospitals' work",
    }[reason]
    raise PermissionDeniedError(
        f"{what} may not be released to a hospital: {why}. The coordinator can run a round "
        f"with more, or more evenly sized, hospitals. Received: a site token ({reason})"
    )


def redact_names(text: str, names: Iterable[str], principal: Principal) -> str:
    """``text`` with every name in ``names`` other than ``principal``'s own replaced."""
    if is_admin(principal):
        return text
    others = sorted({n for n in names if n and n != principal.site_name}, key=len, reverse=True)
    for name in others:
        text = re.sub(rf"(?<![\w.-]){re.escape(name)}(?![\w-])", OTHER_HOSPITAL, text)
    return text


def round_error_for(principal: Principal, error: str | None) -> str | None:
    """A round's error as ``principal`` may read it: hospitals get the kind of failure only
    (the coordinator's text names the hospitals that were late or failed)."""
    if error is None or is_admin(principal):
        return error
    lowered = error.lower()
    if "too few" in lowered or "late" in lowered or "not enough" in lowered:
        return ("Not aggregated: too few hospitals replied in time. The coordinator sees which "
                "ones.")
    return "Not aggregated: the round failed on the server. The coordinator sees the details."
