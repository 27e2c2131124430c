"""The coordinator's round loop: one message per hospital per round.

Flower's ``Strategy.start`` sends two messages to every hospital each round: ``train`` with the
global model, then ``evaluate`` with the new one. In Flower's deployment runtime every message
starts a fresh ClientApp process at the hospital and waits for the SuperNode's and the
ServerApp's polls, so the second message costs as much as the first (docs/deployment.md).

`run_rounds` drives the same strategy hooks (``configure_train``, ``aggregate_train``,
``configure_evaluate``, ``aggregate_evaluate``, through every wrapper of the stack) with one
exchange per round:

- round r's train instruction says ``evaluate-first`` (`protocol.horizontal_wire`): each
  hospital scores the model it receives, global model r-1, on its validation rows before it
  trains, and its train reply carries those metrics (``evaluation``);
- hospitals Flower did not sample for training in round r (``fraction-train`` < 1) get an
  evaluate instruction for model r-1 in the same exchange, so every connected hospital still
  scores every global model, as before;
- the coordinator records that evaluation under round **r-1**, the round whose model it
  describes, before it records round r's training: ``history.json``'s ``rounds[r-1].evaluate``
  is global model r-1 scored on every hospital's validation rows, exactly what the separate
  evaluate phase recorded, and the kept-round selection (`server.selection`) reads it there;
- round 1 scores nothing (model 0 is the untrained start, never a candidate); a resumed run's
  first round scores the model it resumes from (the last saved round, whose evaluation the
  killed coordinator may not have received);
- after the last round one evaluate-only exchange scores the final model (round N).

Each exchange collects its replies with `server.exchange.send_and_receive` (a check every
0.5 s instead of Flower's 3 s). So a run of N rounds sends N + 1 messages per hospital instead
of 2N, and round r's evaluation is known one round later (``fedsplit up`` prints round r when
it is). A hospital whose train reply fails (an error reply) is missing from both that round's
training and the previous model's evaluation, with the same one-line reason.

A stack that needs its own evaluate phase keeps Flower's loop (`separate_evaluate`): secure
aggregation, whose train reply is the masked vector of `client.secure` and whose rounds
already run three more exchanges (setup, share-keys, unmask).
"""

from __future__ import annotations

import logging

from fedsplit.protocol import horizontal_wire as wire
from fedsplit.server.exchange import send_and_receive
from fedsplit.server.strategy import RegistryStrategy, StrategyWrapper
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

log = logging.getLogger(__name__)


def separate_evaluate(strategy: Strategy) -> bool:
    """Whether some layer of the stack needs Flower's separate evaluate phase (its class says
    ``separate_evaluate = True``, with the reason in its docstring)."""
    layer: Strategy | None = strategy
    while layer is not None:
        if getattr(layer, "separate_evaluate", False):
            return True
        layer = layer.strategy if isinstance(layer, StrategyWrapper) else None
    return False


def _loop(strategy: Strategy) -> RegistryStrategy:
    if isinstance(strategy, RegistryStrategy):
        return strategy
    if isinstance(strategy, StrategyWrapper):
        return strategy.loop
    raise TypeError(f"run_rounds drives a fedsplit strategy stack (a RegistryStrategy, or a "
                    f"wrapper of one). Received: {type(strategy).__name__}")


def run_rounds(strategy: Strategy, grid: Grid, *, initial_arrays: ArrayRecord, num_rounds: int,
               timeout: float, train_config: ConfigRecord, evaluate_config: ConfigRecord) -> None:
    """Run ``num_rounds`` rounds of ``strategy`` (a fedsplit stack) with one message per
    hospital per round, then the closing evaluation (module docstring); a stack that needs a
    separate evaluate phase runs Flower's own ``start`` instead."""
    if separate_evaluate(strategy):
        strategy.start(grid=grid, initial_arrays=initial_arrays, num_rounds=num_rounds,
                       timeout=timeout, train_config=train_config,
                       evaluate_config=evaluate_config)
        return
    loop = _loop(strategy)
    history = loop.history
    history.one_message = True
    arrays = initial_arrays
    for server_round in range(1, num_rounds + 1):
        scored = server_round - 1 + loop.round_offset  # the model these instructions carry
        config = ConfigRecord(dict(train_config.items()))
        if scored >= 1:
            config = wire.evaluating_first(config)
        log.info("[ROUND %s/%s]", server_round + loop.round_offset,
                 num_rounds + loop.round_offset)
        train_msgs = list(strategy.configure_train(server_round, arrays, config, grid))
        eval_msgs: list[Message] = []
        if scored >= 1:  # the hospitals not training this round score model r-1 as before
            training = {m.metadata.dst_node_id for m in train_msgs}
            eval_msgs = [m for m in strategy.configure_evaluate(
                server_round - 1, arrays, ConfigRecord(dict(evaluate_config.items())), grid)
                if m.metadata.dst_node_id not in training]
        replies = send_and_receive(grid, [*train_msgs, *eval_msgs], timeout=timeout)
        train_replies = [r for r in replies if r.metadata.message_type == wire.TRAIN]
        if scored >= 1:
            # every hospital sent model r-1 (train or evaluate) is one awaited evaluation of it
            loop.book.expect("evaluate", scored, [*train_msgs, *eval_msgs])
            strategy.aggregate_evaluate(server_round - 1, replies)
        new_arrays, _ = strategy.aggregate_train(server_round, train_replies)
        if new_arrays is not None:
            arrays = new_arrays
    last = num_rounds + loop.round_offset
    log.info("[CLOSING EVALUATION of round %s]", last)
    history.closing = True
    msgs = list(strategy.configure_evaluate(num_rounds, arrays,
                                            ConfigRecord(dict(evaluate_config.items())), grid))
    strategy.aggregate_evaluate(num_rounds, send_and_receive(grid, msgs, timeout=timeout))
