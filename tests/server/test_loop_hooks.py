"""The round loop's steps and shapes (`server.rounds.RoundLoop`, `server.bookkeeping`): a
merge step the loop steps with the server optimizer and records (the one history writer), a
short or skipped round, a hook around every round, and the book that names the hospitals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fedsplit.aggregation.base import AggregateResult
from fedsplit.aggregation.server_optimizers import ServerOptimizer
from fedsplit.protocol import read_weights
from fedsplit.protocol.aggregation_report import AggregationReport
from fedsplit.protocol.record.horizontal import SiteEntry
from fedsplit.server.bookkeeping import Merge, Round, RoundBook, RoundReplies
from fedsplit.server.history import RunHistory
from fedsplit.server.rounds import RoundLoop
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, RecordDict
from flwr.serverapp import Grid


class Step:
    """A merge step that records what the loop hands it and answers ``merge``."""

    def __init__(self, merge: Merge | None = None) -> None:
        self.answer, self.seen = merge, []

    def prepare(self, rnd: Round, grid: Grid, timeout: float | None) -> None:
        pass

    def merge(self, rnd: Round, replies: RoundReplies) -> Merge:
        if self.answer is None:
            pytest.fail("a skipped round is not merged")
        self.seen.append(rnd)
        return self.answer


class Hook:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def before(self, rnd: Round) -> None:
        self.calls.append(("before", rnd.number))

    def after(self, rnd: Round) -> None:
        self.calls.append(("after", rnd.number))


def _loop(tmp_path: Path, step: Step, **kw) -> RoundLoop:
    history = RunHistory(tmp_path, config={})
    history.set_model("mlp/classification/2/2/-")
    return RoundLoop(history, step, **kw)


def test_a_merge_step_is_stepped_and_recorded_by_the_loop(tmp_path: Path) -> None:
    opt = ServerOptimizer("avgm", lr=0.5, momentum=0.0)
    report = AggregationReport(strategy="mine", params={}, num_examples=7, sites=[])
    step = Step(Merge([SiteEntry(site="a", metrics={"loss": 1.0})],
                      result=AggregateResult({"w": np.full(2, 3.0, np.float32)}, 7, report),
                      metrics={"loss": 1.0}))
    hook = Hook()
    loop = _loop(tmp_path, step, server_optimizer=opt, hooks=[hook])
    rnd = loop.open(1, ArrayRecord({"w": Array(np.ones(2, np.float32))}))
    arrays, metrics = loop.close(rnd, [])
    assert [r.number for r in step.seen] == [1]
    assert [s.name for s in step.seen[0].layout] == ["w"]  # the layout sent out
    # avgm with lr 0.5 and no momentum: halfway from the model sent to the merge's aggregate
    np.testing.assert_allclose(arrays["w"].numpy(), [2.0, 2.0])
    assert metrics["loss"] == 1.0
    assert hook.calls == [("before", 1), ("after", 1)]
    entry = json.loads((tmp_path / "history.json").read_text())["rounds"][0]
    assert entry["train"]["sites"][0]["site"] == "a"
    assert entry["aggregation"]["strategy"] == "mine"
    assert entry["server_opt"]["name"] == "avgm"
    assert entry["seconds"] == entry["train_seconds"] == rnd.seconds
    assert read_weights(tmp_path / "global.h5").arrays["w"].tolist() == [2.0, 2.0]


def test_only_the_travelling_tensors_are_merged_and_the_rest_is_put_back(tmp_path: Path) -> None:
    report = AggregationReport(strategy="mine", params={}, num_examples=7, sites=[])
    step = Step(Merge([SiteEntry(site="a")],
                      result=AggregateResult({"w": np.full(2, 3.0, np.float32)}, 7, report)))
    loop = _loop(tmp_path, step, federated=["w"])
    rnd = loop.open(1, ArrayRecord({"w": Array(np.ones(2, np.float32)),
                                    "bn": Array(np.full(2, 5.0, np.float32))}))
    assert set(rnd.shared) == {"w"} and set(rnd.model) == {"w", "bn"}
    arrays, _ = loop.close(rnd, [])
    assert arrays["bn"].numpy().tolist() == [5.0, 5.0] and arrays["w"].numpy().tolist() == [3, 3]


def test_a_short_merge_keeps_the_model_and_the_loop_records_why(tmp_path: Path) -> None:
    loop = _loop(tmp_path, Step(Merge([SiteEntry(site="a", excluded=True, reason="x")],
                                      error="too few; global model unchanged")))
    assert loop.close(loop.open(1, None), []) == (None, None)
    entry = json.loads((tmp_path / "history.json").read_text())["rounds"][0]
    assert entry["error"] == "too few; global model unchanged"
    assert [s["site"] for s in entry["train"]["sites"]] == ["a"]
    assert not (tmp_path / "global.h5").exists()


def test_a_skipped_round_is_recorded_without_merging(tmp_path: Path) -> None:
    hook = Hook()
    loop = _loop(tmp_path, Step(), hooks=[hook])
    rnd = loop.open(3, None)
    rnd.skipped = "secure aggregation could not start"
    assert loop.close(rnd, []) == (None, None)
    entry = json.loads((tmp_path / "history.json").read_text())["rounds"][0]
    assert entry["round"] == 3 and entry["error"] == "secure aggregation could not start"
    assert hook.calls == [("before", 3), ("after", 3)]


def test_the_book_names_replies_and_the_hospitals_that_did_not_answer() -> None:
    book = RoundBook(site_names={1: "north", 2: "south", 3: "east"}, deadline=30)
    sent = [Message(RecordDict({}), dst_node_id=n, message_type="train") for n in (1, 2, 3)]
    for i, m in enumerate(sent):  # Flower sets the ids when it pushes them
        m.metadata.__dict__["_message_id"] = f"id{i}"
    named = Message(RecordDict({"site": ConfigRecord({"name": "north-2"})}), reply_to=sent[0])
    failed = Message(Error(code=1, reason="boom"), reply_to=sent[1])
    senders, missing = book.missing("train", 4, sent, [named, failed])
    assert [m.site for m in missing] == ["east"]
    assert missing[0].late and "round-timeout (30 s)" in (missing[0].reason or "")
    replies = RoundReplies([named, failed], senders, book)
    assert replies.site(named) == "north-2" and book.site_names[1] == "north-2"
    assert replies.site(failed) == "south"
