"""Which round's global model the horizontal coordinator keeps (``global.h5``).

The rule is `protocol.selection` (the baselines' rule): after each round the global model is
scored by the federated evaluation that already runs, on the validation rows each hospital cut
from its own training rows (``val-fraction``; never test rows), and the count-weighted mean of
the hospitals' task metric (accuracy, or r2) decides; ties go to the later round. With run
config ``keep=last`` the last round's model is kept. Only rounds that produced a new global model
(``models/round-NNN.h5``) are candidates.

The choice is recomputed from the rounds recorded in ``history.json`` (`select`: the record's
`RoundEntry` list in, its `Selection` out), so a restarted coordinator that continues a run keeps
the round and score the first one had kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from fedsplit.protocol.recipe import model_selection
from fedsplit.protocol.record.common import Metric
from fedsplit.protocol.record.horizontal import RoundEntry, Selection, ValScore
from fedsplit.protocol.selection import BestRound
from fedsplit.protocol.survival import pooled_concordance

#: the metrics a run's evaluations are searched for when its model id names no task
TASK_METRICS = ("accuracy", "r2")


def task_metric(model_id: str | None, rounds: Iterable[RoundEntry] = ()) -> str:
    """The selection metric of a run: from the model id's task (``kind/task/...``), else from
    the metric its evaluations report (``accuracy``, else ``r2``)."""
    if (metric := model_selection(model_id)) is not None:  # a recipe's own, or by the task
        return metric
    for entry in rounds:
        reported = entry.evaluate.metrics if entry.evaluate is not None else {}
        for key in TASK_METRICS:
            if key in reported:
                return key
    return "accuracy"


def metrics_score(metrics: Mapping[str, Metric], metric: str) -> float | None:
    """The score ``metric`` of a federated evaluation's aggregated ``metrics``, or None (no such
    metric). A survival C-index is the one over the hospitals' summed concordance pairs when
    they sent them (`protocol.survival.pooled_concordance`), not the mean of their C-indices."""
    if metric == "c_index" and (pooled := pooled_concordance(metrics)) is not None:
        return pooled
    value = metrics.get(metric)
    return float(value) if isinstance(value, int | float) else None


def round_score(entry: RoundEntry, metric: str) -> float | None:
    """The round's federated validation score, or None (not evaluated, or no such metric):
    `metrics_score` of its evaluation."""
    return metrics_score(entry.evaluate.metrics, metric) if entry.evaluate is not None else None


def select(rounds: Iterable[RoundEntry], keep: str, model_id: str | None) -> Selection:
    """The kept round over the recorded ``rounds`` (in any order): ``keep``, ``metric``,
    ``rounds_kept`` (0: no model yet), ``val_score`` (the kept round's) and per candidate round
    a `ValScore` (score None when not scored; ``examples``: the validation rows of the hospitals
    not left out)."""
    candidates = sorted((r for r in rounds if r.model is not None), key=lambda r: r.round)
    metric = task_metric(model_id, candidates)
    picker = BestRound(keep)
    scored: list[ValScore] = []
    for entry in candidates:
        value = round_score(entry, metric)
        picker.offer(value, round=entry.round)
        examples = entry.evaluate.examples if entry.evaluate is not None else 0
        scored.append(ValScore(round=entry.round, score=value, examples=examples))
    kept_score = picker.score if picker.round else None
    return Selection(keep=keep, metric=metric, rounds_kept=picker.round,
                     val_score=kept_score if kept_score == kept_score else None,
                     val_metric=scored)
