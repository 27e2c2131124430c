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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from fedsplit.protocol.aggregation_report import AggregationReport, SiteReport
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
#: A round's aggregation report: the model, or the JSON the admin database stores of it
#: (`aggregation.files.aggregate_files` writes it; read through `stored_report`).
ReportLike = AggregationReport | Mapping[str, Any] | None


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


def stored_report(report: ReportLike) -> AggregationReport | None:
    """A round's report as the model (`protocol.aggregation_report.AggregationReport`); None when there is
    none, or the stored JSON does not read as one (it then counts as no report: no hospital is
    known to be in the aggregate)."""
    if report is None or isinstance(report, AggregationReport):
        return report
    try:
        return AggregationReport.model_validate(dict(report))
    except (TypeError, ValueError):
        return None


def visible_report(principal: Principal, report: ReportLike,
                   other_names: Iterable[str] = ()) -> AggregationReport | None:
    """The aggregation report as ``principal`` may see it: a hospital gets the aggregate-level
    fields (`AGGREGATE_REPORT_KEYS`) and its own line (`OWN_REPORT_KEYS`), with other
    hospitals' names taken out of its reason; every other field is left unset."""
    report = stored_report(report)
    if report is None or is_admin(principal):
        return report
    own = [SiteReport(**line.model_dump(include=set(OWN_REPORT_KEYS)))
           for line in report.sites if line.site == principal.site_name]
    for line in own:
        if line.reason:
            line.reason = redact_names(line.reason, other_names, principal)
    return AggregationReport(**report.model_dump(include=set(AGGREGATE_REPORT_KEYS)), sites=own)


def report_for(principal: Principal, report: ReportLike,
               other_names: Iterable[str] = ()) -> dict[str, Any] | None:
    """`visible_report` as the API's JSON: for a hospital only the keys it may see."""
    seen = visible_report(principal, report, other_names)
    if seen is None or is_admin(principal):
        return seen.to_json() if seen is not None else None
    return {**seen.model_dump(mode="json", include=set(AGGREGATE_REPORT_KEYS)),
            "sites": [line.model_dump(mode="json", include=set(OWN_REPORT_KEYS))
                      for line in seen.sites]}


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


def shares_in_model(report: ReportLike) -> dict[str, float]:
    """Each hospital's share of an aggregate's weight, from its report (excluded updates and
    Krum's unselected ones hold none). The report's ``weight`` when every used update has one,
    else equal shares."""
    report = stored_report(report)
    if report is None:
        return {}
    weights: dict[str, float | None] = {}
    for line in report.sites:
        if not line.used:
            continue
        name, weight = str(line.site), line.weight
        if weight is not None:
            if not math.isfinite(weight) or weight <= 0:
                continue
            weights[name] = weights.get(name, 0.0) + weight
        else:
            weights.setdefault(name, None)
    if not weights:
        return {}
    if any(w is None for w in weights.values()):
        return {site: 1.0 / len(weights) for site in weights}
    total = sum(w for w in weights.values() if w is not None)
    return {site: (w or 0.0) / total for site, w in weights.items()}


def sites_in_model(report: ReportLike) -> int:
    """How many hospitals' updates went into an aggregate, from its report (0 if unknown)."""
    return len(shares_in_model(report))


def release_refusal(principal: Principal, report: ReportLike, rule: ReleaseRule, *,
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


def may_download_model(principal: Principal, report: ReportLike, rule: ReleaseRule, *,
                       contributor: bool = True) -> bool:
    """Whether ``principal`` may download the aggregate described by ``report``."""
    return release_refusal(principal, report, rule, contributor=contributor) is None


def check_model_download(principal: Principal, report: ReportLike, rule: ReleaseRule,
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
