"""What a hospital's token may see: one rule, applied by the API and the web view alike.

The admin sees everything. A hospital (a site token, or a web-view session signed in with one)
sees:

- its own uploads (accepted, replaced and refused), never another hospital's;
- each round's aggregate-level facts (strategy, parameters, status, expected model, times) and
  its own line of the aggregation report (its count, whether it was excluded and why), never
  another hospital's name, file name, count, weight, hash or distance, and not the aggregate's
  total count (with two hospitals, total minus its own is the other's count);
- an aggregate model (and a start model that is a previous aggregate) only when at least
  ``min_model_sites`` hospitals' updates went into it (``AdminSettings.min_model_sites``,
  default `DEFAULT_MIN_MODEL_SITES`): a model built from one hospital is that hospital's
  weights;
- round errors rewritten without other hospitals' names (`round_error_for`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from fedsplit.server.admin.auth import ADMIN, Principal
from fedsplit.server.admin.errors import PermissionDeniedError

DEFAULT_MIN_MODEL_SITES = 2
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


def sites_in_model(report: dict[str, Any] | None) -> int:
    """How many hospitals' updates went into an aggregate, from its report (0 if unknown)."""
    if not isinstance(report, dict):
        return 0
    used = {
        str(entry.get("site"))
        for entry in report.get("sites", []) or []
        if isinstance(entry, dict) and not entry.get("excluded") and entry.get("selected") is not False
        and (entry.get("weight") is None or entry.get("weight") != 0)
    }
    return len(used)


def may_download_model(principal: Principal, report: dict[str, Any] | None, min_sites: int) -> bool:
    """Whether ``principal`` may download the aggregate described by ``report``."""
    return is_admin(principal) or sites_in_model(report) >= min_sites


def check_model_download(principal: Principal, report: dict[str, Any] | None, min_sites: int,
                         what: str) -> None:
    """Refuse (403) a hospital an aggregate built from fewer than ``min_sites`` hospitals."""
    if not may_download_model(principal, report, min_sites):
        used = sites_in_model(report)
        raise PermissionDeniedError(
            f"{what} was built from {used} hospital(s), fewer than this server's minimum of "
            f"{min_sites}: it would be one hospital's own weights, so hospitals may not download "
            f"it. The coordinator can run a round with more hospitals. Received: a site token"
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
