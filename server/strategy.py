"""`RegistryStrategy`: Flower's round loop with fedsplit's registry doing the aggregation.

Flower's `FedAvg` samples hospitals, sends the global model, collects replies and runs
evaluation; this subclass replaces only the two aggregation hooks. Training replies become
`protocol.Update` objects (validated: finite float arrays, integer count >= 1); a reply that
fails is excluded with its reason instead of ending the run, and the merge itself is
`aggregation.aggregate_updates`, the same code the REST upload path and the CLI use.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

import aggregation
from aggregation.base import AggregationStrategy, SiteReport
from protocol.arrays import ArraySpec, check_num_examples
from protocol.errors import FedsplitError, ReplyError
from protocol.update import Update
from server.history import RunHistory

log = logging.getLogger(__name__)

NUM_EXAMPLES_KEY = "num-examples"


def reply_site(msg: Message) -> str:
    """The site name a reply carries, else its node id."""
    record = msg.content.config_records.get("site") if msg.has_content() else None
    if record is not None and "name" in record:
        return str(record["name"])
    return f"node-{msg.metadata.src_node_id}"


def reply_info(msg: Message) -> dict[str, str]:
    """Text the site reports about how it trained (device, parallel mode), besides its name."""
    record = msg.content.config_records.get("site")
    if record is None:
        return {}
    return {k: str(v) for k, v in record.items() if k != "name" and isinstance(v, str)}


def _scalars(record: MetricRecord) -> dict[str, float]:
    return {k: float(v) for k, v in record.items() if isinstance(v, int | float)}


def weighted_mean(rows: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """Count-weighted mean of each metric over the rows that report it."""
    out: dict[str, float] = {}
    keys = {k for _, m in rows for k in m}
    for key in sorted(keys):
        pairs = [(n, m[key]) for n, m in rows if key in m]
        total = sum(n for n, _ in pairs)
        if total:
            out[key] = sum(n * v for n, v in pairs) / total
    return out


def reply_to_update(msg: Message, server_round: int) -> tuple[Update, dict[str, float]]:
    """Convert a training reply into a validated `Update` and its metrics (raises on bad input)."""
    content = msg.content
    if len(content.array_records) != 1 or len(content.metric_records) != 1:
        raise ReplyError(
            f"a training reply must hold exactly one ArrayRecord and one MetricRecord. Received: "
            f"{len(content.array_records)} and {len(content.metric_records)}"
        )
    record = next(iter(content.array_records.values()))
    metrics_record = next(iter(content.metric_records.values()))
    if NUM_EXAMPLES_KEY not in metrics_record:
        raise ReplyError(
            f"the reply's metrics lack {NUM_EXAMPLES_KEY!r}, the sample count that weights it. "
            f"Received: {sorted(metrics_record)}"
        )
    metrics = _scalars(metrics_record)
    count = check_num_examples(metrics_record[NUM_EXAMPLES_KEY], where="reply")
    update = Update.from_array_record(
        record, num_examples=count, site=reply_site(msg), round=server_round,
        metrics={k: v for k, v in metrics.items() if k != NUM_EXAMPLES_KEY},
    )
    return update, metrics


class RegistryStrategy(FedAvg):
    """Flower `FedAvg` round loop whose aggregation is a fedsplit registry strategy.

    Parameters
    ----------
    aggregator : AggregationStrategy
        The registry strategy that merges training replies (``aggregation.get_strategy``).
    history : RunHistory
        Where each round's sites, report, metrics and global model are recorded.
    quorum : int (default: 1)
        Fewest hospitals a round needs: it waits (at most ``deadline``) for that many to be
        connected, and updates the global model only from at least that many valid replies.
    deadline : float | None (default: None)
        The per-phase reply deadline (the run's ``round-timeout``), used to bound the wait for a
        quorum and named in the history when a sampled hospital did not answer in time.
    round_offset : int (default: 0)
        Rounds already completed by an earlier coordinator (resume): Flower's round ``r`` is
        recorded and sent to hospitals as ``r + round_offset``.
    **kwargs
        Passed to Flower's `FedAvg` (``fraction_train``, ``min_train_nodes``, ...).
    """

    def __init__(self, aggregator: AggregationStrategy, history: RunHistory, *, quorum: int = 1,
                 deadline: float | None = None, round_offset: int = 0,
                 cohort_caps: dict[str, int] | None = None, cap_policy: str = "clip",
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cohort_caps = cohort_caps or {}
        self.cap_policy = cap_policy
        self._expected: dict[int, list[ArraySpec]] = {}
        self.aggregator = aggregator
        self.history = history
        self.quorum = max(1, quorum)
        self.deadline = deadline
        self.round_offset = round_offset
        self.site_names: dict[int, str] = {}
        self._sent: dict[tuple[str, int], list[Message]] = {}
        self._skipped: dict[tuple[str, int], str] = {}

    # --- quorum and deadline bookkeeping (sampling stays Flower's) ---------------------------

    def _await_quorum(self, grid: Grid) -> str | None:
        """Wait (bounded by the deadline) until ``quorum`` hospitals are connected; else why not."""
        wait = self.deadline if self.deadline is not None else 3600.0
        limit = time.monotonic() + wait
        while len(nodes := list(grid.get_node_ids())) < self.quorum:
            if time.monotonic() > limit:
                return (f"only {len(nodes)} hospital(s) connected within round-timeout={wait:.0f} s, "
                        f"fewer than the quorum of {self.quorum}; phase skipped, model unchanged")
            time.sleep(1.0)
        return None

    def _configure(self, phase: str, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                   grid: Grid) -> list[Message]:
        if (reason := self._await_quorum(grid)) is not None:
            log.warning("Round %s (%s): %s", server_round, phase, reason)
            self._skipped[(phase, server_round)] = reason
            return []
        configure = super().configure_train if phase == "train" else super().configure_evaluate
        msgs = list(configure(server_round, arrays, config, grid))
        self._sent[(phase, server_round)] = msgs  # Flower sets their message ids when it pushes them
        return msgs

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> list[Message]:
        """Flower's sampling, once a quorum is connected; rounds continue after a resume."""
        # Every reply must match the model sent out this round (names, shapes, dtypes).
        self._expected[server_round + self.round_offset] = [
            ArraySpec(name, tuple(int(d) for d in a.shape), np.dtype(a.dtype))
            for name, a in arrays.items()
        ]
        return self._configure("train", server_round + self.round_offset, arrays, config, grid)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> list[Message]:
        """Flower's sampling for evaluation, once a quorum is connected."""
        return self._configure("evaluate", server_round + self.round_offset, arrays, config, grid)

    def _site(self, msg: Message, senders: dict[str, int]) -> str:
        """Site name of a reply, also for errors the SuperLink wrote on a hospital's behalf."""
        node = senders.get(msg.metadata.reply_to_message_id, msg.metadata.src_node_id)
        if msg.has_content() and "site" in msg.content.config_records:
            self.site_names[node] = reply_site(msg)
        return self.site_names.get(node, f"node-{node}")

    def _missing(self, phase: str, server_round: int,
                 replies: list[Message]) -> tuple[dict[str, int], list[dict[str, Any]]]:
        """(message id -> node, history entries for sampled hospitals that did not answer)."""
        sent = self._sent.pop((phase, server_round), [])
        senders = {m.metadata.message_id: m.metadata.dst_node_id for m in sent if m.metadata.message_id}
        answered = {senders.get(r.metadata.reply_to_message_id, r.metadata.src_node_id)
                    for r in replies}
        limit = f"{self.deadline:.0f} s" if self.deadline is not None else "the deadline"
        missing = [
            {"site": self.site_names.get(m.metadata.dst_node_id, f"node-{m.metadata.dst_node_id}"),
             "excluded": True, "late": True,
             "reason": f"no {phase} reply within round-timeout ({limit})"}
            for m in sent if m.metadata.dst_node_id not in answered
        ]
        for entry in missing:
            log.warning("Round %s: %s: %s", server_round, entry["site"], entry["reason"])
        return senders, missing

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate replies, exclude bad ones, and merge the rest with the registry strategy."""
        server_round += self.round_offset
        replies = list(replies)
        senders, missing = self._missing("train", server_round, replies)
        valid, failed = self._check_and_log_replies(replies, is_train=True, validate=False)
        updates: list[Update] = []
        rows: list[tuple[int, dict[str, float]]] = []
        sites: list[dict[str, Any]] = []
        excluded: list[SiteReport] = []
        for msg in failed:
            reason = f"the site's ClientApp failed: {msg.error.reason}"
            excluded.append(SiteReport(site=self._site(msg, senders), num_examples=0, weight=0.0,
                                       excluded=True, reason=reason))
        for msg in valid:
            self._site(msg, senders)
            try:
                update, metrics = reply_to_update(msg, server_round)
            except FedsplitError as e:
                excluded.append(SiteReport(site=reply_site(msg), num_examples=0, weight=0.0,
                                           excluded=True, reason=str(e)))
                continue
            updates.append(update)
            rows.append((update.num_examples, metrics))
            sites.append({"site": update.site, "num_examples": update.num_examples,
                          "metrics": metrics, "info": reply_info(msg)})
        for rep in excluded:
            log.warning("Round %s: excluded %s: %s", server_round, rep.site, rep.reason)
            sites.append({"site": rep.site, "excluded": True, "reason": rep.reason})
        sites.extend(missing)
        if (skipped := self._skipped.pop(("train", server_round), None)) is not None:
            self.history.record_train(server_round, None, sites, {}, error=skipped)
            return None, None
        if not updates:
            self.history.record_train(server_round, None, sites, {},
                                      error="no usable training replies; global model unchanged")
            return None, None
        if len(updates) < self.quorum:
            error = (f"only {len(updates)} valid training replies, fewer than the quorum of "
                     f"{self.quorum}; global model unchanged")
            log.warning("Round %s: %s", server_round, error)
            self.history.record_train(server_round, None, sites, {}, error=error)
            return None, None
        try:
            result = aggregation.aggregate_updates(
                self.aggregator, updates, expected=self._expected.pop(server_round, None),
                cohort_caps=self.cohort_caps, cap_policy=self.cap_policy,
            )
        except FedsplitError as e:
            log.error("Round %s: aggregation failed: %s", server_round, e)
            self.history.record_train(server_round, None, sites, {}, error=str(e))
            return None, None
        result.report.sites.extend(excluded)
        # Updates the guard excluded (wrong layout, capped-and-refused count) leave the metrics too.
        refused = {r.site: r.reason for r in result.report.sites if r.excluded}
        for entry in sites:
            if entry["site"] in refused and not entry.get("excluded"):
                entry.update(excluded=True, reason=refused[entry["site"]])
        rows = [row for row, update in zip(rows, updates, strict=True) if update.site not in refused]
        metrics = weighted_mean(rows)
        metrics.pop(NUM_EXAMPLES_KEY, None)
        self.history.record_train(server_round, result, sites, metrics)
        return result.to_update().to_array_record(), MetricRecord(metrics)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Count-weighted mean of the sites' held-out metrics."""
        server_round += self.round_offset
        replies = list(replies)
        senders, missing = self._missing("evaluate", server_round, replies)
        valid, failed = self._check_and_log_replies(replies, is_train=False, validate=False)
        rows: list[tuple[int, dict[str, float]]] = []
        sites: list[dict[str, Any]] = []
        for msg in valid:
            record = next(iter(msg.content.metric_records.values()), None)
            if record is None or NUM_EXAMPLES_KEY not in record:
                sites.append({"site": reply_site(msg), "excluded": True,
                              "reason": "evaluation reply without num-examples"})
                continue
            metrics = _scalars(record)
            rows.append((int(metrics[NUM_EXAMPLES_KEY]), metrics))
            sites.append({"site": reply_site(msg), "num_examples": int(metrics[NUM_EXAMPLES_KEY]),
                          "metrics": metrics})
        for msg in failed:
            sites.append({"site": self._site(msg, senders), "excluded": True,
                          "reason": msg.error.reason})
        sites.extend(missing)
        if (skipped := self._skipped.pop(("evaluate", server_round), None)) is not None:
            sites.append({"excluded": True, "reason": skipped})
        metrics = weighted_mean(rows)
        metrics.pop(NUM_EXAMPLES_KEY, None)
        self.history.record_evaluate(server_round, sites, metrics)
        return MetricRecord(metrics) if metrics else None
