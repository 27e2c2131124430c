"""`server.exchange`: Flower's push/pull, checked every POLL_S seconds; `collect_all` refuses a
missing or failed answer."""

from __future__ import annotations

import pytest
from fedsplit.protocol.errors import FederationError
from fedsplit.server import exchange
from flwr.app import Error, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity


class Clock:
    """Stands in for the module's time: sleeping advances it, nothing waits."""

    def __init__(self) -> None:
        self.now, self.sleeps = 0.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class SlowGrid:
    """Each hospital's reply is there ``ready[node]`` seconds after the push (None: never)."""

    def __init__(self, clock: Clock, ready: dict[int, float | None]) -> None:
        self.clock, self.ready, self.pushed = clock, ready, {}

    def push_messages(self, messages):
        for i, msg in enumerate(messages):
            msg.metadata.__dict__["_message_id"] = f"m{i}"
            self.pushed[f"m{i}"] = msg
        return list(self.pushed)

    def pull_messages(self, ids):
        out = []
        for i in ids:
            at = self.ready[self.pushed[i].metadata.dst_node_id]
            if at is not None and self.clock.now >= at:
                out.append(Message(RecordDict({}), reply_to=self.pushed[i]))
        return out


def exchange_with(monkeypatch, ready: dict[int, float | None], timeout: float
                  ) -> tuple[list[Message], Clock]:
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    clock = Clock()
    monkeypatch.setattr(exchange, "time", clock)
    msgs = [Message(RecordDict({}), dst_node_id=n, message_type="train") for n in ready]
    return exchange.send_and_collect(SlowGrid(clock, ready), msgs, timeout=timeout), clock


def test_the_last_reply_is_collected_within_one_poll_of_arriving(monkeypatch) -> None:
    replies, clock = exchange_with(monkeypatch, {1: 0.2, 2: 1.2, 3: 3.1}, timeout=60)
    assert sorted(r.metadata.src_node_id for r in replies) == [1, 2, 3]
    assert set(clock.sleeps) == {exchange.POLL_S} and exchange.POLL_S < 3
    assert 3.1 <= clock.now < 3.1 + exchange.POLL_S  # Flower's HttpGrid: up to 3 s later


def test_a_silent_hospital_ends_the_exchange_at_the_timeout_with_the_others(monkeypatch) -> None:
    replies, clock = exchange_with(monkeypatch, {1: 0.0, 2: None, 3: 2.0}, timeout=10)
    assert sorted(r.metadata.src_node_id for r in replies) == [1, 3]
    assert 10 <= clock.now < 10 + exchange.POLL_S


def test_a_grid_without_push_and_pull_answers_itself() -> None:
    class Plain:
        def send_and_receive(self, messages, *, timeout=None):
            return ["answered"] * len(list(messages))

    assert exchange.send_and_collect(Plain(), [1, 2], timeout=1) == ["answered", "answered"]


def test_collect_all_names_the_agents_that_failed_or_did_not_answer(monkeypatch) -> None:
    """The survival and vertical exchanges need every answer: an error reply, or a hospital
    silent past the deadline, is a FederationError saying which and what."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1

    class Answering:
        def __init__(self, answer) -> None:
            self.answer = answer

        def send_and_receive(self, messages, *, timeout=None):
            return [r for m in messages if (r := self.answer(m)) is not None]

    msgs = [Message(RecordDict({}), dst_node_id=n, message_type="query.survival")
            for n in (1, 2)]
    ok = exchange.collect_all(Answering(lambda m: Message(RecordDict({}), reply_to=m)), msgs,
                              timeout=5, what="query.survival moments")
    assert sorted(r.metadata.src_node_id for r in ok) == [1, 2]
    failing = Answering(lambda m: Message(Error(code=0, reason="no rows"), reply_to=m)
                        if m.metadata.dst_node_id == 2 else Message(RecordDict({}), reply_to=m))
    with pytest.raises(FederationError, match=r"Hospital agent\(s\) failed during query.survival "
                                              r"moments: node 2: no rows"):
        exchange.collect_all(failing, msgs, timeout=5, what="query.survival moments")
    silent = Answering(lambda m: None if m.metadata.dst_node_id == 1
                       else Message(RecordDict({}), reply_to=m))
    with pytest.raises(FederationError, match=r"Only 1 of 2 sites answered query\.embed within 5 s"):
        exchange.collect_all(silent, msgs, timeout=5, what="query.embed", who="site")


class CountingGrid(SlowGrid):
    """SlowGrid that names each pushed message uniquely and notes the most in flight."""

    def __init__(self, clock: Clock, ready: dict[int, float | None]) -> None:
        super().__init__(clock, ready)
        self.in_flight, self.most, self.pushes = set(), 0, 0

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            self.pushes += 1
            key = f"m{self.pushes}"
            msg.metadata.__dict__["_message_id"] = key
            self.pushed[key] = msg
            ids.append(key)
        self.in_flight.update(ids)
        self.most = max(self.most, len(self.in_flight))
        return ids

    def pull_messages(self, ids):
        out = super().pull_messages(ids)
        self.in_flight.difference_update(m.metadata.reply_to_message_id for m in out)
        return out


def test_a_window_keeps_that_many_instructions_in_flight_and_collects_every_reply(
        monkeypatch) -> None:
    """Ten hospitals, a window of three: never more than three in flight, all ten answer; a
    silent hospital's place stays taken until the deadline, and the instructions still unsent
    then count as unanswered."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    clock = Clock()
    monkeypatch.setattr(exchange, "time", clock)
    ready = {n: 0.3 * n for n in range(1, 11)}
    grid = CountingGrid(clock, ready)
    msgs = [Message(RecordDict({}), dst_node_id=n, message_type="train") for n in ready]
    replies = exchange.send_and_collect(grid, msgs, timeout=60, window=3)
    assert sorted(r.metadata.src_node_id for r in replies) == list(range(1, 11))
    assert grid.most == 3 and grid.pushes == 10
    # silent hospitals 1-3 fill the window: nobody else is asked before the deadline
    clock = Clock()
    monkeypatch.setattr(exchange, "time", clock)
    grid = CountingGrid(clock, {1: None, 2: None, 3: None, 4: 0.0, 5: 0.0})
    msgs = [Message(RecordDict({}), dst_node_id=n, message_type="train") for n in range(1, 6)]
    assert exchange.send_and_collect(grid, msgs, timeout=5, window=3) == []
    assert grid.pushes == 3 and 5 <= clock.now < 5 + exchange.POLL_S


def test_the_simulation_engine_gets_the_window_deployment_does_not() -> None:
    from flwr.superlink.grid.inmemory_grid import InMemoryGrid

    assert exchange._window(object.__new__(InMemoryGrid)) >= 16
    assert exchange._window(SlowGrid(Clock(), {})) is None
