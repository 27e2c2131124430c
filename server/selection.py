"""Which round's global model the horizontal coordinator keeps (``global.h5``).

The rule is `protocol.selection` (the baselines' rule): after each round the global model is
scored by the federated evaluation that already runs, on the validation rows each hospital cut
from its own training rows (``val-fraction``; never test rows), and the count-weighted mean of
the hospitals' task metric (accuracy, or r2) decides; ties go to the later round. With run
config ``keep=last`` the last round's model is kept. Only rounds that produced a new global model
(``models/round-NNN.h5``) are candidates.

The choice is recomputed from the rounds recorded in ``history.json`` (`select`), so a restarted
coordinator that continues a run keeps the round and score the first one had kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from fedsplit.protocol.recipe import RecipeModelId, is_recipe_id
from fedsplit.protocol.selection import BestRound, selection_metric
from fedsplit.protocol.survival import pooled_concordance


def task_metric(model_id: str | None, rounds: Iterable[Mapping[str, Any]] = ()) -> str:
    """The selection metric of a run: from the model id's task (``kind/task/...``), else from
    the metric its evaluations report (``accuracy``, else ``r2``)."""
    if model_id and is_recipe_id(model_id):  # a recipe names its own selection metric
        return RecipeModelId.from_id(model_id).selection
    parts = str(model_id or "").split("/")
    if len(parts) > 1 and parts[1] in ("classification", "regression"):
        return selection_metric(parts[1])
    for entry in rounds:
        metrics = entry.get("evaluate", {}).get("metrics", {})
        for key in ("accuracy", "r2"):
            if key in metrics:
                return key
    return "accuracy"


def round_score(entry: Mapping[str, Any], metric: str) -> float | None:
    """The round's federated validation score, or None (not evaluated, or no such metric).
    A survival C-index is the one over the hospitals' summed concordance pairs when they sent
    them (`protocol.survival.pooled_concordance`), not the mean of their C-indices."""
    metrics = entry.get("evaluate", {}).get("metrics", {})
    if metric == "c_index" and (pooled := pooled_concordance(metrics)) is not None:
        return pooled
    value = metrics.get(metric)
    return float(value) if isinstance(value, int | float) else None


def select(rounds: Iterable[Mapping[str, Any]], keep: str, model_id: str | None) -> dict[str, Any]:
    """The kept round over the recorded ``rounds`` (in order): ``keep``, ``metric``,
    ``rounds_kept`` (0: no model yet), ``val_score`` (the kept round's) and per round
    ``val_metric`` (``{"round", "score", "examples"}``; score None when not scored)."""
    rounds = [r for r in rounds if "model" in r]
    metric = task_metric(model_id, rounds)
    picker = BestRound(keep)
    scored = []
    for entry in sorted(rounds, key=lambda r: int(r["round"])):
        value = round_score(entry, metric)
        picker.offer(value, round=int(entry["round"]))
        examples = sum(int(s.get("num_examples", 0)) for s in entry.get("evaluate", {}).get("sites", [])
                       if not s.get("excluded"))
        scored.append({"round": int(entry["round"]), "score": value, "examples": examples})
    return {"keep": keep, "metric": metric, "rounds_kept": picker.round,
            "val_score": picker.score if picker.round and picker.score == picker.score else None,
            "val_metric": scored}
