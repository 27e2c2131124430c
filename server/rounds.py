"""The coordinator's round loop: one message per hospital per round, one owner per round.

`RoundLoop` runs every horizontal round of a run, plain or secure, with or without
differential privacy. Each round is a `server.bookkeeping.Round` the loop opens, fills and
records::

    open      Round(number = r + round_offset: the rounds the history already holds, a
              resumed run's; the one place the resume offset is applied),
              the model sent and the tensors of it that travel; hooks' before (dp)
    quorum    wait (at most the deadline) for `quorum` connected hospitals, else skipped
    sample    Flower's sampling (`sample_nodes`): max(int(connected x fraction-train), quorum)
    instruct  train instructions (evaluate-first from the second recorded round on)
    prepare   the merge step's stages before training (secure aggregation: setup, share-keys)
              evaluate instructions for model r-1 to every connected hospital not training
    exchange  one send-and-collect (`server.exchange.send_and_collect`, a check every 0.5 s)
    evaluate  model r-1's evaluation, from the train replies and the evaluate replies,
              recorded under round r-1 (`server.merge.Evaluation`)
    merge     the merge step (`server.merge.PlainMerge`, `server.secure.merge.SecureMerge`):
              the replies' history entries and the aggregate, or why the round is short
    close     the server optimizer's step, the tensors that do not travel put back, the round
              recorded (`server.history.RunHistory.record_train`); hooks' after (dp epsilon)

After the last round one evaluate-only exchange scores the final model (the closing
evaluation, its time added to the last round's ``seconds``).

Why one message: Flower's ``Strategy.start`` sends two messages to every hospital each round
(``train``, then ``evaluate`` with the new model); in Flower's deployment runtime every message
starts a fresh ClientApp process at the hospital and waits for the SuperNode's and the
ServerApp's polls, so the second message costs as much as the first (docs/deployment.md).
Here round r's train instruction says ``evaluate-first`` (`protocol.horizontal_wire`): each
hospital scores the model it receives, global model r-1, on its validation rows before it
trains, and its train reply carries those metrics (``evaluation``; under secure aggregation
too, beside the masked vector: the scores travel in the clear as an evaluate reply's would).
So ``history.json``'s ``rounds[r-1].evaluate`` is global model r-1 scored on every hospital's
validation rows, and the kept-round selection (`server.selection`) reads it there. Round 1
scores nothing (model 0 is the untrained start, never a candidate); a resumed run's first round
scores the model it resumes from. A run of N rounds sends N + 1 messages per hospital instead
of 2N (plus secure aggregation's own stages); a hospital whose train reply fails is missing
from both that round's training and the previous model's evaluation, with the same reason.

The recorded round seconds: ``train_seconds`` and ``seconds`` run from the round's opening to
its model saved (the evaluation of model r-1 rides in that time); the last round's ``seconds``
adds the closing evaluation.

Flower's own ``Strategy.start`` stays available to users of Flower's API through the thin
adapter `server.strategy.RegistryStrategy`, which calls this loop's `open`, `evaluated` and
`close` from Flower's hooks.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence

from fedsplit.aggregation.server_optimizers import ServerOptimizer
from fedsplit.protocol import horizontal_wire as wire
from fedsplit.protocol.record.horizontal import SiteEntry
from fedsplit.protocol.update import Update, array_view
from fedsplit.server.bookkeeping import MergeStep, Round, RoundBook, RoundHook, RoundReplies
from fedsplit.server.exchange import replies_at_once, send_and_collect
from fedsplit.server.history import RunHistory
from fedsplit.server.merge import Evaluation
from fedsplit.server.reply_pull import lean_pull_supported
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy.strategy_utils import sample_nodes

log = logging.getLogger(__name__)

QUORUM_POLL_S = 1.0  # seconds between two looks at the connected hospitals while waiting


class RoundLoop:
    """The round loop (module docstring).

    Parameters
    ----------
    history : RunHistory
        Where each round's sites, report, metrics and global model are recorded.
    merge : MergeStep
        How a round's training replies become the next global model.
    evaluation : Evaluation | None (default: None)
        How a model's evaluation replies are averaged (default: the count-weighted mean).
    hooks : Sequence[RoundHook] (default: ())
        Called before and after every round (differential privacy).
    quorum : int (default: 1)
        Fewest hospitals a round needs connected (it waits at most ``deadline`` for them) and
        sampled for training; the merge step counts its own quorum of usable replies.
    deadline : float | None (default: None)
        The per-exchange reply deadline (the run's ``round-timeout``), also bounding the wait
        for a quorum and named in the history when a hospital did not answer in time.
    fraction_train : float (default: 1.0)
        Share of the connected hospitals sampled for training each round.
    server_optimizer : ServerOptimizer | None (default: None)
        Steps on the pseudo-gradient of the merge's aggregate (aggregate minus the model sent
        out), whatever the rule; its state is saved with each round's model.
    federated : Sequence[str] | None (default: None)
        The tensors that travel back from the hospitals (agreed before round 1); None: every
        tensor. The merge and the optimizer cover only these; the new global model keeps the
        others as they were sent.
    site_names : dict[int, str] | None (default: None)
        Node id -> hospital name, as the setup exchange learnt them.
    """

    def __init__(self, history: RunHistory, merge: MergeStep, *,
                 evaluation: Evaluation | None = None, hooks: Sequence[RoundHook] = (),
                 quorum: int = 1, deadline: float | None = None,
                 fraction_train: float = 1.0, server_optimizer: ServerOptimizer | None = None,
                 federated: Sequence[str] | None = None,
                 site_names: dict[int, str] | None = None) -> None:
        self.history = history
        self.merge = merge
        self.evaluation = evaluation if evaluation is not None else Evaluation()
        self.hooks = list(hooks)
        self.quorum = max(1, quorum)
        self.fraction_train = fraction_train
        self.server_optimizer = server_optimizer
        self.federated = tuple(federated) if federated is not None else None
        #: the hospitals' names and the reply deadline (`server.bookkeeping.RoundBook`)
        self.book = RoundBook(site_names=site_names, deadline=deadline)

    # --- the steps of a round (the Flower adapter calls open, evaluated and close too) ------

    def open(self, number: int, arrays: ArrayRecord | None) -> Round:
        """Open round ``number`` (as recorded) sending ``arrays``; the hooks' ``before`` runs."""
        rnd = Round(number)
        if arrays is not None:
            rnd.record = arrays
            rnd.model = {name: array_view(a) for name, a in arrays.items()}  # no second copy
            rnd.shared = (dict(rnd.model) if self.federated is None
                          else {name: rnd.model[name] for name in self.federated})
        for hook in self.hooks:
            hook.before(rnd)
        return rnd

    def await_quorum(self, grid: Grid) -> str | None:
        """Wait (bounded by the deadline) until ``quorum`` hospitals are connected; else why not."""
        wait = self.book.deadline if self.book.deadline is not None else 3600.0
        limit = time.monotonic() + wait
        while len(nodes := list(grid.get_node_ids())) < self.quorum:
            if time.monotonic() > limit:
                return (f"only {len(nodes)} hospital(s) connected within round-timeout={wait:.0f} s, "
                        f"fewer than the quorum of {self.quorum}; phase skipped, model unchanged")
            time.sleep(QUORUM_POLL_S)
        return None

    def evaluated(self, number: int, sent: Sequence[Message], replies: Sequence[Message], *,
                  skipped: str | None = None, seconds: float | None = None) -> MetricRecord | None:
        """Record model ``number``'s evaluation: the ``replies`` (evaluate replies, and train
        replies carrying it) to the instructions ``sent``; the hospitals that did not answer,
        and why the phase was skipped, are listed. ``seconds``: the round's time, when this
        evaluation ends it."""
        replies = list(replies)
        senders, missing = self.book.missing("evaluate", number, sent, replies)
        sites, metrics = self.evaluation(RoundReplies(replies, senders, self.book))
        sites.extend(missing)
        if skipped is not None:
            sites.append(SiteEntry(excluded=True, reason=skipped))
        self.history.record_evaluate(number, sites, metrics, seconds=seconds)
        return MetricRecord(metrics) if metrics else None

    def close(self, rnd: Round, replies: Sequence[Message], *, ends_round: bool = True
              ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Merge the round's training ``replies`` with the merge step, step the server
        optimizer on the aggregate, put back the tensors that do not travel, record the round
        (the one place a training round is recorded) and run the hooks' ``after``. Returns
        the new global model and the training metrics (None, None: the model stays).
        ``ends_round``: the round's ``seconds`` end here (else its evaluation ends them)."""
        replies = list(replies)
        senders, missing = self.book.missing("train", rnd.number, rnd.train, replies)
        try:
            if rnd.skipped is not None:  # nothing was sent; a stray reply is named, left out
                sites = [SiteEntry(site=self.book.site(m, senders), excluded=True,
                                   reason=rnd.skipped) for m in replies]
                self._record_short(rnd, [*sites, *missing], rnd.skipped, ends_round)
                return None, None
            merged = self.merge.merge(rnd, RoundReplies(replies, senders, self.book))
            sites = [*merged.sites, *missing]
            if merged.result is None:
                self._record_short(rnd, sites, merged.error
                                   or "no aggregate; global model unchanged", ends_round)
                return None, None
            result = merged.result
            arrays = result.arrays
            if self.server_optimizer is not None and rnd.shared is not None:
                arrays = self.server_optimizer.step(rnd.shared, result.arrays)
            stepped = self.server_optimizer is not None or self.federated is not None
            arrays = rnd.completed(arrays)
            rnd.seconds = rnd.elapsed()
            self.history.record_train(rnd.number, result, sites, merged.metrics,
                                      arrays=arrays if stepped else None,
                                      server_opt=self.server_optimizer,
                                      train_seconds=rnd.seconds,
                                      seconds=rnd.seconds if ends_round else None)
            update = Update(arrays=arrays, num_examples=result.num_examples)
            return update.to_array_record(), MetricRecord(merged.metrics)
        finally:
            for hook in self.hooks:
                hook.after(rnd)

    def _record_short(self, rnd: Round, sites: list[SiteEntry], error: str, ends_round: bool
                      ) -> None:
        """Record a short round: the global model stays as it was, ``error`` says why."""
        log.warning("Round %s: %s", rnd.number, error)
        rnd.seconds = rnd.elapsed()
        self.history.record_train(rnd.number, None, sites, {}, error=error,
                                  train_seconds=rnd.seconds,
                                  seconds=rnd.seconds if ends_round else None)

    # --- the loop --------------------------------------------------------------------------

    def sample(self, grid: Grid) -> tuple[list[int], list[int]]:
        """Flower's sampling for training: (sampled nodes, every connected node)."""
        size = max(int(len(list(grid.get_node_ids())) * self.fraction_train), self.quorum)
        return sample_nodes(grid, self.quorum, size)

    @staticmethod
    def instructions(nodes: Sequence[int], kind: str, arrays: ArrayRecord, config: ConfigRecord,
                     number: int) -> list[Message]:
        """One ``kind`` instruction per node carrying ``arrays`` and ``config`` with the round
        number (one content shared by all, as Flower's FedAvg builds them)."""
        if not nodes:
            return []
        content = RecordDict({wire.ARRAYS: arrays, wire.CONFIG: ConfigRecord(
            {**dict(config.items()), wire.SERVER_ROUND: number})})
        return [Message(content, dst_node_id=node, message_type=kind) for node in nodes]

    def run(self, grid: Grid, *, initial_arrays: ArrayRecord, num_rounds: int,
            timeout: float | None, train_config: ConfigRecord, evaluate_config: ConfigRecord
            ) -> ArrayRecord:
        """Run ``num_rounds`` rounds, then the closing evaluation (module docstring); return
        the last global model. A resumed run's history already holds the rounds an earlier
        coordinator completed: the loop's round ``r`` is recorded and sent to the hospitals as
        ``r`` plus those."""
        arrays = initial_arrays
        del initial_arrays  # the loop's only reference: each round's model goes once replaced
        round_offset = self.history.record.completed_rounds
        last = num_rounds + round_offset
        rnd = Round(last)
        parks = lean_pull_supported(grid)  # deployment: the SuperLink holds what was sent
        for r in range(1, num_rounds + 1):
            rnd = self.open(r + round_offset, arrays)
            del arrays  # the round holds the model it sends (`Round.record`, parked once pushed)
            log.info("[ROUND %s/%s]", rnd.number, last)
            scored = rnd.number - 1  # the model these instructions carry
            replies: list[Message] = []
            if (reason := self.await_quorum(grid)) is not None:
                log.warning("Round %s: %s", rnd.number, reason)
                rnd.skipped = reason
            else:
                nodes, connected = self.sample(grid)
                config = wire.evaluating_first(train_config) if scored >= 1 else train_config
                rnd.train = self.instructions(nodes, wire.TRAIN, rnd.record, config, rnd.number)
                self.merge.prepare(rnd, grid, timeout)
                if scored >= 1:  # every hospital not training scores model r-1 as before
                    training = {m.metadata.dst_node_id for m in rnd.train}
                    rnd.evaluate = self.instructions(
                        [n for n in connected if n not in training], wire.EVALUATE, rnd.record,
                        evaluate_config, scored)
                replies = send_and_collect(grid, [*rnd.train, *rnd.evaluate], timeout=timeout,
                                           on_reply=functools.partial(self.merge.receive, rnd),
                                           pull_at_once=replies_at_once(rnd.shared_bytes),
                                           on_pushed=rnd.park if parks else None)
            if scored >= 1:
                self.evaluated(scored, [*rnd.train, *rnd.evaluate], replies,
                               skipped=rnd.skipped if not rnd.evaluate else None)
            new, _ = self.close(rnd, [m for m in replies
                                      if m.metadata.message_type == wire.TRAIN])
            arrays = new if new is not None else rnd.sent()  # a short round keeps the model
            del new  # `arrays` is the loop's only reference to the next model
            rnd.let_go()
        self.final_evaluation(grid, rnd, arrays, timeout, evaluate_config)
        return arrays

    def final_evaluation(self, grid: Grid, rnd: Round, arrays: ArrayRecord,
                           timeout: float | None, evaluate_config: ConfigRecord) -> None:
        """Score the last round's model (``arrays``, of round ``rnd``) at every connected
        hospital; its time is added to that round's ``seconds``."""
        log.info("[CLOSING EVALUATION of round %s]", rnd.number)
        started = time.monotonic()
        skipped = self.await_quorum(grid)
        sent = [] if skipped is not None else self.instructions(
            list(grid.get_node_ids()), wire.EVALUATE, arrays, evaluate_config, rnd.number)
        replies = send_and_collect(grid, sent, timeout=timeout) if sent else []
        self.evaluated(rnd.number, sent, replies, skipped=skipped,
                       seconds=round((rnd.seconds or 0.0) + time.monotonic() - started, 3))
