"""A round's Keras layout: which attributes of the first Keras upload are kept, and where.

``?format=keras`` rebuilds the aggregate in the layout the hospitals uploaded, from the first
Keras upload's groups and attributes, and hands it to every hospital. Any attribute kept would
travel from one hospital to all the others: a root attribute "hosp-b trained on ward 7 ..." in
hosp-b's legacy Keras file appeared in hosp-a's download. Only what Keras needs to load the
weights is kept (`ALLOWED_ATTRS`: the layer and weight names, the Keras version and backend),
with values of bounded size (names must be the file's own group and parameter names), and the
layout as a whole is capped (`MAX_LAYOUT_BYTES`).

The layout is stored in its own table (`RoundKerasLayout`), not in the round's row: a 48 MiB
attribute in the row made every ``GET /rounds`` 4x slower. The row keeps ``{"kind": ...}``;
rounds stored the old way are moved at start (`move_layouts_out_of_rounds`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from fedsplit.protocol.keras_layout import KerasLayout
from fedsplit.server.admin.errors import UploadRefusedError
from fedsplit.server.admin.tables import Round, RoundKerasLayout
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

#: Attribute -> where it may appear: Keras's own, nothing else.
ALLOWED_ATTRS = {
    "layer_names": "root",  # legacy Keras: the layers, in order
    "backend": "root",
    "keras_version": "root",
    "weight_names": "group",  # legacy Keras: a layer's weights, in order
    "name": "group",  # Keras 3: a layer's vars group names its layer
}
#: A version or backend value: short, plain.
_PLAIN_VALUE = re.compile(r"^[A-Za-z0-9._+-]{1,64}$")
#: The kept layout, JSON-encoded: names of every group and parameter fit in this for any model a
#: hospital trains (about 100 bytes a parameter).
MAX_LAYOUT_BYTES = 4 * 1024 * 1024


def _kept(attrs: dict[str, Any], where: str, names: set[str], path: str = "") -> dict[str, Any]:
    kept = {}
    for key, item in attrs.items():
        if ALLOWED_ATTRS.get(key) != where or not isinstance(item, dict):
            continue
        values = item.get("v")
        if key in ("backend", "keras_version"):
            if item.get("t") == "str" and isinstance(values, str) and _PLAIN_VALUE.match(values):
                kept[key] = item
        elif key == "name":  # layers/NAME/vars: NAME, the group's own layer
            parts = path.split("/")
            if item.get("t") == "str" and len(parts) >= 2 and values == parts[-2]:
                kept[key] = item
        elif values == []:
            kept[key] = item  # an empty list (a model's top-level weights)
        elif item.get("t") == "str_list" and isinstance(values, list) and all(
                isinstance(v, str) and v in names for v in values):
            kept[key] = item  # names of the file's own groups and parameters, nothing else
    return kept


def sanitize(layout: KerasLayout) -> KerasLayout:
    """``layout`` with only `ALLOWED_ATTRS` (layer and weight names must name the file's own
    groups and datasets); refuse (``too_large``) one over `MAX_LAYOUT_BYTES`."""
    groups = [g for g in layout.get("groups", []) if isinstance(g, dict)]
    datasets = [d for d in layout.get("datasets", []) if isinstance(d, dict)]
    group_paths = {str(g.get("path", "")) for g in groups}
    # legacy layer_names are root group names; weight_names are paths below the root
    names = group_paths | {p.rsplit("/", 1)[-1] for p in group_paths}
    names |= {str(d.get("path", "")) for d in datasets}
    names |= {p.split("/", 1)[-1] for p in names if "/" in p}
    kept: KerasLayout = {
        "kind": layout.get("kind"),
        "root_attrs": _kept(layout.get("root_attrs", {}) or {}, "root", names),
        "groups": [{"path": g.get("path"),
                    "attrs": _kept(g.get("attrs", {}) or {}, "group", names, str(g.get("path", "")))}
                   for g in groups],
        "datasets": datasets,
    }
    size = len(json.dumps(kept, separators=(",", ":")))
    if size > MAX_LAYOUT_BYTES:
        raise UploadRefusedError(
            f"The Keras file's layout (its group and parameter names) takes {size} bytes, more "
            f"than the {MAX_LAYOUT_BYTES} this server keeps for a round. Upload a fedsplit weight "
            f"file (`fedsplit export`) instead. Received: {size} bytes of names",
            "too_large",
        )
    return kept


def set_layout(session: Session, rnd: Round, layout: KerasLayout) -> None:
    """Store ``layout`` (sanitized) as ``rnd``'s; the round's row keeps its kind only."""
    kept = sanitize(layout)
    rnd.keras_layout = {"kind": kept["kind"]}
    session.merge(RoundKerasLayout(round_id=rnd.id, layout=kept))


def get_layout(session: Session, rnd: Round) -> KerasLayout | None:
    """``rnd``'s Keras layout (sanitized again: rounds stored before the allow-list), or None."""
    if rnd.keras_layout is None:
        return None
    row = session.get(RoundKerasLayout, rnd.id)
    if row is not None:
        return sanitize(row.layout)
    return sanitize(rnd.keras_layout) if "datasets" in rnd.keras_layout else None


def move_layouts_out_of_rounds(sessions: sessionmaker[Session]) -> int:
    """Move layouts stored whole in round rows (before issue 33) to their table; return how many."""
    moved = 0
    with sessions() as session:
        for rnd in session.scalars(select(Round).where(Round.keras_layout.is_not(None))):
            if isinstance(rnd.keras_layout, dict) and "datasets" in rnd.keras_layout:
                try:
                    set_layout(session, rnd, rnd.keras_layout)
                except UploadRefusedError:  # too large even when cut down: keep the kind only
                    rnd.keras_layout = {"kind": rnd.keras_layout.get("kind")}
                moved += 1
        session.commit()
    return moved
