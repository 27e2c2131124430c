"""A round's training replies are folded in as they are pulled (issue 43): by the time the
coordinator pulls the next reply, the ones before it hold no arrays any more; the fold still
merges in site order, so the global model does not depend on which hospital answered first."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fedsplit.protocol import horizontal_wire as wire
from fedsplit.protocol import read_weights
from fedsplit.protocol.record.horizontal import RunRecord
from fedsplit.server import exchange
from fedsplit.server.merge import PlainMerge
from flwr.app import Message, RecordDict

from fedsplit import aggregation
from tests.server.test_exchange import Clock
from tests.server.test_one_message_rounds import Hospitals, run


class Staggered(Hospitals):
    """The scripted hospitals through Flower's push/pull: hospital ``n``'s reply is there
    ``ready[n]`` seconds after the push; at every pull it notes which replies it handed out
    before still carry their arrays."""

    def __init__(self, clock: Clock, ready: dict[int, float]) -> None:
        super().__init__(tuple(ready))
        self.clock, self.ready = clock, ready
        self.pushed: dict[str, tuple[Message, float]] = {}
        self.handed: list[Message] = []
        self.held_at_pull: list[int] = []

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            mid = f"m{len(self.pushed)}"
            msg.metadata.__dict__["_message_id"] = mid
            self.pushed[mid] = (msg, self.clock.now)
            ids.append(mid)
        self.exchanges += 1
        return ids

    def pull_messages(self, ids):
        self.held_at_pull.append(sum(
            1 for r in self.handed
            if r.metadata.message_type == wire.TRAIN and r.has_content()
            and wire.ARRAYS in r.content.array_records))
        out = []
        for mid in ids:
            msg, at = self.pushed[mid]
            if self.clock.now >= at + self.ready[msg.metadata.dst_node_id]:
                out.append(self._answer(msg))
        self.handed.extend(out)
        return out


@pytest.mark.parametrize("ready", [{1: 0.2, 2: 1.1, 3: 2.3}, {1: 2.3, 2: 1.1, 3: 0.2}])
def test_each_reply_is_folded_before_the_next_is_pulled(
        ready: dict[int, float], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(exchange, "time", Clock())
    clock = exchange.time
    grid = Staggered(clock, ready)
    folded: list[int] = []
    real_add = aggregation.Fold.add

    def add(self, update, key=None):
        folded.append(len(grid.handed))  # replies pulled so far when this one is folded
        real_add(self, update, key=key)

    monkeypatch.setattr(aggregation.Fold, "add", add)
    run(tmp_path, grid, rounds=2, merge=PlainMerge(aggregation.get_strategy("fedavg")))
    assert grid.held_at_pull and not any(grid.held_at_pull)  # none held whole at a later pull
    # each reply folded as it came, before the next pull: after 1, 2, 3 pulled (round 1),
    # then 4, 5, 6 (round 2)
    assert folded == [1, 2, 3, 4, 5, 6]


def test_the_global_model_does_not_depend_on_the_arrival_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    models = []
    for k, ready in enumerate(({1: 0.2, 2: 1.1, 3: 2.3}, {1: 2.3, 2: 1.1, 3: 0.2},
                               {1: 0.0, 2: 0.0, 3: 0.0})):
        monkeypatch.setattr(exchange, "time", Clock())
        out = tmp_path / str(k)
        run(out, Staggered(exchange.time, ready), rounds=2)
        models.append(read_weights(out / "global.h5").arrays["w"])
        last = RunRecord.load(out / "history.json").rounds[-1]
        assert [s.site for s in last.train.sites] == ["h1", "h2", "h3"]  # in site order too
    for other in models[1:]:
        np.testing.assert_array_equal(models[0], other)



class Counting(Staggered):
    """`Staggered`, noting how many training replies each pull hands out."""

    def __init__(self, clock: Clock, ready: dict[int, float]) -> None:
        super().__init__(clock, ready)
        self.per_pull: list[int] = []

    def pull_messages(self, ids):
        out = super().pull_messages(ids)
        self.per_pull.append(sum(1 for r in out if r.metadata.message_type == wire.TRAIN))
        return out


@pytest.mark.parametrize(("budget", "at_once"), [(16, 1), (40, 2), (2**30, 3)])
def test_replies_landing_together_are_pulled_as_many_at_a_time_as_the_budget_holds(
        budget: int, at_once: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three 16-byte replies ready at the same check: a pull inflates at most as many as fit
    in the pull budget (at least one), and each is folded before the next pull, so none is held
    whole then; the model is the same whatever the budget."""
    monkeypatch.setattr(exchange, "time", Clock())
    monkeypatch.setattr(exchange, "PULL_BUDGET", budget)
    grid = Counting(exchange.time, {1: 0.2, 2: 0.2, 3: 0.2})
    run(tmp_path, grid, rounds=2)
    assert max(grid.per_pull) == at_once
    assert sum(grid.per_pull) == 6  # every reply of both rounds pulled once
    assert not any(grid.held_at_pull)
    monkeypatch.setattr(exchange, "PULL_BUDGET", 2**30)
    run(tmp_path / "all", Staggered(exchange.time, {1: 0.2, 2: 0.2, 3: 0.2}), rounds=2)
    np.testing.assert_array_equal(read_weights(tmp_path / "global.h5").arrays["w"],
                                  read_weights(tmp_path / "all" / "global.h5").arrays["w"])


def test_replies_at_once_fits_the_budget_and_is_never_zero() -> None:
    assert exchange.replies_at_once(exchange.PULL_BUDGET) == 1
    assert exchange.replies_at_once(exchange.PULL_BUDGET * 3) == 1  # one reply over it: still 1
    assert exchange.replies_at_once(exchange.PULL_BUDGET // 4) == 4
    assert exchange.replies_at_once(0) == exchange.PULL_BUDGET  # unknown size: all at once


def test_pull_at_once_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match=r"pull_at_once is at least 1\. Received: 0"):
        exchange.send_and_collect(Counting(Clock(), {1: 0.0}), [Message(
            RecordDict(), dst_node_id=1, message_type=wire.TRAIN)], timeout=1, pull_at_once=0)
